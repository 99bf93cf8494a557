"""The model's building blocks that are not attention: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_admin.model.config import LlamaConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (weight only), computed like transformers' LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: Any = None  # model/cpu_kernels.py's CpuKernels (CPU float32, bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.is_contiguous():
            return self.kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_weight: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None
        self.lora: Any = None  # model/lora.py's LayerLora once LoRA is enabled
        self.kernels: Any = None  # model/cpu_kernels.py's CpuKernels (CPU float32, bfloat16)

    def fuse(self) -> None:
        """Concatenate gate/up weights into one matrix; the HF-named params become views."""
        n = self.gate_proj.out_features
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        gate_w, up_w = self.gate_up_weight.split([n, n])
        self.gate_proj.weight = nn.Parameter(gate_w, requires_grad=False)
        self.up_proj.weight = nn.Parameter(up_w, requires_grad=False)
        if self.gate_proj.bias is not None:
            self.gate_up_bias = torch.cat([self.gate_proj.bias, self.up_proj.bias])
            gate_b, up_b = self.gate_up_bias.split([n, n])
            self.gate_proj.bias = nn.Parameter(gate_b, requires_grad=False)
            self.up_proj.bias = nn.Parameter(up_b, requires_grad=False)

    def forward(self, x: torch.Tensor, linear: Callable[..., torch.Tensor] | None = None
                ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; ``linear``: the matmul in place of ``F.linear``
        (model/llama.py's ``Linear``), where the weights are fused and there is no LoRA or
        the weights are kept quantized (model/quant/)."""
        if self.lora is not None:
            return self._forward_lora(x, linear)
        if linear is not None and self.gate_up_weight is not None:
            gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
            if self.kernels is not None:
                h = self.kernels.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                h = F.silu(gate) * up
            return linear(h, self.down_proj.weight, self.down_proj.bias)
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(gate_up.view(-1, gate_up.shape[-1])))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _forward_lora(self, x: torch.Tensor,
                      linear: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        """The forward with each projection's LoRA delta added to its base output; a base
        weight kept quantized (a meta placeholder) is multiplied through ``linear``."""
        if self.gate_up_weight is None:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        elif linear is not None and self.gate_up_weight.is_meta:
            gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
        else:
            gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        gate, up = self.lora.delta("gate_up", x, gate_up).chunk(2, dim=-1)
        h = F.silu(gate) * up
        down = self.down_proj
        base = (linear(h, down.weight, down.bias) if linear is not None and down.weight.is_meta
                else down(h))
        return self.lora.delta("down", h, base)
