"""Weight operations on a loaded model: refit from a checkpoint, read back, digest.

Everything goes through :func:`~sglang_admin.model.loader.load_weights`, which copies into
the live parameters in place (the fused q/k/v and gate/up matrices included), so a refit
reallocates nothing.

A refit from disk is checked before a byte is copied: the checkpoint's config must
describe the served architecture with the same shapes, and its safetensors headers must
name every parameter with the right shape. A read that still fails part-way (a file
truncated after its header) restores the weights the model had, by reloading them from
where they came from; :class:`RefitError` says which of the two happened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

import torch
from safetensors import safe_open

from sglang_admin.model.llama import LlamaForCausalLM
from sglang_admin.model.loader import (
    ModelLoadError,
    expected_weights,
    iter_checkpoint,
    load_weights,
    missing_message,
    parse_config,
    read_hf_config,
    weight_files,
)
from sglang_admin.model.weight_names import UnknownWeightName, model_parameters, resolve

logger = logging.getLogger(__name__)

# LlamaConfig fields that may differ between two checkpoints of one served model.
_FREE_FIELDS = frozenset({"max_position_embeddings"})


class RefitError(Exception):
    """A refit did not happen; ``restored`` says whether the old weights are back intact."""

    def __init__(self, message: str, restored: bool = True) -> None:
        super().__init__(message)
        self.restored = restored


def check_checkpoint(model: LlamaForCausalLM, model_path: str) -> None:
    """Refuse a checkpoint that cannot replace the served weights; reads headers only.

    Raises :class:`ModelLoadError` naming the first problem: no such directory, another
    architecture or shape in config.json, a missing parameter, a tensor of another shape
    or one the model does not have.
    """
    new = parse_config(model_path, read_hf_config(model_path))
    tensor_parallel = getattr(model, "tensor_parallel", None)  # tp > 1: shards are served
    served = dataclasses.asdict(
        model.config if tensor_parallel is None else tensor_parallel.full_config)
    for key, value in dataclasses.asdict(new).items():
        if key not in _FREE_FIELDS and served[key] != value:
            raise ModelLoadError(
                f"{model_path}: config.json has {key} = {value!r}, the served model "
                f"{served[key]!r}"
            )
    params = model_parameters(model)
    seen: set[str] = set()
    for path in weight_files(model_path):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    try:
                        found = resolve(model, name, params)
                    except UnknownWeightName:
                        raise ModelLoadError(
                            f"{os.path.basename(path)}: tensor {name!r} is not a parameter "
                            "of the served model"
                        ) from None
                    if not found.loads:
                        continue
                    param = found.param
                    assert param is not None
                    shape = list(f.get_slice(name).get_shape())
                    if tensor_parallel is not None:
                        shape = list(tensor_parallel.shard(
                            name, torch.empty(shape, device="meta")).shape)
                    if shape != list(param.shape):
                        raise ModelLoadError(
                            f"{os.path.basename(path)}: {name} has shape {shape}, the served "
                            f"model's is {list(param.shape)}"
                        )
                    seen.add(name)
        except ModelLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors' errors are their own type
            raise ModelLoadError(f"cannot read weights {path}: {exc}") from None
    missing = expected_weights(model) - seen
    if missing:
        raise ModelLoadError(f"{model_path}: {missing_message(missing)}")


def refit_from_disk(model: LlamaForCausalLM, model_path: str, restore_from: str | None) -> None:
    """Replace every weight with a checkpoint's, in place; on failure put the old ones back.

    ``restore_from`` is the checkpoint the served weights came from (None: they came from
    no checkpoint, e.g. a trainer's tensors, so a failed copy cannot be undone).
    A model whose projections are kept quantized refits from a GGUF file
    (:func:`_refit_quantized`).
    """
    if getattr(model, "quant", None) is not None:
        _refit_quantized(model, model_path)
        return
    try:
        check_checkpoint(model, model_path)
    except ModelLoadError as exc:
        raise RefitError(str(exc)) from None
    try:
        load_weights(model, iter_checkpoint(model_path))
    except Exception as exc:  # noqa: BLE001 - whatever broke, the old weights go back
        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ModelLoadError) else str(exc)
        if restore_from is None:
            raise RefitError(f"{reason}; the weights are partially updated", False) from None
        try:
            load_weights(model, iter_checkpoint(restore_from))
        except Exception as again:  # noqa: BLE001
            raise RefitError(
                f"{reason}; restoring {restore_from} failed too ({again}): the weights are "
                "partially updated",
                False,
            ) from None
        raise RefitError(f"{reason}; the previous weights were restored") from None


def reload_weights(model: LlamaForCausalLM, model_path: str) -> None:
    """Load ``model_path``, the checkpoint the weights came from, into a model whose storage
    was just allocated again (ResumeMemoryOccupation); projections kept quantized are read
    from its GGUF file again, as at start. Raises what the load raised."""
    if getattr(model, "quant", None) is not None:
        _refit_quantized(model, model_path)
        return
    load_weights(model, iter_checkpoint(model_path))


def weights_digest(model: LlamaForCausalLM) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    quant = getattr(model, "quant", None)
    memo: dict[int, torch.Tensor] = {}  # a fused projection dequantized once for its parts
    for name, param in sorted(model_parameters(model).items()):
        if param.is_meta and quant is not None:  # kept quantized: its dequantized values
            data = quant.dequantized(name, memo).contiguous()
        else:
            data = param.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{list(data.shape)}\n".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weight_values(model: LlamaForCausalLM, name: str, truncate_size: int) -> tuple[list[int], list[float]]:
    """(shape, first ``truncate_size`` values of the flattened parameter) as floats.

    ``name`` resolves as every by-name path resolves it (model/weight_names.py): the LM head
    of a tied model answers with the embedding. :class:`UnknownWeightName` (a KeyError)
    when it names no parameter.
    """
    found = resolve(model, name)
    if found.param is None:
        raise UnknownWeightName(name)  # a computed buffer, not a weight
    quant = getattr(model, "quant", None)
    if found.param.is_meta and quant is not None and found.param_name is not None:
        # kept quantized (model/quant/): the values its kernel multiplies with
        return truncated(quant.dequantized(found.param_name), truncate_size)
    return truncated(found.param.detach(), truncate_size)


def truncated(tensor: torch.Tensor, truncate_size: int) -> tuple[list[int], list[float]]:
    """(shape, first ``truncate_size`` values of the flattened ``tensor``) as floats."""
    flat = tensor.reshape(-1)[: max(truncate_size, 0)]
    return list(tensor.shape), flat.to("cpu", torch.float32).tolist()


def _refit_quantized(model: LlamaForCausalLM, model_path: str) -> None:
    """Replace a quantized model's weights with a converted GGUF directory's, its kept
    projections read from the GGUF file again (they may be of other types than before).
    Raises RefitError: ``restored`` True when nothing was changed."""
    from sglang_admin.model.gguf import GgufError
    from sglang_admin.model.quant.gguf_load import (
        QUANTIZATION_GGUF,
        attach_gguf,
        finish_tied_head,
        gguf_source,
    )

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
        spec = getattr(model, "spec", None)  # an embedding model keeps its head as loaded
        store, kept = attach_gguf(model, gguf_file, dtype,
                                  head=spec is None or spec.is_generation)
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
