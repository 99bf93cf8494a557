"""The kept projections of a GGUF file, prepared once: saved beside its conversion and read
back at the next start instead of being repacked.

Reading a GGUF file's quantized tensors and repacking them for torch's kernels
(model/quant/gguf_load.py) costs about 10 s of CPU for SmolLM2-135M on two cores: the
``gguf`` package parses all of the file's metadata (the tokenizer's 49k strings) before its
tensor table, and each projection is repacked and dequantized into its dense copy. The
result depends only on the file, the served dtype and this module's format, so the first
start writes it into ``kept-<dtype>.safetensors`` in the file's converted directory
(model/gguf.py's cache, whose name already changes with the file's size and mtime), and the
next starts read that instead (about 1 s).

The file holds tensors only (safetensors, no pickle); its metadata says which projections
they form (JSON). A file of another format or torch version, or one that cannot be read,
is ignored and written again; a cache directory that cannot be written just means the next
start repacks too. Ranks that start at once (data parallel, a PD pair) take turns on a lock
file beside it: one repacks, the others read what it saved.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_admin.model.gguf import cache_lock
from sglang_admin.model.quant import amx, gemv, hugepages
from sglang_admin.model.quant.linear import ConcatLinear, Projection, QuantLinear

logger = logging.getLogger(__name__)

# bump whenever what QuantLinear holds, or how it is packed, changes
FORMAT = "5"
# QuantLinear's tensors, saved under "<entry>.<name>" when set
_TENSORS = ("packed", "scales_zeros", "q8", "row_scale", "row_scale_f32", "block_scale_f32",
            "q4", "group_scale_f32", "group_zero_f32", "gemv_w", "gemv_s", "amx_codes", "amx_sz")
_SCALARS = ("kind", "pad", "repeat", "group", "kernel_rows")


@dataclass
class Prepared:
    """A file's kept projections: each by the Hugging Face names it serves (in order), the
    tied LM head's quantized copy of the embedding, and the one-line summary."""

    projections: dict[tuple[str, ...], Projection] = field(default_factory=dict)
    tied_head: QuantLinear | None = None
    summary: str = ""


def prepared_path(model_dir: str, dtype: torch.dtype) -> str:
    """Where the prepared projections of a converted directory live, per served dtype."""
    return os.path.join(model_dir, f"kept-{str(dtype).removeprefix('torch.')}.safetensors")


def _gemv_mark() -> str:
    """Whether the projections hold the few-row kernel's layouts (model/quant/gemv.py):
    a file prepared on a CPU with the kernel is prepared again on one without, and back."""
    return "1" if gemv.gemv_kernel() is not None else "0"


def _amx_mark() -> str:
    """Whether the projections hold the AMX kernel's layouts (model/quant/amx.py), as
    :func:`_gemv_mark` for the few-row kernel."""
    return "1" if amx.amx_kernel() is not None else "0"


def _quant_spec(p: QuantLinear, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "quant", "key": key, "shape": list(p.shape)}
    spec.update({name: getattr(p, name) for name in _SCALARS})
    for name in _TENSORS:
        value = getattr(p, name)
        if value is not None:
            tensors[f"{key}.{name}"] = value.contiguous()
    has_dense = p.dense is not None or p._dense_packed is not None
    if has_dense:  # the copy before oneDNN's packing (its layout is not portable)
        tensors[f"{key}.dense"] = p.dequantized().contiguous() if p.dense is None else p.dense
    spec["dense"] = has_dense
    spec["dense_is_values"] = has_dense and p.dense_is_values
    return spec


