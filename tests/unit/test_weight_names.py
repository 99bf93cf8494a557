"""One name resolution for every by-name weight path (model/weight_names.py): the LM head of
a tied model is the embedding for reads, a dropped copy for loads, and the same on the
checkpoint, manifest and read-back paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_admin.model.loader import load_weights
from sglang_admin.model.pushed_weights import ManifestError, check_manifest
from sglang_admin.model.runner import ModelRunner
from sglang_admin.model.weight_names import UnknownWeightName, resolve
from sglang_admin.model.weights import check_checkpoint, weight_values, weights_digest

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)


def _runner(tmp_path: Path, tied: bool) -> ModelRunner:
    path = tmp_path / ("tied" if tied else "untied")
    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(**SMALL, tie_word_embeddings=tied)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return ModelRunner(str(path), device="cpu", dtype="float32", max_total_tokens=64,
                       max_running_requests=2)


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    return _runner(tmp_path_factory.mktemp("names"), tied=True)


def test_lm_head_of_a_tied_model_reads_as_the_embedding(tied: ModelRunner) -> None:
    model = tied.model
    found = resolve(model, "lm_head.weight")
    assert found.param_name == "model.embed_tokens.weight" and found.alias
    assert not found.loads  # a load drops it, as SGLang's load_weights does
    shape, values = weight_values(model, "lm_head.weight", 5)
    embed = model.model.embed_tokens.weight
    assert shape == [96, 64]
    assert values == embed.reshape(-1)[:5].tolist()
    assert weight_values(model, "model.embed_tokens.weight", 5) == (shape, values)


def test_unknown_names_and_computed_buffers(tied: ModelRunner) -> None:
    model = tied.model
    with pytest.raises(UnknownWeightName) as err:
        weight_values(model, "lm_head.bias", 1)
    assert str(err.value) == "the model has no parameter named 'lm_head.bias'"
    buffer = "model.layers.0.self_attn.rotary_emb.inv_freq"
    assert resolve(model, buffer).param is None  # accepted by a load, dropped
    with pytest.raises(UnknownWeightName):
        weight_values(model, buffer, 1)  # but it is no weight to read


def test_untied_model_has_its_own_lm_head(tmp_path: Path) -> None:
    model = _runner(tmp_path, tied=False).model
    found = resolve(model, "lm_head.weight")
    assert found.param_name == "lm_head.weight" and found.loads and not found.alias


def test_every_load_path_treats_the_tied_head_alike(tied: ModelRunner, tmp_path: Path) -> None:
    model = tied.model
    before = weights_digest(model)
    # a load (start-up, refit, pushed tensors) drops the head's copy: the embedding is kept
    assert load_weights(model, [("lm_head.weight", torch.zeros(96, 64))]) == set()
    assert weights_digest(model) == before
    # a manifest checks the head against the embedding's shape, then drops it
    specs = check_manifest(model, ["lm_head.weight"], ["float32"], [[96, 64]])
    assert specs[0].target is None
    with pytest.raises(ManifestError, match=r"'lm_head.weight' has shape \[96, 63\]"):
        check_manifest(model, ["lm_head.weight"], ["float32"], [[96, 63]])
    with pytest.raises(ManifestError, match="'lm_head.bias' is not a parameter"):
        check_manifest(model, ["lm_head.bias"], ["float32"], [[96]])
    # a checkpoint of the tied model passes its own check
    saved = tmp_path / "again"
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)
                                  ).save_pretrained(str(saved), safe_serialization=True)
    check_checkpoint(model, str(saved))
