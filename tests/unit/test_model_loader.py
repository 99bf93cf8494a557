"""Loading Hugging Face directories: errors, ModelInfo, sharded checkpoints, config parsing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from sglang_admin.model.config import LlamaConfig
from sglang_admin.model.loader import ModelLoadError, load_model, load_model_info

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")


def _tiny(path: Path, **overrides: object) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, **overrides,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


def _edit_config(path: Path, **changes: object) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(str(tmp_path / "nope"), dtype=torch.float32, device=CPU)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_info(str(tmp_path))


def test_bad_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model_info(str(tmp_path))


def test_unknown_architecture(tmp_path: Path) -> None:
    path = _tiny(tmp_path / "m")
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel") as exc:
        load_model(str(path), dtype=torch.float32, device=CPU)
    assert isinstance(exc.value, ValueError)
    assert "\n" not in str(exc.value)


def test_unsupported_rope_type(tmp_path: Path) -> None:
    path = _tiny(tmp_path / "m")
    _edit_config(path, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ModelLoadError, match="unsupported rope_scaling type 'dynamic'"):
        load_model_info(str(path))


def test_missing_weights_file_and_tensor(tmp_path: Path) -> None:
    path = _tiny(tmp_path / "m")
    weights = path / "model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match="weights missing.*up_proj"):
        load_model(str(path), dtype=torch.float32, device=CPU)
    weights.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(path), dtype=torch.float32, device=CPU)


def test_shape_mismatch(tmp_path: Path) -> None:
    path = _tiny(tmp_path / "m")
    _edit_config(path, intermediate_size=80)
    with pytest.raises(ModelLoadError, match="do not fit"):
        load_model(str(path), dtype=torch.float32, device=CPU)


def test_model_info(tmp_path: Path) -> None:
    path = _tiny(tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    info = load_model_info(str(path))
    assert info.eos_token_ids == [2, 7]
    assert info.bos_token_id == 1
    assert info.tokenizer_path is None
    assert info.context_length == 64
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.hidden_size) == (2, 2, 8, 32)
    assert load_model_info(str(path), context_length=40).context_length == 40
    model, loaded = load_model(str(path), dtype=torch.bfloat16, device=CPU)
    assert loaded.dtype == "bfloat16"
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32
    assert loaded.weight_bytes == sum(p.numel() * 2 for p in model.parameters())
    d = loaded.to_dict()
    assert d["architectures"] == ["LlamaForCausalLM"] and d["weight_bytes"] > 0
    json.dumps(d)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    hf = transformers.Qwen2ForCausalLM(cfg)
    hf.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model, _ = load_model(str(tmp_path), dtype=torch.float32, device=CPU)
    ours = model.state_dict()
    for name, tensor in hf.state_dict().items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    os.remove(tmp_path / sorted(set(index["weight_map"].values()))[0])
    with pytest.raises(ModelLoadError, match="shard .* is missing"):
        load_model(str(tmp_path), dtype=torch.float32, device=CPU)


def test_config_parsing_old_and_new_rope_layout() -> None:
    base = dict(
        architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4,
        num_hidden_layers=1, vocab_size=10, intermediate_size=8, max_position_embeddings=64,
    )
    old = LlamaConfig.from_hf({**base, "rope_theta": 5e5,
                               "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = LlamaConfig.from_hf({**base, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling
    assert old.head_dim == 16 and old.num_kv_heads == 4
    plain = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 1e4}})
    assert plain.rope_scaling is None
    qwen = LlamaConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"],
                                "use_sliding_window": False, "sliding_window": 32})
    assert qwen.qkv_bias and qwen.sliding_windows == [None]
    mistral = LlamaConfig.from_hf({**base, "architectures": ["MistralForCausalLM"],
                                   "sliding_window": 32})
    assert mistral.sliding_windows == [32]
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="invalid rope_scaling"):
        LlamaConfig.from_hf({**base, "rope_scaling": {"type": "linear"}})


def test_sampling_defaults_come_from_generation_config() -> None:
    from sglang_admin.model.loader import generation_sampling_defaults

    gen = {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "min_p": 0,
           "repetition_penalty": 1.05, "max_new_tokens": 512, "do_sample": True}
    assert generation_sampling_defaults(gen) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
        "repetition_penalty": 1.05}  # length limits are not sampling defaults
    # nulls, non-numbers, booleans and non-finite values are left out
    bad = {"temperature": None, "top_p": "0.9", "top_k": True, "min_p": float("nan"),
           "repetition_penalty": float("inf")}
    assert generation_sampling_defaults(bad) == {}
    assert generation_sampling_defaults({}) == {}
