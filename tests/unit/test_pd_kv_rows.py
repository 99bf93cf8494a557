"""The kv_rows kernel (disaggregation/kv_rows.py): a room's rows of every KV buffer to and
from one block with their CRC-32 in one call, equal to numpy's copies and zlib's sums."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from sglang_admin.disaggregation import staging
from sglang_admin.disaggregation.kv_rows import GATHER, SCATTER, SUM, kernel
from sglang_admin.disaggregation.transfer import RegisteredPool

pytestmark = pytest.mark.skipif(kernel() is None, reason="no C compiler or no ISA-L here")


def _pool(items: list[int], slots: int = 300, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (slots, i), dtype=torch.uint8, generator=gen) for i in items]


@pytest.mark.parametrize("slots", [list(range(40, 240)), [5, 2, 299, 0, 7, 6], [17],
                                   list(range(0, 300, 3))])
def test_gather_scatter_and_sum_equal_numpy_and_zlib(slots: list[int]) -> None:
    src = RegisteredPool.of(_pool([768, 768, 64, 1024]))
    want = b"".join(r[slots].tobytes() for r in src.host_rows)
    block = np.zeros(len(want), dtype=np.uint8)
    assert staging.gather(src, slots, block) == zlib.crc32(want)  # one C call
    assert block.tobytes() == want
    assert src.rows_crc(slots) == zlib.crc32(want)
    assert src.rows_crc(slots, acc=77) == zlib.crc32(want, 77)
    dst = RegisteredPool.of(_pool([768, 768, 64, 1024], seed=1))
    before = [r.copy() for r in dst.host_rows]
    assert staging.scatter(dst, slots, block) == zlib.crc32(want)
    for b, (rows, old) in enumerate(zip(dst.host_rows, before)):
        assert rows[slots].tobytes() == src.host_rows[b][slots].tobytes()
        others = np.setdiff1d(np.arange(300), slots)
        assert np.array_equal(rows[others], old[others])  # no other row touched


def test_a_range_of_buffers_continues_the_sum() -> None:
    pool = RegisteredPool.of(_pool([96] * 6))
    slots = list(range(10, 50))
    head = pool.rows_crc(slots, start=0, stop=2)
    assert pool.rows_crc(slots, acc=head, start=2) == pool.rows_crc(slots)


def test_slots_outside_the_pool_are_refused_before_any_copy() -> None:
    pool = RegisteredPool.of(_pool([64, 64], slots=10))
    k = kernel()
    block = np.zeros(2 * 64 * 2, dtype=np.uint8)
    blocks = np.array([block.ctypes.data, block.ctypes.data + 128], dtype=np.uint64)
    for slots, first in (([3, 10], None), ([-1, 2], None), ([0, 1], 9)):
        for mode in (GATHER, SCATTER, SUM):
            with pytest.raises(ValueError, match="outside the pool"):
                k.rows(pool.bases, pool.items, slots, first, blocks, mode,
                       num_slots=pool.num_slots)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.rows_crc([0, 10])


def test_a_device_or_empty_pool_has_no_kernel() -> None:
    assert RegisteredPool.of([]).kernel() is None
    assert RegisteredPool.of([]).rows_crc([1]) is None


def test_the_numpy_path_gives_the_same_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    src = RegisteredPool.of(_pool([768, 32]))
    slots = [9, 3, 4, 5, 100]
    block = np.zeros(len(slots) * 800, dtype=np.uint8)
    with_kernel = staging.gather(src, slots, block)
    monkeypatch.setattr(RegisteredPool, "kernel", lambda self: None)
    block2 = np.zeros_like(block)
    assert staging.gather(src, slots, block2) == with_kernel
    assert block2.tobytes() == block.tobytes()
    dst = RegisteredPool.of(_pool([768, 32], seed=4))
    assert staging.scatter(dst, slots, block2) == with_kernel
