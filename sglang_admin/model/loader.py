"""Load a Hugging Face model directory (config.json + *.safetensors) into LlamaForCausalLM."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from sglang_admin.messages import ModelInfo
from sglang_admin.model.config import LlamaConfig
from sglang_admin.model.embedding_spec import (
    EmbeddingSpec,
    SpecError,
    causal_architecture,
    embedding_spec,
)
from sglang_admin.model.llama import LlamaForCausalLM
from sglang_admin.model.load_error import ModelLoadError
from sglang_admin.model.weight_names import UnknownWeightName, model_parameters, resolve

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype for "float32" | "float16" | "bfloat16" (also "fp32", "fp16", "bf16")."""
    aliases = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
               "bf16": "bfloat16"}
    key = aliases.get(name, name)
    if key not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r} (float32, float16 or bfloat16)")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a torch floating dtype ("float32" ...)."""
    return str(dtype).removeprefix("torch.")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def read_hf_config(model_path: str) -> dict[str, Any]:
    """The parsed config.json of a model directory."""
    if not os.path.isdir(model_path):
        raise ModelLoadError(f"model path {model_path!r} is not a directory")
    config_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"no config.json in model directory {model_path!r}")
    return _read_json(config_path)


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _checkpoint_dtype(cfg: dict[str, Any]) -> str:
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return name if name in _DTYPES else "float32"


def parse_config(model_path: str, cfg: dict[str, Any]) -> LlamaConfig:
    """LlamaConfig from config.json, with errors as ModelLoadError."""
    try:
        return LlamaConfig.from_hf(causal_architecture(cfg))  # an embedding model's decoder
    except ValueError as exc:
        raise ModelLoadError(f"{model_path}: {exc}") from None


def read_embedding_spec(model_path: str, cfg: dict[str, Any],
                        is_embedding: bool) -> EmbeddingSpec:
    """model/embedding_spec.py's answer, with errors as ModelLoadError."""
    try:
        return embedding_spec(model_path, cfg, is_embedding)
    except SpecError as exc:
        raise ModelLoadError(f"{model_path}: {exc}") from None


def load_model_info(model_path: str, context_length: int | None = None,
                    is_embedding: bool = False) -> ModelInfo:
    """ModelInfo from config.json and generation_config.json, without loading weights."""
    cfg = read_hf_config(model_path)
    lcfg = parse_config(model_path, cfg)
    spec = read_embedding_spec(model_path, cfg, is_embedding)
    gen_path = os.path.join(model_path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    eos: list[int] = []
    for tok in _id_list(cfg.get("eos_token_id")) + _id_list(gen.get("eos_token_id")):
        if tok not in eos:
            eos.append(tok)
    bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
    pad = cfg.get("pad_token_id", gen.get("pad_token_id"))
    has_tokenizer = any(
        os.path.isfile(os.path.join(model_path, name))
        for name in ("tokenizer.json", "tokenizer_config.json")
    )
    if context_length is not None and context_length <= 0:
        raise ModelLoadError(f"context_length must be positive, got {context_length}")
    return ModelInfo(
        model_path=os.path.abspath(model_path),
        tokenizer_path=os.path.abspath(model_path) if has_tokenizer else None,
        architectures=list(cfg.get("architectures") or []),
        model_type=lcfg.model_type,
        vocab_size=lcfg.vocab_size,
        context_length=context_length or lcfg.max_position_embeddings,
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
        pad_token_id=pad if isinstance(pad, int) else None,
        num_layers=lcfg.num_layers,
        num_attention_heads=lcfg.num_heads,
        num_kv_heads=lcfg.num_kv_heads,
        head_dim=lcfg.head_dim,
        hidden_size=lcfg.hidden_size,
        dtype=_checkpoint_dtype(cfg),
        is_generation=spec.is_generation,
        num_labels=spec.num_labels,
        id2label=dict(spec.id2label),
        embedding_dim=0 if spec.is_generation else (spec.num_labels or lcfg.hidden_size),
        pooling="" if spec.is_generation else spec.pooling.name,
        sampling_defaults=generation_sampling_defaults(gen),
    )


# generation_config.json keys that are sampling defaults (as SGLang's model config reads
# them; length limits such as max_new_tokens are not defaults a router may fill in)
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_sampling_defaults(gen: dict[str, Any]) -> dict[str, float]:
    """The sampling defaults a checkpoint's generation_config.json names: each of
    SAMPLING_DEFAULT_KEYS present with a finite number (others, nulls and non-numbers are
    left out); top_k as an int."""
    out: dict[str, float] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = gen.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        out[key] = int(value) if key == "top_k" else float(value)
    return out


def weight_files(model_path: str) -> list[str]:
    """The safetensors files of a checkpoint (sharded via the index, or all *.safetensors)."""
    index_path = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path} has no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(model_path, name)):
                raise ModelLoadError(f"shard {name} listed in {index_path} is missing")
        return [os.path.join(model_path, name) for name in files]
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in model directory {model_path!r}")
    return [os.path.join(model_path, name) for name in files]


class WeightMismatch(ModelLoadError):
    """A tensor offered to :func:`load_weights` does not fit the served model."""