def _spec(p: Projection, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if isinstance(p, QuantLinear):
        return _quant_spec(p, key, tensors)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(p.parts):
        if isinstance(part, QuantLinear):
            parts.append(_quant_spec(part, f"{key}.{i}", tensors))
        else:
            tensors[f"{key}.{i}"] = part.contiguous()
            parts.append({"type": "dense", "key": f"{key}.{i}"})
    return {"type": "concat", "parts": parts}


def save_prepared(prepared: Prepared, model_dir: str, dtype: torch.dtype) -> None:
    """Write ``prepared`` for the next start; a directory that cannot be written is left as
    it is (logged)."""
    tensors: dict[str, torch.Tensor] = {}
    entries = [{"names": list(names), "projection": _spec(p, f"p{i}", tensors)}
               for i, (names, p) in enumerate(prepared.projections.items())]
    tied = None if prepared.tied_head is None else _quant_spec(prepared.tied_head, "tied",
                                                               tensors)
    meta = {"format": FORMAT, "torch": torch.__version__, "summary": prepared.summary,
            "gemv": _gemv_mark(), "amx": _amx_mark(),
            "entries": json.dumps(entries), "tied_head": json.dumps(tied)}
    target = prepared_path(model_dir, dtype)
    tmp = ""
    try:
        from safetensors.torch import save_file

        fd, tmp = tempfile.mkstemp(prefix=".kept-", suffix=".tmp", dir=model_dir)
        os.close(fd)
        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)  # a reader sees the whole file or none
        tmp = ""
    except OSError as exc:
        logger.info("the prepared GGUF projections are not saved (%s): the next start "
                    "repacks them", exc)
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _restore_quant(spec: dict[str, Any], tensors: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> QuantLinear:
    p = QuantLinear.__new__(QuantLinear)
    p.dtype = dtype
    for name in _SCALARS:
        setattr(p, name, spec[name])
    p.shape = tuple(spec["shape"])
    key = spec["key"]
    for name in _TENSORS:
        setattr(p, name, tensors.get(f"{key}.{name}"))
    p._amx = amx.amx_kernel() if p.amx_codes is not None else None
    p.dense, p._dense_packed, p.dense_is_values = None, None, False
    if spec["dense"]:
        p.set_dense(tensors[f"{key}.dense"], from_values=spec["dense_is_values"])
    return p


def _restore(spec: dict[str, Any], tensors: dict[str, torch.Tensor],
             dtype: torch.dtype) -> Projection:
    if spec["type"] == "quant":
        return _restore_quant(spec, tensors, dtype)
    return ConcatLinear([_restore_quant(part, tensors, dtype) if part["type"] == "quant"
                         else tensors[part["key"]] for part in spec["parts"]])


def load_prepared(model_dir: str, dtype: torch.dtype) -> Prepared | None:
    """The projections saved by :func:`save_prepared`; None when there are none, or they are
    of another format or torch version, or cannot be read (then logged)."""
    path = prepared_path(model_dir, dtype)
    if not os.path.isfile(path):
        return None
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if (meta.get("format") != FORMAT or meta.get("torch") != torch.__version__
                    or meta.get("gemv") != _gemv_mark() or meta.get("amx") != _amx_mark()):
                return None
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        entries = json.loads(meta["entries"])
        tied = json.loads(meta["tied_head"])
        prepared = Prepared(summary=meta["summary"])
        for entry in entries:
            prepared.projections[tuple(entry["names"])] = _restore(entry["projection"],
                                                                   tensors, dtype)
        if tied is not None:
            prepared.tied_head = _restore_quant(tied, tensors, dtype)
        return prepared
    except Exception as exc:  # noqa: BLE001 - a damaged cache file: repack from the GGUF
        logger.warning("the prepared GGUF projections in %s cannot be read (%s: %s): "
                       "repacking them from the GGUF file", path, type(exc).__name__, exc)
        return None


def prepared_once(model_dir: str, dtype: torch.dtype,
                  build: Callable[[], Prepared]) -> Prepared:
    """The prepared projections of ``model_dir`` in ``dtype``: read back, or ``build()`` and
    saved for the next start. Processes asking at once take turns: one builds, the others
    read its file. Where no lock can be taken (a read-only cache), each builds its own."""
    prepared = load_prepared(model_dir, dtype)
    if prepared is not None:
        return prepared
    with contextlib.ExitStack() as stack:
        try:
            saved = prepared_path(model_dir, dtype)
            lock = os.path.join(model_dir, f".{os.path.basename(saved)}.lock")
            stack.enter_context(cache_lock(lock))
        except OSError:  # a cache we may not write: no turns to take, nothing to save
            return build()
        prepared = load_prepared(model_dir, dtype)  # saved by another rank meanwhile
        if prepared is None:
            built = build()
            save_prepared(built, model_dir, dtype)
            # served from the file, as every later start is: the built tensors are heap
            # memory, which glibc could not all hand back when the weights are released
            prepared = load_prepared(model_dir, dtype)
            if prepared is None:  # not saved (logged)
                return built
            del built
            hugepages.return_freed()
        return prepared
