"""Attention metadata: where each new token's K/V goes in the paged pool and which pool
slots each query attends to, built once per forward by the runner and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ExtendSeq:
    """One extend sequence (a prefill chunk): its new tokens attend on their own, so a batch
    of prompts costs the sum of their squared lengths, not count x longest squared."""

    start: int  # its first token in the extend group
    n: int  # its new tokens
    # pool slots of positions [0, prefix + n); None: no cached prefix, the keys are the new
    # tokens alone and the attention is plainly causal
    kv_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [1, 1, n, prefix + n] bool, with kv_index
    # the same with the sliding window; None when the window is out of reach
    swa_mask: torch.Tensor | None = None
    # CUDA, a cached prefix and no sliding window in reach: mask is None and the queries
    # attend causally from the bottom right (query i sees keys [0, prefix + i])
    lower_right: bool = False
    # set when the CPU prefill kernel takes it: the pool slots of positions [0, prefix + n)
    # (its table row) and the prefix
    slots: torch.Tensor | None = None
    prefix: int = 0


@dataclass
class DecodeGroup:
    """Decode sequences of similar length, attended together: their keys are padded to the
    group's longest sequence only (a batch's lengths spread widely; one padded group would
    move far more K/V bytes than the sequences hold)."""

    start: int  # its first sequence (= token) in the decode group
    count: int
    length: int  # its longest sequence
    kv_index: torch.Tensor  # [count * length] pool slots, row-major, padded rows repeat slots
    mask: torch.Tensor | None = None  # [count, 1, 1, length] bool; None: no padding
    # the same with the sliding window applied; None when no query reaches the window
    swa_mask: torch.Tensor | None = None


@dataclass
class PagedDecode:
    """The decode sequences of a CUDA forward, for the Triton kernel
    (model/attention/triton_decode.py), which reads their keys through the table itself."""

    table: torch.Tensor  # the request-to-token table [rows, context]
    rows: torch.Tensor  # [count] each sequence's table row
    lengths: torch.Tensor  # [count] its positions, the new token's included
    longest: int  # the largest of lengths
    # set by the first layer's call, shared by the others: the splits each sequence's
    # positions are cut into and their float32 scratch, [count, heads, splits, head_dim] and
    # [count, heads, splits]
    num_splits: int = 0
    part_out: torch.Tensor | None = None
    part_lse: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Where every new token's K/V goes and which pool slots each query attends to.

    Built once per forward (see ``ModelRunner``), shared by all layers. Tokens are laid out
    decode sequences first (``num_decode`` of them, one token each), then extend sequences.
    """

    out_slots: torch.Tensor  # [T] pool slot for each new token's K/V
    num_decode: int = 0
    # the decode sequences in groups of similar length, in token order
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # extend group, one entry per sequence, in token order
    extend_seqs: list[ExtendSeq] = field(default_factory=list)
    # CPU float32 (model/cpu_kernels.py): the decode sequences attend through the kernel,
    # in place in the pool, and decode_groups stay empty
    decode_batch: Any = None
    # CPU bfloat16 (model/extend_batch.py): the extend sequences with ``slots`` set, all
    # attended in one kernel call per layer
    extend_batch: Any = None
    # CUDA (model/attention/choice.py): the decode sequences attend through the Triton
    # kernel, and decode_groups stay empty
    paged_decode: PagedDecode | None = None
    # scratch for gathered K and V rows ([rows, kv_heads * head_dim] each), reused by every
    # layer: allocating megabytes per layer costs page faults on CPU
    gather_k: torch.Tensor | None = None
    gather_v: torch.Tensor | None = None
    # set by the runner where every row of this forward samples: a decode step that computes
    # the LM head in the same call (model/quant/decode_step.py) leaves the rows' float32
    # logits (after the final norm) in ``logits``
    want_logits: bool = False
    logits: torch.Tensor | None = None
