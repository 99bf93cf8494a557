"""bfloat16 decode attention over a batch of sequences (model/csrc/cpu_kernels.c): a batch of
4 sequences a thread or more goes a sequence a task (every kv head's rows read at once, the
next rows prefetched as the scores go); one sequence goes a (sequence, kv head) a task. Both
must give the same bits, and torch's bfloat16 attention within its rounding."""

from __future__ import annotations

import pytest
import torch

from sglang_admin.model.cpu_kernels_build import load_cpu_kernels, reference_attend

kernel = load_cpu_kernels()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler builds the kernel here")
BF16 = torch.bfloat16
# one token, a block of 16 keys and either side of it, odd and even, past a window of 7
LENS = [1, 2, 15, 16, 17, 31, 33, 100, 130, 7, 8, 64, 3, 47, 96, 120, 1, 5, 250, 40]


def _batch(heads: int, kv_heads: int, dim: int, seed: int):
    """A pool whose slots are scattered at random, and one where each position's slots of the
    batch are consecutive (a decode step's allocation)."""
    gen = torch.Generator().manual_seed(seed)
    n, width = len(LENS), max(LENS) + 3
    slots = 1 + n * width
    k = torch.randn(slots, kv_heads, dim, generator=gen).to(BF16)
    v = torch.randn(slots, kv_heads, dim, generator=gen).to(BF16)
    scattered = (1 + torch.randperm(slots - 1, generator=gen)[: n * width]).view(n, width)
    in_steps = (1 + torch.arange(width).view(1, width) * n + torch.arange(n).view(n, 1))
    rows = torch.randperm(n, generator=gen)
    q = torch.randn(n, heads, dim, generator=gen).to(BF16)
    return q, k, v, [scattered.contiguous(), in_steps.contiguous()], rows, torch.tensor(LENS)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (14, 2, 64), (16, 2, 256),
                                                (20, 1, 32), (4, 4, 128), (12, 1, 64),
                                                (6, 3, 16)])
@pytest.mark.parametrize("window", [None, 7])
def test_a_batch_attends_as_each_sequence_alone(heads: int, kv_heads: int, dim: int,
                                               window: int | None) -> None:
    q, k, v, tables, rows, lens = _batch(heads, kv_heads, dim, seed=heads + dim)
    before = torch.get_num_threads()
    try:
        for table in tables:
            alone = torch.cat([
                kernel.attend(q[i : i + 1], k, v, table, rows[i : i + 1], lens[i : i + 1],
                              dim**-0.5, window, torch.empty(heads * int(lens[i])))
                for i in range(len(LENS))])
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = kernel.attend(q, k, v, table, rows, lens, dim**-0.5, window,
                                    torch.empty(heads * max(LENS)))
                assert torch.equal(got, alone)
            want = reference_attend(q, k, v, table, rows, lens, dim**-0.5, window).to(BF16)
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1.6e-2)
            assert (got == want).float().mean().item() >= 0.9
    finally:
        torch.set_num_threads(before)
