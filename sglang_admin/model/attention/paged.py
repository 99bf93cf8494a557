"""Paged attention over the KV pool: decode groups and extend sequences through torch's
scaled-dot-product attention, or through the CPU kernels where the runner chose them, or on
CUDA (model/attention/choice.py) decode through the Triton kernel and a cached prefix's
extend through SDPA's bottom-right causal form.

Head counts come from the tensors (q: [T, heads, D], the pool: [slots, kv_heads, D]), so a
rank holding a slice of the heads calls the same functions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sglang_admin.model.attention.metadata import AttentionMetadata


def gather_rows(
    pool: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """pool[index] along dim 0, into out[:len(index)] when a scratch buffer is given."""
    if out is None:
        return pool.index_select(0, index)
    return torch.index_select(pool, 0, index, out=out[: index.shape[0]])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    kernels: Any,
) -> torch.Tensor:
    """Attention of every new token q [T, H, D] (k, v: the new keys and values, already in the
    pool) -> [T, H * D]: decode sequences first, then extend sequences, as meta lays them out.

    kernels: model/cpu_kernels.py's CpuKernels when the runner set some extend sequence to
    the CPU prefill kernel (``ExtendSeq.slots``), else unused.
    """
    h, d = q.shape[1], q.shape[2]
    kv = k_cache.shape[1]
    group_size = h // kv
    k_flat = k_cache.view(k_cache.shape[0], kv * d)
    v_flat = v_cache.view(v_cache.shape[0], kv * d)
    parts = []
    nd = meta.num_decode
    if meta.decode_batch is not None:
        parts.append(meta.decode_batch.attend(q[:nd], k_cache, v_cache, scale, sliding_window))
    if meta.paged_decode is not None:  # CUDA: the Triton kernel reads the pool (choice.py)
        from sglang_admin.model.attention.triton_decode import paged_decode

        parts.append(paged_decode(q[:nd], k_cache, v_cache, meta.paged_decode, scale,
                                  sliding_window))
    for group in meta.decode_groups:
        # queries of one kv head form the "query length" axis: no K/V repeat needed
        a, n, length = group.start, group.count, group.length
        qd = q[a : a + n].reshape(n, kv, group_size, d)
        kd = gather_rows(k_flat, group.kv_index, meta.gather_k)
        vd = gather_rows(v_flat, group.kv_index, meta.gather_v)
        kd = kd.view(n, length, kv, d).transpose(1, 2)
        vd = vd.view(n, length, kv, d).transpose(1, 2)
        mask = group.mask
        if sliding_window is not None and group.swa_mask is not None:
            mask = group.swa_mask
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        parts.append(od.reshape(n, h * d))
    if meta.extend_seqs:
        parts.append(extend_attention(q[nd:], k[nd:], v[nd:], meta, k_flat, v_flat, kv,
                                      scale, sliding_window, kernels))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    kv: int,
    scale: float,
    sliding_window: int | None,
    kernels: Any,
) -> torch.Tensor:
    """Attention of the extend tokens q [Te, H, D] (k, v: their new keys and values), one
    sequence at a time (no padding to the longest one), through the CPU kernel where it
    applies (keys and values read from the pool, a cached prefix's too; in bfloat16 every
    such sequence in one call, ``meta.extend_batch``). k_flat, v_flat: the
    pool as [slots, kv * D]."""
    h, d = q.shape[1], q.shape[2]
    windowed = sliding_window is not None
    batch = meta.extend_batch
    if batch is not None:  # CPU bfloat16: the kernel's sequences in one call, into out
        out = batch.attend(q, k_flat.view(-1, kv, d), v_flat.view(-1, kv, d), scale,
                           sliding_window, torch.empty(q.shape[0], h * d, dtype=q.dtype))
        if len(batch.seqs) == len(meta.extend_seqs):
            return out
    outs = []
    for seq in meta.extend_seqs:
        end = seq.start + seq.n
        if seq.slots is not None and batch is not None:
            outs.append(out[seq.start : end])
            continue
        if seq.slots is not None:  # the runner chose the CPU prefill kernel for it
            outs.append(kernels.extend_attend(
                q[seq.start : end], k_flat.view(-1, kv, d), v_flat.view(-1, kv, d),
                seq.slots, seq.prefix, scale, sliding_window))
            continue
        qs = q[seq.start : end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seq.kv_index is None:  # no cached prefix: the new keys are all there is
            ks, vs = k[seq.start : end], v[seq.start : end]
        else:  # the decode group is done with the scratch buffers
            ks = gather_rows(k_flat, seq.kv_index, meta.gather_k).view(-1, kv, d)
            vs = gather_rows(v_flat, seq.kv_index, meta.gather_v).view(-1, kv, d)
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        mask = seq.swa_mask if windowed and seq.swa_mask is not None else seq.mask
        if seq.lower_right and mask is None:  # CUDA: SDPA's flash kernel takes it (choice.py)
            # imported here: torch.nn.attention.bias imports torch._dynamo (seconds)
            from torch.nn.attention.bias import causal_lower_right

            out = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=causal_lower_right(seq.n, ks.shape[2]), scale=scale,
                enable_gqa=True)
        elif mask is None:
            out = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            out = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
            )
        outs.append(out[0].transpose(0, 1).reshape(seq.n, h * d))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
