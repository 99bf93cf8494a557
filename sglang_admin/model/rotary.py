"""Rotary position embedding: RoPE frequencies (with linear, Llama 3 and YaRN scaling) and
their application to query and key heads."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import nn


class RopeSettings(Protocol):
    """What RoPE reads of a model config (model/config.py's LlamaConfig has it all)."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int


def rope_inv_freq(cfg: RopeSettings) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32, computed on the CPU whatever the default
    device: under the meta device of a model's construction, arange would import
    torch._dynamo, ~2 s of a rank's start-up) and the cos/sin scale for cfg's RoPE type."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling, cfg.max_position_embeddings), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(cfg, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def _llama3_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], max_positions: int
) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by factor, a smooth ramp between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings") or max_positions)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(cfg: RopeSettings, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, a linear ramp in between."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    orig = int(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = scaling.get("factor")
    factor = float(factor) if factor else cfg.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the original frequency)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """cos and signed sin for a batch of positions, computed once per forward."""

    def __init__(self, cfg: RopeSettings) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each position, [T, 1, head_dim] to broadcast over heads.

        rotate_half(x) * sin == roll(x, D/2) * [-sin, sin], so the sign lives in sin.
        """
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos()
        sin = freqs.sin()
        if self.scale != 1.0:
            cos = cos * self.scale
            sin = sin * self.scale
        cos = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        sin = torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D], with cos/sin from RotaryEmbedding."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
