"""Embed on a GGUF model served as an embedding model (--is-embedding) with its projections
kept quantized (model/quant/): the same vectors as the dequantized load's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from sglang_admin.messages import SamplingParams  # noqa: E402
from sglang_admin.model.gguf import resolve_model_path  # noqa: E402
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.model.step_io import SeqInput  # noqa: E402
from sglang_admin.model.weights import weight_values  # noqa: E402
from sglang_admin.scheduler.embedding import EmbedProgress  # noqa: E402
from tests.gguf_models import write_gguf  # noqa: E402
from tests.unit.test_quant import cache_dir  # noqa: E402, F401 - autouse: a private cache


def _runner(path: str, dtype: str, quantized: bool) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=512,
                       max_running_requests=4, is_embedding=True,
                       quantization="gguf" if quantized else "")


def _embed(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), hidden] vectors of one step prefilling every prompt (no sampling, as
    the scheduler runs an Embed)."""
    params = SamplingParams(max_new_tokens=0)
    seqs, start = [], 1
    for row, ids in enumerate(prompts):
        slots = list(range(start, start + len(ids)))
        start += len(ids)
        seqs.append(SeqInput(row, 0, ids, 0, slots, params, ids, [], sample=False,
                             embed=EmbedProgress()))
    outs = runner.forward_step(seqs)
    assert all(o is not None and o.error is None for o in outs), outs
    return torch.tensor([o.embedding for o in outs])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_embed_on_kept_weights_gives_the_dequantized_loads_vectors(
        tmp_path: Path, qtype: str) -> None:
    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", qtype=qtype, seed=8)))
    ref = _runner(out, "float32", quantized=False)
    kept = _runner(out, "float32", quantized=True)
    store = kept.model.quant
    assert store is not None and not kept.info.is_generation
    # the decoder's projections kept quantized; the LM head, never used, as loaded
    assert store.by_name and "lm_head.weight" not in store.by_name
    assert not kept.model.lm_head.weight.is_meta
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, ref.info.vocab_size, (n,), generator=g).tolist()
               for n in (3, 17)]
    want = _embed(ref, prompts)
    got = _embed(kept, prompts)
    assert (got - want).abs().max().item() < 1e-4
    assert (want[0] - want[1]).abs().max().item() > 1e-2  # different prompts, other vectors
    shape, values = weight_values(kept.model, "model.layers.0.mlp.down_proj.weight", 20)
    assert shape == list(ref.model.model.layers[0].mlp.down_proj.weight.shape)
    # bfloat16 activations (the default for kept weights), one prompt a step: 3 rows through
    # the quantized kernel, 17 through the dense copy; the same directions
    kept16 = _runner(out, "auto", quantized=True)
    got16 = torch.cat([_embed(kept16, [p]) for p in prompts])
    cosine = torch.nn.functional.cosine_similarity(got16, want, dim=-1)
    assert cosine.min().item() > 0.99, cosine



def _derived(source: str, path: Path, kind: str) -> str:
    """The converted checkpoint at ``source`` re-declared without transformers: "base-mean"
    a base model's (LlamaModel: tensors named without "model.", no LM head, mean pooling by
    a sentence-transformers modules.json), "classify" a sequence classifier (a score head
    of 3 labels in place of the LM head)."""
    from safetensors.torch import load_file, save_file

    src = Path(source)
    path.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).symlink_to(src / f)
    tensors: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    head = tensors.pop("lm_head.weight")
    cfg = json.loads((src / "config.json").read_text())
    if kind == "classify":
        cfg.update(architectures=["LlamaForSequenceClassification"], num_labels=3)
        tensors["score.weight"] = head[:3].clone()
    else:
        cfg.update(architectures=["LlamaModel"])
        tensors = {name.removeprefix("model."): t for name, t in tensors.items()}
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"}]))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"pooling_mode_mean_tokens": True}))
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("kind", ["base-mean", "classify"])
def test_embed_on_a_checkpoint_quantized_at_load(tmp_path: Path, kind: str) -> None:
    """--torchao-config on an embedding checkpoint (a base model's, its tensors named
    without "model.", mean pooling) and on a classifier (no LM head; its score head stays
    dense): the vectors of the dense model holding the quantized values (the store's view,
    by the checkpoint's names)."""
    from sglang_admin.model.loader import load_weights

    source = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", qtype="F32", seed=9)))
    path = _derived(source, tmp_path / kind, kind)
    dense = ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=512,
                        max_running_requests=4)
    kept = ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=512,
                       max_running_requests=4, quantization="int4wo-32")
    spec = kept.model.spec
    assert spec.kind == ("classification" if kind == "classify" else "embedding")
    assert spec.unprefixed == (kind == "base-mean") and not hasattr(kept.model, "lm_head")
    store = kept.model.quant
    assert store is not None and len(store.by_name) == 7 * kept.model.config.num_layers
    load_weights(dense.model, [(name, store.dequantized(name)) for name in store.by_name])
    prompts = [list(range(5, 12)), list(range(40, 70))]
    got, want = _embed(kept, prompts), _embed(dense, prompts)
    assert got.shape == (2, 3 if kind == "classify" else kept.model.config.hidden_size)
    assert (got - want).abs().max().item() < 1e-4
    assert (want[0] - want[1]).abs().max().item() > 1e-3
