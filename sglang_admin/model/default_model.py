"""The embedded default model: a small random Llama built deterministically, cached on disk.

With no ``--model-path`` the server needs some model and there is no network, so it builds
one: a byte-level BPE tokenizer (256 byte tokens plus a few special tokens, a ChatML chat
template) and a 4-layer LlamaForCausalLM with weights drawn from a fixed seed. The result
is an ordinary Hugging Face directory that ``transformers`` loads as well.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file

# bump the version whenever the recipe below changes: caches of older builds are not reused
DEFAULT_MODEL_DIRNAME = "default-model-v2"
SEED = 20240601

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
BOS, EOS, IM_START, IM_END, PAD = SPECIAL_TOKENS
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MODEL_SHAPE: dict[str, int] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 8192,
}


def default_cache_dir() -> str:
    """Env SGLANG_ADMIN_CACHE_DIR, else ~/.cache/sglang_admin."""
    return os.environ.get("SGLANG_ADMIN_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang_admin"
    )


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: printable bytes map to themselves, the rest above U+0100."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer_json() -> str:
    """tokenizer.json text: byte-level BPE, ids 0..255 are the bytes, specials after."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok.to_str(pretty=True)


def _token_ids() -> dict[str, int]:
    return {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}


def build_config() -> dict[str, Any]:
    """config.json of the default model (transformers LlamaForCausalLM)."""
    ids = _token_ids()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        **MODEL_SHAPE,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "pad_token_id": ids[PAD],
        "torch_dtype": "float32",
        "use_cache": True,
    }


def build_weights() -> dict[str, torch.Tensor]:
    """Random weights from a fixed seed, scaled so every layer really mixes the context.

    Projections use std 1.5/sqrt(fan_in) and q/k 2/sqrt(fan_in): each layer's contribution
    is of the order of the residual stream and attention is sharp, so the output depends on
    the whole context, not just the last token, and greedy text does not fall into short
    cycles (with the usual 0.02 init it repeats one or two tokens). The LM head is scaled
    for logits of std ~2.
    """
    gen = torch.Generator().manual_seed(SEED)
    hidden = MODEL_SHAPE["hidden_size"]
    inter = MODEL_SHAPE["intermediate_size"]
    heads = MODEL_SHAPE["num_attention_heads"]
    kv_heads = MODEL_SHAPE["num_key_value_heads"]
    head_dim = MODEL_SHAPE["head_dim"]

    def randn(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32) * std

    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(VOCAB_SIZE, hidden, 1.0)}
    for i in range(MODEL_SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qk = 2.0 * hidden**-0.5  # sharp attention: what a token attends to matters
        fan = 1.5 * hidden**-0.5
        weights[p + "self_attn.q_proj.weight"] = randn(heads * head_dim, hidden, qk)
        weights[p + "self_attn.k_proj.weight"] = randn(kv_heads * head_dim, hidden, qk)
        weights[p + "self_attn.v_proj.weight"] = randn(kv_heads * head_dim, hidden, fan)
        weights[p + "self_attn.o_proj.weight"] = randn(hidden, heads * head_dim, fan)
        weights[p + "mlp.gate_proj.weight"] = randn(inter, hidden, fan)
        weights[p + "mlp.up_proj.weight"] = randn(inter, hidden, fan)
        weights[p + "mlp.down_proj.weight"] = randn(hidden, inter, 1.5 * inter**-0.5)
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    # damp the rows of control bytes, non-ASCII bytes and special tokens so that greedy text
    # is mostly printable ASCII and EOS is rare (generations run to max_new_tokens)
    head = randn(VOCAB_SIZE, hidden, 2.0 * hidden**-0.5)
    text = [10] + list(range(32, 127))
    damp = torch.full((VOCAB_SIZE, 1), 0.3)
    damp[text] = 1.0
    weights["lm_head.weight"] = head * damp
    return weights


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def write_default_model(out_dir: str) -> None:
    """Write every file of the default model into an existing, empty directory."""
    ids = _token_ids()
    _write_json(os.path.join(out_dir, "config.json"), build_config())
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            "bos_token_id": ids[BOS],
            "eos_token_id": [ids[EOS], ids[IM_END]],
            "pad_token_id": ids[PAD],
            "do_sample": False,
        },
    )
    save_file(build_weights(), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(build_tokenizer_json())
    added = {
        str(ids[name]): {
            "content": name, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for name in SPECIAL_TOKENS
    }
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": BOS,
            "eos_token": IM_END,
            "pad_token": PAD,
            "additional_special_tokens": [IM_START, IM_END],
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MODEL_SHAPE["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        os.path.join(out_dir, "special_tokens_map.json"),
        {
            "bos_token": BOS,
            "eos_token": IM_END,
            "pad_token": PAD,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )


def ensure_default_model(cache_dir: str | None = None) -> str:
    """The directory of the default model, building it on first use.

    It lives in ``<cache_dir>/default-model-v2`` (cache_dir defaults to
    :func:`default_cache_dir`). The build happens in a temporary sibling directory that is
    renamed into place, so a reader never sees a half-written model; when another process
    wins the race, its copy (identical, the build is deterministic) is used.
    """
    root = cache_dir or default_cache_dir()
    target = os.path.join(root, DEFAULT_MODEL_DIRNAME)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_DIRNAME}-", dir=root)
    try:
        os.chmod(tmp, 0o755)
        write_default_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target
