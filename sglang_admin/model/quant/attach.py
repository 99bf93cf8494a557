"""Where a model's projections may be kept quantized, and the one call that does it."""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_admin.model.gguf import GgufError
from sglang_admin.model.load_error import ModelLoadError
from sglang_admin.model.quant.gguf_load import QUANTIZATION_GGUF, attach_gguf, gguf_source
from sglang_admin.model.quant.online import TORCHAO_CONFIGS, quantize_loaded

logger = logging.getLogger(__name__)

QUANTIZATIONS = (QUANTIZATION_GGUF, *TORCHAO_CONFIGS)


def attach(model: Any, model_path: str, quantization: str, dtype: torch.dtype,
           device: torch.device, is_generation: bool) -> set[str]:
    """Keep ``model``'s projections quantized as ``quantization`` says; the names loaded.

    Refused (model/loader.py's ModelLoadError, one line) where it does not apply: not a
    directory converted from a GGUF file, not the CPU, a dtype the kernels do not take. An embedding model (``is_generation``
    false) keeps its decoder's projections quantized; its LM head, which it never
    multiplies with, stays as loaded. At --tp-size > 1 (``model.tensor_parallel``) each
    rank keeps its shard (model/quant/shard.py).
    """
    check_applies(quantization, device, dtype)
    if quantization != QUANTIZATION_GGUF:
        return set()  # quantized after the dense load: quantize_after_load
    gguf_file = gguf_source(model_path)
    if gguf_file is None:
        raise ModelLoadError(f"{model_path}: quantization gguf needs a GGUF file "
                             "(--model-path FILE.gguf)")
    try:
        store, loaded = attach_gguf(model, gguf_file, dtype, head=is_generation)
    except GgufError as exc:
        raise ModelLoadError(str(exc)) from None
    model.quant = store
    logger.warning("%s", store.summary)
    return loaded


def check_applies(quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    """ModelLoadError (one line) where weights cannot be served quantized."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization {quantization!r} is not supported "
                             f"(supported: {', '.join(QUANTIZATIONS)})")
    what = ("GGUF weights kept quantized" if quantization == QUANTIZATION_GGUF
            else f"--torchao-config {quantization}")
    dense = ("serve with --gguf-dequantize" if quantization == QUANTIZATION_GGUF
             else "serve without --torchao-config")
    if device.type != "cpu":
        raise ModelLoadError(f"{what}: CPU only (torch's int4/int8 CPU kernels); on "
                             f"{device.type} {dense}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ModelLoadError(f"{what}: bfloat16 or float32 activations, not {dtype}")


def quantize_after_load(model: Any, quantization: str, dtype: torch.dtype) -> None:
    """A --torchao-config model: its projections quantized now that they are loaded."""
    if quantization == QUANTIZATION_GGUF:
        return
    spec = getattr(model, "spec", None)  # model/embedding_model.py's: not a generator
    model.quant = quantize_loaded(model, quantization, dtype,
                                  head=spec is None or spec.is_generation)
    logger.warning("%s", model.quant.summary)
