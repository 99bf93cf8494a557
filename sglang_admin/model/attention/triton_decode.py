"""Paged decode attention in Triton: each decode query reads its keys and values straight
from the KV pool through the request-to-token table, with no gathered or padded copy.

The pool is paged one token per slot (scheduler/kv_pool.py hands out single slots, and the
decode slots of a batch interleave), so a kernel that reads whole blocks of the pool (torch's
flex_attention, whose BlockMask addresses blocks of 16+ contiguous slots) would read every
other sequence's tokens too; this kernel loads each key row by its own slot instead.

Two kernels per layer (flash-decoding):

1. ``_decode_partial``, one program per (sequence, kv head, split): the split's share of the
   sequence's positions (the sliding window's only, if any), all the query heads of that kv
   head at once, an online softmax; writes the split's output and log-sum-exp.
2. ``_decode_merge``, one program per (sequence, head): the splits' outputs weighted by their
   log-sum-exp, written in the queries' dtype.

On CUDA the kernels are compiled by Triton (shipped with torch's CUDA wheels); on CPU tensors
they run in Triton's interpreter, which is how the tests check them against torch's path.
The grid depends on the batch and the split count only, and nothing reads back to the host,
so a launch can be captured in a CUDA graph. The split count is a runtime argument: a new
count compiles nothing new (the merge compiles once per power of two above it).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from sglang_admin.model.attention.metadata import PagedDecode

__all__ = ["BLOCK_N", "decode_attention", "paged_decode", "split_count", "startup_check"]

# keys per loop step of a program, and the launch's warps and pipeline stages (usual values
# for a memory-bound kernel of this size; not yet tuned on a GPU)
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
# the fewest positions a split is given, and the programs a launch aims for (two per SM of
# an H200, 132 SMs): short batches split their sequences until the GPU is busy
MIN_SPLIT_TOKENS = 256
TARGET_PROGRAMS = 264
MAX_SPLITS = 32


def split_count(batch: int, kv_heads: int, longest: int) -> int:
    """How many splits each sequence's positions are cut into: enough programs to fill the
    GPU, none shorter than MIN_SPLIT_TOKENS positions, at most MAX_SPLITS."""
    by_length = -(-longest // MIN_SPLIT_TOKENS)
    by_occupancy = -(-TARGET_PROGRAMS // max(1, batch * kv_heads))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine(a, b):
    return a + b


# The kernels call no function of triton.language.standard (tl.max, tl.sum, tl.zeros, ...):
# Triton's interpreter cannot call their compiled forms unless it was switched on before
# triton was imported. Reductions go through tl.reduce with the standard library's own
# combine functions where this Triton has them (the interpreter runs those through numpy;
# ours, the fallback, element by element), zeros through tl.full.
_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)
_SUM = getattr(tl.standard, "_sum_combine", _sum_combine)


# One program per (sequence, kv head, split): the online softmax of the split's positions for
# the kv head's GROUP query heads (rows of BLOCK_H, padded to what tl.dot takes), written as
# the split's normalised output and log-sum-exp. (Kernel arguments carry no annotations:
# Triton reads them as specialisation hints.)
def _decode_partial(
    Q, K, V, Table, Rows, Lens, PartOut, PartLse,  # pointers
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_table, stride_po_tok, stride_po_head, stride_po_split, stride_pl_tok, stride_pl_head,
    scale, window, num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,  # q, K, V to float32 as loaded (the interpreter's bf16)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(Rows + seq)
    length = tl.load(Lens + seq)
    # a sliding window: only the last `window` positions (one type on both sides: the
    # compiler refuses a variable whose type an `if` changes)
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    per_split = (length - first + num_splits - 1) // num_splits
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, length)

    h = tl.arange(0, BLOCK_H)
    h_ok = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_ok = pos < hi
        slot = tl.load(Table + row * stride_table + pos, mask=n_ok, other=0)
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :],
                    mask=kv_ok, other=0.0)
        v = tl.load(V + slot[:, None] * stride_v_slot + kv_head * stride_v_head + d[None, :],
                    mask=kv_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    seen = l_sum > 0.0  # an empty split (a short sequence) weighs nothing in the merge
    out = acc / tl.where(seen, l_sum, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, l_sum, 1.0)), float("-inf"))
    tl.store(PartOut + seq * stride_po_tok + heads[:, None] * stride_po_head
             + split * stride_po_split + d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(PartLse + seq * stride_pl_tok + heads * stride_pl_head + split, lse, mask=h_ok)


# One program per (sequence, query head): the splits' outputs, weighted by exp(lse - max).
def _decode_merge(
    PartOut, PartLse, Out,  # pointers
    stride_po_tok, stride_po_head, stride_po_split, stride_pl_tok, stride_pl_head,
    stride_o_tok, stride_o_head, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(PartLse + seq * stride_pl_tok + head * stride_pl_head + sp, mask=s_ok,
                  other=float("-inf"))
    top = tl.reduce(lse, 0, _MAX)
    weight = tl.exp(lse - top)
    weight = tl.where(s_ok, weight, 0.0)
    parts = tl.load(PartOut + seq * stride_po_tok + head * stride_po_head
                    + sp[:, None] * stride_po_split + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.reduce(parts * weight[:, None], 0, _SUM) / tl.reduce(weight, 0, _SUM)
    tl.store(Out + seq * stride_o_tok + head * stride_o_head + d,
             out.to(Out.dtype.element_ty), mask=d_ok)


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The two kernels, compiled for the GPU or wrapped for Triton's CPU interpreter."""
    wrap = InterpretedFunction if interpret else triton.jit
    return wrap(_decode_partial), wrap(_decode_merge)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
) -> torch.Tensor:
    """Attention of one decode query per sequence, q [B, H, D] -> [B, H * D].

    Sequence ``i`` lives in ``table`` row ``rows[i]`` and attends to its first
    ``lengths[i]`` positions (its new token's K/V already in the pool; only the last
    ``sliding_window`` of them when a window is given); the pool is ``k_cache``/``v_cache``
    [slots, kv_heads, D]. ``part_out`` [>= B, H, num_splits, D] and ``part_lse``
    [>= B, H, num_splits], float32, are the splits' scratch.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out.view(0, heads * head_dim)
    interpret = q.device.type != "cuda"
    partial, merge = _kernels(interpret)
    block_d = max(16, triton.next_power_of_2(head_dim))
    partial[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, table, rows, lengths, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        scale, sliding_window or 0, num_splits,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim, BLOCK_D=block_d, UPCAST=interpret,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    merge[(batch, heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
    return out.view(batch, heads * head_dim)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    decode: PagedDecode,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """:func:`decode_attention` of a forward's decode sequences (q [B, H, D] -> [B, H * D]);
    the first layer's call sizes the splits and their scratch, the other layers reuse them."""
    if decode.part_out is None:
        batch, heads, head_dim = q.shape
        splits = split_count(batch, k_cache.shape[1], decode.longest)
        decode.num_splits = splits
        decode.part_out = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32,
                                      device=q.device)
        decode.part_lse = torch.empty(batch, heads, splits, dtype=torch.float32,
                                      device=q.device)
    assert decode.part_lse is not None
    return decode_attention(q, k_cache, v_cache, decode.table, decode.rows, decode.lengths,
                            scale, sliding_window, decode.num_splits, decode.part_out,
                            decode.part_lse)