def iter_checkpoint(model_path: str, skip: frozenset[str] | set[str] = frozenset()
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint's safetensors files, one at a time, as (name, tensor),
    but those named in ``skip`` (not read).

    Tensors are read lazily (one in memory at a time); an unreadable or truncated file is a
    :class:`ModelLoadError` naming it.
    """
    for path in weight_files(model_path):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if name not in skip:
                        yield name, f.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - safetensors' errors are their own type
            raise ModelLoadError(f"cannot read weights {path}: {exc}") from None


def load_weights(
    model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]
) -> set[str]:
    """Copy named tensors into the model's live parameters, in place; the names loaded.

    The one weight-loading path: start-up feeds it a checkpoint, weight updates feed it a
    checkpoint, a process group's broadcasts or a trainer's tensors. Names are the Hugging
    Face ones. Copies go into the existing storage, so the fused q/k/v and gate/up matrices,
    whose per-projection parameters are views of them, see every change, and nothing is
    reallocated. A name the model does not have (``lm_head.weight`` of a tied model aside)
    or a shape that differs raises :class:`WeightMismatch` naming it; tensors are cast to
    the parameter's dtype and device.
    """
    params = model_parameters(model)
    loaded: set[str] = set()
    tensor_parallel = getattr(model, "tensor_parallel", None)
    if tensor_parallel is not None:  # --tp-size > 1: keep this rank's shard of each tensor
        weights = tensor_parallel.shard_weights(weights)
    with torch.no_grad():
        for name, tensor in weights:
            try:
                found = resolve(model, name, params)
            except UnknownWeightName:
                raise WeightMismatch(f"weight {name!r} is not a parameter of this model"
                                     ) from None
            if not found.loads:
                continue
            param = found.param
            assert param is not None
            if param.is_meta:  # model/quant/: a projection kept quantized
                raise WeightMismatch(
                    f"weight {name!r} is kept quantized (GGUF): it is replaced by a refit "
                    "from a GGUF file, or serve with --gguf-dequantize to load it dense")
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightMismatch(
                    f"weight {name!r} has shape {list(tensor.shape)}, the model's is "
                    f"{list(param.shape)}"
                )
            param.copy_(tensor)
            loaded.add(name)
    return loaded


def expected_weights(model: LlamaForCausalLM) -> set[str]:
    """The names a full checkpoint of this model must provide."""
    return set(model_parameters(model))


def missing_message(missing: set[str]) -> str:
    """One line naming the first missing weights."""
    names = sorted(missing)
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return f"weights missing from checkpoint: {', '.join(names[:3])}{more}"


def load_model(
    model_path: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    context_length: int | None = None,
    is_embedding: bool = False,
    tensor_parallel: Any = None,
    quantization: str = "",
) -> tuple[LlamaForCausalLM, ModelInfo]:
    """Build the model from a Hugging Face directory, weights cast to dtype on device.

    The parameters are allocated once (uninitialised), the projections fused, and the
    checkpoint copied in through :func:`load_weights`, the path weight updates take too.
    An embedding or classification checkpoint (or ``is_embedding``) builds
    model/embedding_model.py's LlamaForEmbedding. ``tensor_parallel``
    (model/tensor_parallel.py's, tp > 1): this rank's shard only (causal LMs only).
    ``quantization`` "gguf": a directory converted from a GGUF file keeps the file's
    quantized projections (model/quant/); a --torchao-config name ("int8wo",
    "int4wo-128" ...): the projections are quantized once loaded; the model's ``quant`` is
    then their store.
    """
    info = load_model_info(model_path, context_length, is_embedding)
    cfg = read_hf_config(model_path)
    lcfg = parse_config(model_path, cfg)
    spec = read_embedding_spec(model_path, cfg, is_embedding)
    if tensor_parallel is not None:
        if not spec.is_generation:
            raise ModelLoadError("embedding models are not yet supported with --tp-size > 1")
        tensor_parallel.full_config = lcfg
        lcfg = tensor_parallel.shard_config()
    with torch.device("meta"):
        if spec.is_generation:
            model = LlamaForCausalLM(lcfg).to(dtype)
        else:
            from sglang_admin.model.embedding_model import LlamaForEmbedding

            model = LlamaForEmbedding(lcfg, spec).to(dtype)
    if tensor_parallel is not None:
        tensor_parallel.install(model)
    model.allocate_parameters(device)
    model.eval()
    model.requires_grad_(False)
    kept: set[str] = set()
    if quantization:
        from sglang_admin.model.quant.attach import attach

        kept = attach(model, model_path, quantization, dtype, device, spec.is_generation)
    try:
        loaded = load_weights(model, iter_checkpoint(model_path, kept)) | kept
    except WeightMismatch as exc:
        raise ModelLoadError(f"{model_path}: weights do not fit the config: {exc}") from None
    quant = getattr(model, "quant", None)
    if quant is not None:
        from sglang_admin.model.quant.gguf_load import finish_tied_head

        finish_tied_head(model, quant, True)
    missing = expected_weights(model) - loaded
    if missing:
        raise ModelLoadError(f"{model_path}: {missing_message(missing)}")
    if quantization:
        from sglang_admin.model.quant.attach import quantize_after_load

        quantize_after_load(model, quantization, dtype)
    info.dtype = dtype_name(dtype)
    info.weight_bytes = model.weight_bytes()
    return model, info
