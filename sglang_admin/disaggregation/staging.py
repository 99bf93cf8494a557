"""Host staging regions: one room's KV rows of every layer buffer as one contiguous block.

A room's rows live in one buffer per layer (K and V), so moving them as they lie costs one
write entry (or frame) per buffer, whose fixed cost is most of a small room's transfer. A
backend that stages gathers the rows into one region (``gather``), moves that as one block,
and the receiver scatters the block into its pool (``scatter``). The block is buffer-major:
every row of buffer 0 in slot order, then buffer 1's, and so on.

Host pools only: the copies and their CRC-32 are one call of the kv_rows kernel
(disaggregation/kv_rows.py), or numpy where it is not built (no torch op: torch's OpenMP
threads, called from a transfer thread beside the rank's forward, spin against it).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from sglang_admin.disaggregation.transfer import RegisteredPool, crc32, slot_run

ALIGN = 4096  # regions start on a page


class StagingArea:
    """One host buffer carved into regions, first fit; thread-safe.

    Its pages are taken from the OS only as regions are written (``np.empty``)."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.empty(nbytes, dtype=np.uint8)
        self.ptr: int = self.array.ctypes.data
        self.nbytes = nbytes
        self._used: dict[Hashable, tuple[int, int]] = {}  # key -> (offset, bytes)
        self._lock = threading.Lock()

    def take(self, key: Hashable, nbytes: int) -> int | None:
        """A region of ``nbytes`` for ``key``: its offset, or None when none is free."""
        if nbytes <= 0 or nbytes > self.nbytes:
            return None
        with self._lock:
            if key in self._used:
                return None
            at = 0
            for off, size in sorted(self._used.values()):
                if off - at >= nbytes:
                    break
                at = max(at, -(-(off + size) // ALIGN) * ALIGN)
            if at + nbytes > self.nbytes:
                return None
            self._used[key] = (at, nbytes)
            return at

    def region(self, key: Hashable) -> tuple[int, int] | None:
        """``key``'s (offset, bytes), or None."""
        with self._lock:
            return self._used.get(key)

    def give(self, key: Hashable) -> None:
        """Free ``key``'s region (idempotent)."""
        with self._lock:
            self._used.pop(key, None)

    def view(self, offset: int, nbytes: int) -> Any:
        return self.array[offset:offset + nbytes]


def host_only(pool: RegisteredPool) -> bool:
    """Every buffer of the pool is in host memory (the staged path's condition)."""
    return bool(pool.tensors) and all(r is not None for r in pool.host_rows)


def _blocks(pool: RegisteredPool, n: int, block: Any) -> Any:
    """Where each buffer's ``n`` rows lie in a buffer-major ``block`` (uint64 addresses)."""
    offs = np.zeros(len(pool.item_bytes), dtype=np.uint64)
    np.cumsum(pool.items[:-1] * n, out=offs[1:])
    return offs + np.uint64(block.ctypes.data)


def gather(pool: RegisteredPool, slots: Sequence[int], out: Any) -> int:
    """Every buffer's rows ``slots`` into ``out`` (uint8, exactly their bytes), buffer-major;
    the CRC-32 of those bytes (the kv_rows kernel takes it as it copies)."""
    n = len(slots)
    if n and (crc := pool.rows_crc(slots, _blocks(pool, n, out), 1)) is not None:
        return crc
    run = slot_run(slots)
    idx = None if run is not None else np.asarray(slots, dtype=np.int64)
    off = 0
    for rows, item in zip(pool.host_rows, pool.item_bytes):
        dst = out[off:off + n * item].reshape(n, item)
        if run is not None:
            dst[...] = rows[run]
        else:
            np.take(rows, idx, axis=0, out=dst)
        off += n * item
    return crc32(memoryview(out))


def scatter(pool: RegisteredPool, slots: Sequence[int], block: Any) -> int:
    """The inverse of :func:`gather`: ``block``'s rows into every buffer's ``slots``; the
    CRC-32 of the rows as they now are in the pool."""
    n = len(slots)
    if n and (crc := pool.rows_crc(slots, _blocks(pool, n, block), 0)) is not None:
        return crc
    run = slot_run(slots)
    where: Any = run if run is not None else np.asarray(slots, dtype=np.int64)
    off = 0
    crc = 0
    for rows, item in zip(pool.host_rows, pool.item_bytes):
        rows[where] = block[off:off + n * item].reshape(n, item)
        crc = crc32(memoryview(np.ascontiguousarray(rows[where])), crc)
        off += n * item
    return crc
