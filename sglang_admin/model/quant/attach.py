"""Where a model's projections may be kept quantized, and the one call that does it."""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_admin.model.gguf import GgufError
from sglang_admin.model.quant.gguf_load import QUANTIZATION_GGUF, attach_gguf, gguf_source

logger = logging.getLogger(__name__)

QUANTIZATIONS = (QUANTIZATION_GGUF,)


def attach(model: Any, model_path: str, quantization: str, dtype: torch.dtype,
           device: torch.device, is_generation: bool, tensor_parallel: Any) -> set[str]:
    """Keep ``model``'s projections quantized as ``quantization`` says; the names loaded.

    Refused (model/loader.py's ModelLoadError, one line) where it does not apply: not a
    directory converted from a GGUF file, not the CPU, tensor parallelism, an embedding
    model, a dtype the kernels do not take.
    """
    from sglang_admin.model.loader import ModelLoadError

    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization {quantization!r} is not supported "
                             f"(supported: {', '.join(QUANTIZATIONS)})")
    gguf_file = gguf_source(model_path)
    if gguf_file is None:
        raise ModelLoadError(f"{model_path}: quantization gguf needs a GGUF file "
                             "(--model-path FILE.gguf)")
    if device.type != "cpu":
        raise ModelLoadError("GGUF weights are kept quantized on CPU only; on "
                             f"{device.type} serve with --gguf-dequantize")
    if tensor_parallel is not None:
        raise ModelLoadError("GGUF weights kept quantized are not yet served with "
                             "--tp-size > 1; serve with --gguf-dequantize")
    if not is_generation:
        raise ModelLoadError("GGUF weights kept quantized serve generation models only; "
                             "serve an embedding model with --gguf-dequantize")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ModelLoadError(f"GGUF weights kept quantized serve bfloat16 or float32 "
                             f"activations, not {dtype}")
    try:
        store, loaded = attach_gguf(model, gguf_file, dtype)
    except GgufError as exc:
        raise ModelLoadError(str(exc)) from None
    model.quant = store
    logger.warning("%s", store.summary)
    return loaded


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