def startup_check(device: torch.device, heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> str | None:
    """None when the kernels compile and run on ``device`` for this head layout and dtype and
    agree with torch's attention on a small batch (two sequences, two splits each); else
    what went wrong, in a line. A rank runs it once at start (model/attention/choice.py):
    a machine where Triton cannot build or launch a kernel keeps torch's path."""
    try:
        gen = torch.Generator().manual_seed(0)
        slots, longest = 300, 128
        k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(device, dtype)
        v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(device, dtype)
        q = torch.randn(2, heads, head_dim, generator=gen).to(device, dtype)
        table = (torch.randperm(slots - 1, generator=gen)[: 2 * longest] + 1).view(2, longest)
        rows, lengths = torch.tensor([1, 0]), torch.tensor([longest, 37])
        table, rows, lengths = table.to(device), rows.to(device), lengths.to(device)
        splits = 2
        part_out = torch.empty(2, heads, splits, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(2, heads, splits, dtype=torch.float32, device=device)
        scale = head_dim**-0.5
        out = decode_attention(q, k_cache, v_cache, table, rows, lengths, scale, None, splits,
                               part_out, part_lse)
        group = heads // kv_heads
        worst = 0.0
        for i in range(2):
            index = table[rows[i], : lengths[i]]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[i].float().view(kv_heads, group, head_dim),
                k_cache[index].float().transpose(0, 1), v_cache[index].float().transpose(0, 1),
                scale=scale)
            worst = max(worst, (out[i].float() - ref.reshape(-1)).abs().max().item())
    except Exception as exc:  # noqa: BLE001 - whatever stops the kernel is the answer
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first}"
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    if not worst <= tolerance:
        return f"its output differs from torch's by {worst:.2e} (tolerance {tolerance:.0e})"
    return None
