"""The trainer's side of a weight push, in torch: join the group as rank 0, cut a model's
parameters into buckets, broadcast a bucket flattened, or lay it out in shared memory.

Used by :mod:`sglang_admin.client.trainer` (imported there only when a trainer uses it,
so the client package never needs torch otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import torch

from sglang_admin.model.dist_group import WeightGroup, broadcast_from_trainer, join_group

DEFAULT_BUCKET_BYTES = 256 << 20
ALIGN = 64  # byte alignment of each tensor in a shared-memory segment


@dataclass
class Bucket:
    """Consecutive tensors of one dtype, pushed in one call."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def dtype_names(self) -> list[str]:
        return [str(t.dtype).removeprefix("torch.") for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[Bucket]:
    """Cut (name, tensor) pairs, in order, into buckets of one dtype and at most
    ``bucket_bytes`` each (a larger tensor gets a bucket of its own)."""
    out: list[Bucket] = []
    for name, tensor in named_tensors:
        t = tensor.detach()
        size = t.numel() * t.element_size()
        last = out[-1] if out else None
        if last is None or last.dtype != t.dtype or last.nbytes + size > bucket_bytes:
            last = Bucket()
            out.append(last)
        last.names.append(name)
        last.tensors.append(t)
        last.nbytes += size
    return out


def join_as_trainer(master_address: str, master_port: int, world_size: int,
                    group_name: str, backend: str, timeout_s: float,
                    device: str | None = None) -> WeightGroup:
    """Host the TCPStore and join ``group_name`` as its rank 0; with nccl, the trainer's
    tensors are sent from ``device`` (default: the current CUDA device)."""
    return join_group(master_address, master_port, 0, world_size, group_name, backend,
                      timeout_s, device)


def _device(group: WeightGroup) -> torch.device:
    """Where the group's collectives take their tensors: gloo on CPU, nccl on its GPU."""
    return group.device


def broadcast_bucket(group: WeightGroup, bucket: Bucket, timeout_s: float) -> None:
    """Send the bucket as one flattened tensor (what "flattened_bucket" receives)."""
    flat = torch.cat([t.to(_device(group)).reshape(-1) for t in bucket.tensors])
    broadcast_from_trainer(group, flat, timeout_s)


def broadcast_each(group: WeightGroup, bucket: Bucket, timeout_s: float) -> None:
    """Send the bucket's tensors one broadcast each, in order (SGLang's plain format)."""
    for t in bucket.tensors:
        broadcast_from_trainer(group, t.to(_device(group)).contiguous(), timeout_s)


def write_shared(bucket: Bucket) -> tuple[shared_memory.SharedMemory, list[int]]:
    """A new shared-memory segment holding the bucket's tensors, and each one's offset.

    The caller unlinks the segment once every worker loaded it."""
    offsets: list[int] = []
    size = 0
    for t in bucket.tensors:
        size = -(-size // ALIGN) * ALIGN
        offsets.append(size)
        size += t.numel() * t.element_size()
    shm = shared_memory.SharedMemory(create=True, size=max(size, 1))
    raw = torch.frombuffer(shm.buf, dtype=torch.uint8)
    for t, off in zip(bucket.tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        raw[off:off + n].view(t.dtype).view(t.shape).copy_(t)
    del raw
    return shm, offsets
