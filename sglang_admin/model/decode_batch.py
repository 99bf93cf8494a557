"""What a CPU decode step hands the kernels of model/cpu_kernels.py: one decoder layer's
weights (:class:`DecodeLayerWeights`, for :meth:`CpuKernels.decode_layer`) and the step's decode
sequences with their scratch buffers (:class:`DecodeBatch`, shared by every layer of a forward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DecodeLayerWeights:
    """What :meth:`CpuKernels.decode_layer` reads of one decoder layer: float32 CPU tensors,
    contiguous (biases None when the model has none), and the layer's shape."""

    ln1: torch.Tensor  # [hidden] input RMSNorm
    w_qkv: torch.Tensor  # [(H + 2 KV) D, hidden], q rows first, then k, then v
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor  # [hidden, H D]
    b_o: torch.Tensor | None
    ln2: torch.Tensor  # [hidden] post-attention RMSNorm
    w_gate_up: torch.Tensor  # [2 I, hidden], gate rows first
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # [hidden, I]
    b_down: torch.Tensor | None
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    window: int | None
    lora_hooks: Callable[[], bool] = lambda: False  # whether LoRA hooks sit on the layer now


@dataclass
class DecodeBatch:
    """One forward's decode sequences for the kernel, shared by every layer."""

    kernel: Any  # model/cpu_kernels.py's CpuKernels (which imports this module)
    table: torch.Tensor  # [R, ctx] the runner's req_to_token
    rows: torch.Tensor  # [n] int64 table row of each decode sequence
    lens: torch.Tensor  # [n] int64 its length, the new token included
    longest: int  # max(lens)
    scores: torch.Tensor  # float32 scratch, heads * longest at least
    scratch: torch.Tensor | None = None  # decode_layer's, shared by every layer
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # see buffer()

    def check_scores(self, heads: int) -> None:
        """The kernel writes heads * longest scores: refuse a scratch that cannot hold them."""
        if self.scores.numel() < heads * self.longest:
            raise ValueError(f"decode kernel: scores scratch of {self.scores.numel()} floats "
                             f"for {heads} heads x {self.longest} keys")

    def layer_scratch(self, floats: int) -> torch.Tensor:
        """A float32 scratch of at least ``floats``, allocated once per forward."""
        if self.scratch is None or self.scratch.numel() < floats:
            self.scratch = torch.empty(floats, dtype=torch.float32)
        return self.scratch

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, window: int | None) -> torch.Tensor:
        """One layer: q [n, H, D] against its pool -> [n, H * D]."""
        self.check_scores(q.shape[1])
        return self.kernel.attend(q, k_cache, v_cache, self.table, self.rows, self.lens,
                                  scale, window, self.scores)

    def buffer(self, name: str, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, width] scratch tensor of this forward, the same one for every layer that
        asks by ``name`` with this shape (each layer's use of it ends before the next's)."""
        buf = self.buffers.get(name)
        if buf is None or buf.shape != (rows, width) or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(rows, width, dtype=dtype)
        return buf

    def rope_attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor,
                    scale: float, window: int | None) -> torch.Tensor:
        """One bfloat16 layer's :meth:`CpuKernels.rope_attend`: the fused qkv [n, H + 2 KV, D]
        -> [n, H * D], into this forward's buffers (valid until the next layer's call)."""
        n, width, dim = qkv.shape
        rotated_heads = heads + (width - heads) // 2  # the q heads and the k heads
        rotated = self.buffer("rotated", n, rotated_heads * dim, qkv.dtype)
        out = self.buffer("attention", n, heads * dim, qkv.dtype)
        return self.kernel.rope_attend(
            qkv, cos, sin, heads, k_cache, v_cache, out_slots, self.table, self.rows, self.lens,
            scale, window, self.scores, rotated.view(n, rotated_heads, dim), out, self.longest)


