"""Where a model's projections may be kept quantized, and the one call that does it."""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_admin.model.gguf import GgufError
from sglang_admin.model.quant.gguf_load import QUANTIZATION_GGUF, attach_gguf, gguf_source
from sglang_admin.model.quant.online import TORCHAO_CONFIGS, quantize_loaded

logger = logging.getLogger(__name__)

QUANTIZATIONS = (QUANTIZATION_GGUF, *TORCHAO_CONFIGS)


def attach(model: Any, model_path: str, quantization: str, dtype: torch.dtype,
           device: torch.device, is_generation: bool, tensor_parallel: Any) -> set[str]:
    """Keep ``model``'s projections quantized as ``quantization`` says; the names loaded.

    Refused (model/loader.py's ModelLoadError, one line) where it does not apply: not a
    directory converted from a GGUF file, not the CPU, tensor parallelism, an embedding
    model, a dtype the kernels do not take.
    """
    from sglang_admin.model.loader import ModelLoadError

    check_applies(quantization, device, is_generation, tensor_parallel, dtype)
    if quantization != QUANTIZATION_GGUF:
        return set()  # quantized after the dense load: quantize_after_load
    gguf_file = gguf_source(model_path)
    if gguf_file is None:
        raise ModelLoadError(f"{model_path}: quantization gguf needs a GGUF file "
                             "(--model-path FILE.gguf)")
    try:
        store, loaded = attach_gguf(model, gguf_file, dtype)
    except GgufError as exc:
        raise ModelLoadError(str(exc)) from None
    model.quant = store
    logger.warning("%s", store.summary)
    return loaded


def check_applies(quantization: str, device: torch.device, is_generation: bool,
                  tensor_parallel: Any, dtype: torch.dtype) -> None:
    """ModelLoadError (one line) where weights cannot be served quantized."""
    from sglang_admin.model.loader import ModelLoadError

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
    if tensor_parallel is not None:
        raise ModelLoadError(f"{what}: not yet with --tp-size > 1; {dense}")
    if not is_generation:
        raise ModelLoadError(f"{what}: generation models only; {dense}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ModelLoadError(f"{what}: bfloat16 or float32 activations, not {dtype}")


def quantize_after_load(model: Any, quantization: str, dtype: torch.dtype) -> None:
    """A --torchao-config model: its projections quantized now that they are loaded."""
    if quantization == QUANTIZATION_GGUF:
        return
    model.quant = quantize_loaded(model, quantization, dtype)
    logger.warning("%s", model.quant.summary)


def refit_quantized(model: Any, model_path: str) -> None:
    """Replace a quantized model's weights with a converted GGUF directory's, its kept
    projections read from the GGUF file again (they may be of other types than before).
    Raises model/weights.py's RefitError: ``restored`` True when nothing was changed."""
    from sglang_admin.model.loader import ModelLoadError, iter_checkpoint, load_weights
    from sglang_admin.model.quant.gguf_load import finish_tied_head
    from sglang_admin.model.weights import RefitError, check_checkpoint

    try:
        check_checkpoint(model, model_path)
    except ModelLoadError as exc:
        raise RefitError(str(exc)) from None
    if model.quant.scheme != QUANTIZATION_GGUF:
        raise RefitError(f"weights quantized at load (--torchao-config {model.quant.scheme}) "
                         "are not refit yet; the served weights are unchanged")
    gguf_file = gguf_source(model_path)
    if gguf_file is None:
        raise RefitError(f"{model_path}: the served weights are kept quantized (GGUF): a refit "
                         "takes a GGUF file (or serve with --gguf-dequantize)")
    dtype = model.model.norm.weight.dtype
    try:
        store, kept = attach_gguf(model, gguf_file, dtype)
    except GgufError as exc:  # raised while reading, before any weight changed
        raise RefitError(str(exc)) from None
    model.quant = store
    try:
        load_weights(model, iter_checkpoint(model_path, kept))
        finish_tied_head(model, store, True)
    except Exception as exc:  # noqa: BLE001 - the projections are new already
        raise RefitError(f"{type(exc).__name__}: {exc}; the weights are partially updated",
                         False) from None
    logger.warning("refit: %s", store.summary)
