"""A room's rows in groups of about ``GROUP_BYTES``, as the `zmq` backend moves them.

A group is ``(a, b, r0, r1)``: rows ``r0..r1`` of the room (positions in its slot list) of
buffers ``a..b``. Small buffers' rows are grouped whole; a buffer whose rows alone are over
the limit is cut into row ranges (even cuts). The group size is what one side moves, then
sums: on decode the rows a ``recv`` just wrote are still in the core's cache (summed at
~55-60 GB/s here, against ~8-15 GB/s from memory), which a group's rows and the socket's
copy of them (``2 x GROUP_BYTES``) must fit in (2 MiB of L2 here); larger groups also leave
the sum of a room's last group after its last byte. 512 KiB measured best of 0.5 / 1 /
2 MiB in `tools/bench_pd_transfer.py` (CPU clock, 32 / 256 / 2048 tokens).

Each helper covers one group: the pool's own rows of a run of slots as byte views
(``run_views``) and their sum (``sum_run``); rows gathered from, or scattered into, other
slots through a staging block (``gather``, ``scatter``), with their sum taken as they are
copied (the kv_rows kernel; numpy, or torch for a device pool, where it is not built).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from sglang_admin.disaggregation.kv_rows import GATHER, SCATTER
from sglang_admin.disaggregation.transfer import RegisteredPool, byte_rows, crc32

#: bytes of rows moved, then summed, at a time (see the module doc)
GROUP_BYTES = 512 << 10

Group = tuple[int, int, int, int]


def groups(items: Sequence[int], n: int, limit: int | None = None) -> tuple[Group, ...]:
    """The groups of ``n`` rows of buffers of ``items`` bytes a row, in stream order
    (buffer-major: every row of buffer 0, then buffer 1's, ..); kept for the shapes seen
    last (a pool's rooms come in a few lengths)."""
    return _groups(tuple(items), n, GROUP_BYTES if limit is None else limit)


@functools.lru_cache(maxsize=256)
def _groups(items: tuple[int, ...], n: int, limit: int) -> tuple[Group, ...]:
    out: list[Group] = []
    first, size = 0, 0
    for k, item in enumerate(items):
        total = n * item
        if total > limit:  # this buffer alone: cut into row ranges
            if k > first:
                out.append((first, k, 0, n))
            pieces = -(-total // limit)
            step = -(-n // pieces)  # even cuts: no small remainder group
            out.extend((k, k + 1, r, min(n, r + step)) for r in range(0, n, step))
            first, size = k + 1, 0
            continue
        if k > first and size + total > limit:
            out.append((first, k, 0, n))
            first, size = k, 0
        size += total
    if first < len(items):
        out.append((first, len(items), 0, n))
    return tuple(out)


def group_bytes(pool: RegisteredPool, g: Group) -> int:
    a, b, r0, r1 = g
    return (r1 - r0) * sum(pool.item_bytes[a:b])


def run_views(pool: RegisteredPool, run: slice, g: Group) -> list[memoryview]:
    """The group's rows of the run ``run`` of slots, where they lie (host pool)."""
    a, b, r0, r1 = g
    lo, hi = run.start + r0, run.start + r1
    return [f[lo * i:hi * i] for f, i in zip(pool.flat[a:b], pool.item_bytes[a:b])]


def sum_run(pool: RegisteredPool, run: slice, g: Group, acc: int, kern: Any = None) -> int:
    """CRC-32 of the group's rows of the run ``run``, continued from ``acc`` (host pool;
    ``kern``: the pool's kernel, looked up once a room by the caller, or None; the run's
    bounds are checked once a room by `check_run`)."""
    a, b, r0, r1 = g
    if kern is not None:
        bases_at, items_at = pool.addrs
        return kern.sum_run(b - a, bases_at + 8 * a, items_at + 8 * a, r1 - r0,
                            run.start + r0, acc)
    for view in run_views(pool, run, g):
        acc = crc32(view, acc)
    return acc


def check_run(pool: RegisteredPool, run: slice) -> None:
    """ValueError unless the run of slots lies in the pool (the kernel checks nothing)."""
    if run.start < 0 or run.stop > pool.num_slots:
        raise ValueError(f"slots {run.start}..{run.stop - 1} outside the pool's "
                         f"{pool.num_slots}")


def _offsets(pool: RegisteredPool, g: Group, block: np.ndarray) -> np.ndarray:
    """Where each buffer's rows of the group lie in ``block`` (uint64 addresses)."""
    a, b, r0, r1 = g
    offs = np.zeros(b - a, dtype=np.uint64)
    np.cumsum(pool.items[a:b - 1] * (r1 - r0), out=offs[1:])
    return offs + np.uint64(block.ctypes.data)


def gather(pool: RegisteredPool, slots: np.ndarray, g: Group, block: np.ndarray,
           acc: int) -> int:
    """The group's rows of ``slots`` (int64, the room's whole slot list) into ``block``
    (exactly their bytes), summed as copied; the CRC-32 continued from ``acc`` (host)."""
    a, b, r0, r1 = g
    idx = slots[r0:r1]
    if pool.kernel() is not None:
        return pool.rows_crc(idx, _offsets(pool, g, block), GATHER, acc, a, b)
    off, n = 0, r1 - r0
    for k in range(a, b):
        out = block[off:off + n * pool.item_bytes[k]]
        np.take(pool.host_rows[k], idx, axis=0, out=out.reshape(n, pool.item_bytes[k]))
        acc = crc32(memoryview(out), acc)
        off += len(out)
    return acc


def scatter(pool: RegisteredPool, slots: list[int], g: Group, block: np.ndarray,
            acc: int | None) -> int | None:
    """``block``'s rows into the group's rows of ``slots`` (the room's whole slot list);
    the CRC-32 of what landed continued from ``acc``, None once a device buffer was written
    (summed on decode's "done" instead)."""
    import torch

    a, b, r0, r1 = g
    n = r1 - r0
    idx = np.asarray(slots[r0:r1], dtype=np.int64)
    if acc is not None and pool.kernel() is not None:
        return pool.rows_crc(idx, _offsets(pool, g, block), SCATTER, acc, a, b)
    off = 0
    for k in range(a, b):
        item = pool.item_bytes[k]
        src = block[off:off + n * item].reshape(n, item)
        off += n * item
        rows: Any = pool.host_rows[k]
        if rows is not None:  # numpy alone: no torch op in a transfer thread
            rows[idx] = src
            if acc is not None:
                acc = crc32(memoryview(np.ascontiguousarray(rows[idx])), acc)
            continue
        t = pool.tensors[k]
        at = torch.as_tensor(idx, device=t.device)
        byte_rows(t).index_copy_(0, at, torch.from_numpy(src.copy()).to(t.device))
        acc = None
    return acc
