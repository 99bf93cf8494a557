"""Every bfloat16 prefill chunk of a forward in one kernel call per layer.

A step of 32 short prompts ran 32 attention calls per layer (torch's SDPA or the per-sequence
flash kernel), each with its own dispatch, its own OpenMP fork and its own packing of the keys;
at 40-100 tokens a prompt that overhead was most of the attention. ``csrc/cpu_kernels.c``'s
``extend_attention_bf16_seqs`` takes them all: the tasks (sequence x kv head x block of 64
query tokens) of every sequence share one OpenMP region, the costliest first. The numbers are
those of :meth:`CpuKernels.extend_attend` for each sequence alone (the same tasks, the same
sums), so which sequences share a call changes no bit of the output.

The runner builds an :class:`ExtendBatch` once per forward (model/batch.py) for the chunks
model/attention/choice.py sends to the kernel; model/attention/paged.py calls :meth:`attend`
once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ExtendBatch", "extend_attend_seqs", "tile_kernel"]


def tile_kernel(kernel: Any, use: bool | None = None) -> bool:
    """Whether the bfloat16 prefill kernel multiplies on AMX tiles (the CPU has AMX-BF16 and
    Linux granted this process the tiles); else it runs on AVX512_BF16. ``use=False`` turns
    the tiles off for this process (``True``: back on where granted): how the tests and
    tools/bench_prefill_batch.py compare the two."""
    return bool(kernel._extend_bf16_amx(-1 if use is None else int(use)))


@dataclass
class ExtendBatch:
    """The prefill chunks of one forward that go through the bfloat16 kernel, shared by every
    layer: ``seqs`` [count, 4] int64 rows (first query token in the extend group, new tokens,
    cached prefix, first slot in ``slots``), ascending; ``slots`` their table rows (positions
    [0, prefix + n) each) concatenated."""

    kernel: Any  # model/cpu_kernels.py's CpuKernels
    seqs: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def of(cls, kernel: Any, chunks: list[tuple[int, int, int, torch.Tensor]]
           ) -> ExtendBatch:
        """From (start, n, prefix, slots of positions [0, prefix + n)) per chunk."""
        rows, offset = [], 0
        for start, n, prefix, slots in chunks:
            rows.append((start, n, prefix, offset))
            offset += slots.numel()
        slots = torch.cat([c[3] for c in chunks]) if len(chunks) > 1 else chunks[0][3]
        return cls(kernel, torch.tensor(rows, dtype=torch.int64).view(-1, 4),
                   slots.contiguous())

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, window: int | None, out: torch.Tensor) -> torch.Tensor:
        """:func:`extend_attend_seqs` of this batch's chunks (their rows of ``out``)."""
        return extend_attend_seqs(self.kernel, q, k_cache, v_cache, self.slots, self.seqs,
                                  scale, window, out)


def extend_attend_seqs(kernel: Any, q: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, seqs: torch.Tensor,
                       scale: float, window: int | None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of several prefill chunks in one call: q [T, H, D] bfloat16 (a token
    stride of its own, heads contiguous); chunk i (``seqs[i]`` = start, n, prefix, offset)
    is queries start..start+n-1 at positions prefix..prefix+n-1, its keys and values those of
    positions [0, prefix + n) read from the pools [slots, KV, D] at
    ``slots[offset : offset + prefix + n]`` (int64); a sliding window keeps each query's last
    ``window`` keys. Writes those rows of ``out`` [T, H * D] bfloat16 (a new tensor when None;
    rows of no chunk are left as they were) and returns it. The chunks' query ranges must be
    ascending and disjoint. ValueError on anything else, or where the kernel does not apply
    (``kernel.extend_applies(D, bfloat16)``); the kernel itself checks each chunk's ranges.
    The caller guarantees the slots are in the pools (the runner validated the table)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor)
            and isinstance(v_cache, torch.Tensor) and isinstance(slots, torch.Tensor)
            and isinstance(seqs, torch.Tensor)):
        raise ValueError("extend attention kernel: tensors expected")
    if q.dim() != 3 or k_cache.dim() != 3:
        raise ValueError("extend attention kernel: q and the pools must be [rows, heads, dim]")
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16):
        raise ValueError("extend attention kernel: bfloat16 q and pools expected, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (kernel.extend_applies(dim, torch.bfloat16) and kv_heads
            and heads % kv_heads == 0):
        raise ValueError(f"extend attention kernel: no bfloat16 path for {heads} heads over "
                         f"{kv_heads} kv heads of {dim}")
    if not (q.stride(2) == 1 and q.stride(1) == dim and k_cache.is_contiguous()
            and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.shape[2] == dim and slots.dtype == torch.int64 and slots.dim() == 1
            and slots.is_contiguous() and seqs.dtype == torch.int64 and seqs.dim() == 2
            and seqs.shape[1] == 4 and seqs.is_contiguous()):
        raise ValueError("extend attention kernel: a tensor is not laid out as expected")
    if window is not None and window < 1:
        raise ValueError(f"extend attention kernel: window {window} < 1")
    if out is None:
        out = torch.empty(tokens, heads * dim, dtype=torch.bfloat16)
    elif not (out.shape == (tokens, heads * dim) and out.dtype == torch.bfloat16
              and out.is_contiguous()):
        raise ValueError("extend attention kernel: out is not laid out as expected")
    if seqs.shape[0] == 0:
        return out
    done = kernel._extend_bf16_seqs(
        q.data_ptr(), q.stride(0), tokens, k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr(), slots.numel(), seqs.data_ptr(), seqs.shape[0], heads, kv_heads, dim,
        scale, window or 0, out.data_ptr())
    if done < 0:
        raise ValueError("extend attention kernel: a chunk's range is outside q or slots, "
                         "empty, or out of order")
    if done == 0:
        raise RuntimeError("extend attention kernel: out of memory")
    return out
