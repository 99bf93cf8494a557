"""Weights a trainer pushes: checked against the model, then received by broadcast from a
process group or read from a shared-memory segment on this host.

Both paths take a manifest (names, dtypes, shapes; offsets for shared memory) that
:func:`check_manifest` validates before a byte moves: every name a parameter of the served
model as model/weight_names.py resolves it (the checkpoint's names; ``lm_head.weight`` of a
tied model, the embedding's other name, and rotary ``inv_freq`` buffers are accepted and
dropped, as a checkpoint's are), every shape the parameter's, every dtype a floating one. Nothing from the client is ever unpickled: the
segment is mapped read-only and viewed as raw bytes at the offsets the manifest gives.
"""

from __future__ import annotations

import mmap
import os
import re
import time
import warnings
from dataclasses import dataclass

import torch

from sglang_admin.model.dist_group import WeightGroup, broadcast_from_trainer
from sglang_admin.model.llama import LlamaForCausalLM
from sglang_admin.model.loader import load_weights
from sglang_admin.model.tensor_parallel import TensorParallel
from sglang_admin.model.weight_names import UnknownWeightName, model_parameters, resolve

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
FLATTENED_BUCKET = "flattened_bucket"
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")


class ManifestError(ValueError):
    """A manifest does not fit the served model (or its segment); says what, in one line."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a manifest, checked."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    target: torch.Tensor | None  # the live parameter (None: accepted and dropped)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def parse_dtype(name: str) -> torch.dtype:
    """torch dtype of "float32" / "torch.float32" / "bfloat16" ... (ManifestError else)."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ManifestError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def check_manifest(
    model: LlamaForCausalLM, names: list[str], dtypes: list[str], shapes: list[list[int]],
    load_format: str = "",
) -> list[TensorSpec]:
    """The manifest as specs, or :class:`ManifestError` naming its first problem."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ManifestError(f"names, dtypes and shapes must have one entry per tensor; got "
                            f"{len(names)}, {len(dtypes)} and {len(shapes)}")
    params = model_parameters(model)
    tensor_parallel = getattr(model, "tensor_parallel", None)  # tp > 1: full shapes come
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    for name, dtype_text, shape in zip(names, dtypes, shapes, strict=True):
        if name in seen:
            raise ManifestError(f"weight {name!r} is listed twice")
        seen.add(name)
        dtype = parse_dtype(dtype_text)
        if any(d < 0 for d in shape):
            raise ManifestError(f"weight {name!r} has a negative dimension in {list(shape)}")
        try:
            found = resolve(model, name, params)
        except UnknownWeightName:
            raise ManifestError(f"weight {name!r} is not a parameter of this model") from None
        if found.param is not None:
            want = tuple(found.param.shape)
            if tensor_parallel is not None:
                want = tensor_parallel.full_shape(found.param_name or name, want)
            if tuple(shape) != want:
                raise ManifestError(f"weight {name!r} has shape {list(shape)}, the model's "
                                    f"is {list(want)}")
        specs.append(TensorSpec(name, dtype, tuple(shape), found.param if found.loads else None))
    if load_format == FLATTENED_BUCKET and len({s.dtype for s in specs}) > 1:
        raise ManifestError("a flattened bucket holds tensors of one dtype; this one mixes "
                            f"{', '.join(sorted({str(s.dtype) for s in specs}))}")
    return specs


def _left(until: float) -> float:
    left = until - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed before every tensor arrived")
    return left


def receive_weights(
    group: WeightGroup, specs: list[TensorSpec], load_format: str, timeout_s: float,
    device: torch.device | None = None, tensor_parallel: TensorParallel | None = None,
) -> int:
    """Receive every tensor from the group's rank 0, in manifest order, and load it; the
    bytes received. A tensor whose dtype and layout are the parameter's lands in it
    directly; others are received aside (on ``device``, the model's: nccl moves CUDA
    tensors), then cast in. All of it within ``timeout_s``.
    Raises on a failed or late broadcast (the weights are then partially updated).
    ``tensor_parallel`` (tp > 1): every rank receives each whole tensor and keeps its shard,
    as SGLang's TP ranks do."""
    until = time.monotonic() + timeout_s
    total = 0

    def keep(spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor_parallel is None else tensor_parallel.shard(spec.name, tensor)

    with torch.no_grad():
        if load_format == FLATTENED_BUCKET:
            if not specs:
                return 0
            flat = group.scratch(sum(s.numel for s in specs), specs[0].dtype, device)
            broadcast_from_trainer(group, flat, _left(until))
            start = 0
            for spec in specs:
                part = flat[start:start + spec.numel].view(spec.shape)
                start += spec.numel
                if spec.target is not None:
                    spec.target.copy_(keep(spec, part))
            return flat.numel() * flat.element_size()
        for spec in specs:
            target = spec.target
            direct = (tensor_parallel is None and target is not None
                      and target.dtype == spec.dtype and target.is_contiguous())
            buf = target if direct else torch.empty(spec.shape, dtype=spec.dtype,
                                                    device=device)
            assert buf is not None
            broadcast_from_trainer(group, buf, _left(until))
            if not direct and target is not None:
                target.copy_(keep(spec, buf))
            total += spec.nbytes
    return total


def shm_path(shm_name: str) -> str:
    """/dev/shm/<name> for a bare segment name (a leading "/" as POSIX names have is fine)."""
    bare = shm_name.removeprefix("/")
    if not _SHM_NAME.match(bare) or bare in (".", ".."):
        raise ManifestError(f"shm_name {shm_name!r} is not a shared-memory segment name "
                            "(letters, digits, '_', '.', '-')")
    return os.path.join(SHM_DIR, bare)


def check_segment(shm_name: str, specs: list[TensorSpec], offsets: list[int]) -> int:
    """The segment's size, once every tensor is found inside it, aligned to its dtype."""
    if len(offsets) != len(specs):
        raise ManifestError(f"offsets must have one entry per tensor; got {len(offsets)} for "
                            f"{len(specs)} tensors")
    path = shm_path(shm_name)
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise ManifestError(f"shared-memory segment {shm_name!r} cannot be opened: "
                            f"{exc.strerror}") from None
    for spec, offset in zip(specs, offsets, strict=True):
        if offset < 0 or offset + spec.nbytes > size:
            raise ManifestError(
                f"weight {spec.name!r} ({spec.nbytes} bytes at offset {offset}) lies outside "
                f"segment {shm_name!r} of {size} bytes")
        if offset % spec.dtype.itemsize:
            raise ManifestError(f"weight {spec.name!r}: offset {offset} is not a multiple of "
                                f"its element size {spec.dtype.itemsize}")
    return size


def load_from_segment(
    model: LlamaForCausalLM, shm_name: str, specs: list[TensorSpec], offsets: list[int]
) -> int:
    """Copy every tensor from the read-only mapped segment into the model; bytes loaded."""
    size = check_segment(shm_name, specs, offsets)
    if size == 0:
        return 0
    fd = os.open(shm_path(shm_name), os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        with warnings.catch_warnings():  # read-only memory: it is only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(mapped, dtype=torch.uint8)
        views = (
            (spec.name, raw[off:off + spec.nbytes].view(spec.dtype).view(spec.shape))
            for spec, off in zip(specs, offsets, strict=True) if spec.target is not None
        )
        load_weights(model, views)
        del raw, views
    finally:
        try:
            mapped.close()
        except BufferError:  # a view outlived the load; the mapping goes with it
            pass
    return sum(s.nbytes for s in specs)
