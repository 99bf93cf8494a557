"""Weight operations: refit checks and rollback, digests, read-back, memory release."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sglang_admin.model import weights as weight_ops
from sglang_admin.model.loader import ModelLoadError, iter_checkpoint, load_weights
from sglang_admin.model.runner import ModelRunner
from sglang_admin.model.weights import (
    RefitError,
    check_checkpoint,
    refit_from_disk,
    weight_values,
    weights_digest,
)

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)


def _qwen2(path: Path, seed: int, **overrides: object) -> str:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**{**SMALL, **overrides})
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpts")
    return {"a": _qwen2(root / "a", 1), "b": _qwen2(root / "b", 2)}


def _runner(path: str) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=256,
                       max_running_requests=4)


def test_check_checkpoint_names_the_first_mismatch(ckpts: dict[str, str], tmp_path: Path) -> None:
    model = _runner(ckpts["a"]).model
    check_checkpoint(model, ckpts["b"])  # same architecture and shapes: fine
    with pytest.raises(ModelLoadError, match="not a directory"):
        check_checkpoint(model, str(tmp_path / "missing"))
    wide = _qwen2(tmp_path / "wide", 3, intermediate_size=128)
    with pytest.raises(ModelLoadError, match="intermediate_size = 128, the served model 112"):
        check_checkpoint(model, wide)
    llama = tmp_path / "llama"
    torch.manual_seed(4)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).save_pretrained(str(llama))
    with pytest.raises(ModelLoadError, match="architecture = 'LlamaForCausalLM'"):
        check_checkpoint(model, str(llama))


def test_check_checkpoint_reads_the_tensors_headers(ckpts: dict[str, str], tmp_path: Path) -> None:
    model = _runner(ckpts["a"]).model
    broken = Path(_qwen2(tmp_path / "c", 5))
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"up_proj.weight has shape \[3, 3\]"):
        check_checkpoint(model, str(broken))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="weights missing from checkpoint: .*up_proj"):
        check_checkpoint(model, str(broken))
    data = (Path(ckpts["b"]) / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ModelLoadError, match="cannot read weights"):
        check_checkpoint(model, str(broken))


def test_refit_replaces_every_weight_and_changes_the_digest(ckpts: dict[str, str]) -> None:
    runner = _runner(ckpts["a"])
    before = weights_digest(runner.model)
    assert before == weights_digest(_runner(ckpts["a"]).model)  # deterministic
    refit_from_disk(runner.model, ckpts["b"], restore_from=ckpts["a"])
    assert weights_digest(runner.model) == weights_digest(_runner(ckpts["b"]).model) != before
    name = "model.layers.1.self_attn.q_proj.weight"
    shape, values = weight_values(runner.model, name, 5)
    expected = load_file(str(Path(ckpts["b"]) / "model.safetensors"))[name]
    assert shape == list(expected.shape)
    assert values == pytest.approx(expected.reshape(-1)[:5].tolist())
    with pytest.raises(KeyError):
        weight_values(runner.model, "no.such.weight", 5)


def test_a_refit_that_fails_part_way_restores_the_old_weights(
    ckpts: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(ckpts["a"])
    before = weights_digest(runner.model)
    real = iter_checkpoint

    def breaks_half_way(path: str) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(real(path)):
            if path == ckpts["b"] and i == 5:
                raise OSError("disk went away")
            yield item

    monkeypatch.setattr(weight_ops, "iter_checkpoint", breaks_half_way)
    with pytest.raises(RefitError, match="disk went away; the previous weights were restored") as exc:
        refit_from_disk(runner.model, ckpts["b"], restore_from=ckpts["a"])
    assert exc.value.restored
    assert weights_digest(runner.model) == before
    with pytest.raises(RefitError, match="partially updated") as exc:
        refit_from_disk(runner.model, ckpts["b"], restore_from=None)
    assert not exc.value.restored


def test_release_and_resume_memory(ckpts: dict[str, str]) -> None:
    runner = _runner(ckpts["a"])
    digest = weights_digest(runner.model)
    assert runner.release_kv_cache() == runner.kv_cache_bytes > 0
    assert runner.kv_cache_released and runner.release_kv_cache() == 0
    assert runner.release_weights() == runner.weight_bytes > 0
    assert runner.weights_released
    runner.resume_kv_cache()
    runner.resume_weights()
    assert not runner.kv_cache_released and not runner.weights_released
    load_weights(runner.model, iter_checkpoint(ckpts["a"]))
    assert weights_digest(runner.model) == digest
    attn = runner.model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # fused again


def test_config_json_is_read_from_the_new_checkpoint(ckpts: dict[str, str], tmp_path: Path) -> None:
    runner = _runner(ckpts["a"])
    path = Path(_qwen2(tmp_path / "d", 6))
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RefitError, match="num_kv_heads = 4, the served model 2"):
        refit_from_disk(runner.model, str(path), restore_from=ckpts["a"])
