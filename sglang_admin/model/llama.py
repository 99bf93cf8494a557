"""One torch implementation of the Llama family of decoder-only transformers.

LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM differ only in
details (attention bias, per-head q/k RMSNorm, sliding windows, RoPE scaling), so one
module tree covers them all. Parameter names follow the Hugging Face checkpoints
(``model.layers.N.self_attn.q_proj.weight`` ...), so a safetensors state dict loads as is.

The attention reads and writes a paged KV pool: a per-layer ``[num_slots, kv_heads,
head_dim]`` tensor pair. Which slots a sequence owns is described by an
:class:`AttentionMetadata`, built once per forward pass by the runner and shared by every
layer. A forward handles a whole continuous batch at once: the new tokens of all sequences
are flattened into one ``[T]`` axis, decode sequences (one new token each) first, then
extend sequences (prefill chunks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_admin.model.cpu_kernels import DecodeLayerWeights

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "yarn")


# ---------------------------------------------------------------- configuration


@dataclass
class LlamaConfig:
    """The subset of a Hugging Face config.json this implementation needs."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # per layer: the sliding window size, or None for full attention
    sliding_windows: list[int | None] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build from a parsed config.json; raises ValueError when something is unsupported."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"config.json lacks a valid field: {exc}") from None
        num_kv = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv != 0:
            raise ValueError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}"
            )
        theta, scaling = _rope_settings(cfg)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        result = cls(
            architecture=arch,
            model_type=str(cfg.get("model_type", "")),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_windows=_sliding_windows(cfg, arch, num_layers),
        )
        try:
            rope_inv_freq(result)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise ValueError(f"invalid rope_scaling {scaling}: {exc!r}") from None
        return result


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either the v4 or the v5 transformers layout."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:  # transformers >= 5
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {kind!r} "
                f"(supported: default, {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        else:
            scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
            scaling["rope_type"] = kind
    return theta, scaling


def _sliding_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> list[int | None]:
    """The sliding window of every layer (None: full attention), following transformers."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return [None] * num_layers
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    if arch.startswith("Qwen"):
        first = int(cfg.get("max_window_layers", num_layers))
        return [int(window) if i >= first else None for i in range(num_layers)]
    return [int(window)] * num_layers


# ---------------------------------------------------------------- rotary embedding


def rope_inv_freq(cfg: LlamaConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scale for cfg's RoPE type."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
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


def _yarn_inv_freq(cfg: LlamaConfig, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
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
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the original frequency)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """cos and signed sin for a batch of positions, computed once per forward."""

    def __init__(self, cfg: LlamaConfig) -> None:
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


# ---------------------------------------------------------------- attention metadata


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
    # scratch for gathered K and V rows ([rows, kv_heads * head_dim] each), reused by every
    # layer: allocating megabytes per layer costs page faults on CPU
    gather_k: torch.Tensor | None = None
    gather_v: torch.Tensor | None = None


def gather_rows(
    pool: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """pool[index] along dim 0, into out[:len(index)] when a scratch buffer is given."""
    if out is None:
        return pool.index_select(0, index)
    return torch.index_select(pool, 0, index, out=out[: index.shape[0]])


# ---------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (weight only), computed like transformers' LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: Any = None  # model/cpu_kernels.py's CpuKernels (CPU float32 only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.is_contiguous():
            return self.kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV pool."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.lora: Any = None  # model/lora.py's LayerLora once LoRA is enabled
        self.kernels: Any = None  # model/cpu_kernels.py's CpuKernels (CPU float32 only)

    def fuse(self) -> None:
        """Concatenate q/k/v weights into one matrix; the HF-named params become views of it."""
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        self.qkv_weight = weight
        sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        for proj, part in zip((self.q_proj, self.k_proj, self.v_proj), weight.split(sizes)):
            proj.weight = nn.Parameter(part, requires_grad=False)
        if self.q_proj.bias is not None:
            bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
            self.qkv_bias = bias
            for proj, part in zip((self.q_proj, self.k_proj, self.v_proj), bias.split(sizes)):
                proj.bias = nn.Parameter(part, requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the new K/V into the pool first."""
        n_tok = x.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.lora is not None:
            qkv = self.lora.delta("qkv", x, qkv)
        qkv = qkv.view(n_tok, h + 2 * kv, d)
        v = qkv[:, h + kv :]
        rope = apply_rope if self.kernels is None else self.kernels.rope
        if self.qk_norm:
            q = rope(self.q_norm(qkv[:, :h]), cos, sin)
            k = rope(self.k_norm(qkv[:, h : h + kv]), cos, sin)
        else:  # rotate q and k heads in one go
            q, k = rope(qkv[:, : h + kv], cos, sin).split([h, kv], dim=1)
        k_cache.index_copy_(0, meta.out_slots, k)
        v_cache.index_copy_(0, meta.out_slots, v)
        out = self._attend(q, k, v, meta, k_cache, v_cache)
        if self.lora is not None:
            return self.lora.delta("o", out, self.o_proj(out))
        return self.o_proj(out)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_flat = k_cache.view(k_cache.shape[0], kv * d)
        v_flat = v_cache.view(v_cache.shape[0], kv * d)
        parts = []
        nd = meta.num_decode
        if meta.decode_batch is not None:
            parts.append(meta.decode_batch.attend(q[:nd], k_cache, v_cache, self.scale,
                                                  self.sliding_window))
        for group in meta.decode_groups:
            # queries of one kv head form the "query length" axis: no K/V repeat needed
            a, n, length = group.start, group.count, group.length
            qd = q[a : a + n].reshape(n, kv, self.group, d)
            kd = gather_rows(k_flat, group.kv_index, meta.gather_k)
            vd = gather_rows(v_flat, group.kv_index, meta.gather_v)
            kd = kd.view(n, length, kv, d).transpose(1, 2)
            vd = vd.view(n, length, kv, d).transpose(1, 2)
            mask = group.mask
            if self.sliding_window is not None and group.swa_mask is not None:
                mask = group.swa_mask
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=self.scale)
            parts.append(od.reshape(n, h * d))
        if meta.extend_seqs:
            parts.append(self._attend_extend(q[nd:], k[nd:], v[nd:], meta, k_flat, v_flat))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _attend_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of the extend tokens q [Te, H, D] (k, v: their new keys and values), one
        sequence at a time (no padding to the longest one), through the CPU kernel where it
        applies (keys and values read from the pool, a cached prefix's too)."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        windowed = self.sliding_window is not None
        outs = []
        for seq in meta.extend_seqs:
            end = seq.start + seq.n
            if seq.slots is not None:  # the runner chose the CPU prefill kernel for it
                outs.append(self.kernels.extend_attend(
                    q[seq.start : end], k_flat.view(-1, kv, d), v_flat.view(-1, kv, d),
                    seq.slots, seq.prefix, self.scale, self.sliding_window))
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
            if mask is None:
                out = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                out = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True
                )
            outs.append(out[0].transpose(0, 1).reshape(seq.n, h * d))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


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
        self.kernels: Any = None  # model/cpu_kernels.py's CpuKernels (CPU float32 only)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:
            return self._forward_lora(x)
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(gate_up.view(-1, gate_up.shape[-1])))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _forward_lora(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        else:
            gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        gate, up = self.lora.delta("gate_up", x, gate_up).chunk(2, dim=-1)
        h = F.silu(gate) * up
        return self.lora.delta("down", h, self.down_proj(h))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_weights(self) -> DecodeLayerWeights | None:
        """This layer as ``CpuKernels.decode_layer`` reads it; None where that does not apply
        (torch's ops, LoRA, per-head q/k norms, weights not fused or not contiguous)."""
        attn, mlp = self.self_attn, self.mlp
        if (attn.kernels is None or attn.lora is not None or mlp.lora is not None
                or attn.qk_norm or attn.qkv_weight is None or mlp.gate_up_weight is None):
            return None
        weights = DecodeLayerWeights(
            self.input_layernorm.weight, attn.qkv_weight, attn.qkv_bias, attn.o_proj.weight,
            attn.o_proj.bias, self.post_attention_layernorm.weight, mlp.gate_up_weight,
            mlp.gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias, attn.num_heads,
            attn.num_kv_heads, attn.head_dim, mlp.down_proj.in_features,
            self.input_layernorm.eps, attn.scale, attn.sliding_window,
            lambda: attn.lora is not None or mlp.lora is not None)
        tensors = (weights.ln1, weights.w_qkv, weights.b_qkv, weights.w_o, weights.b_o,
                   weights.ln2, weights.w_gate_up, weights.b_gate_up, weights.w_down,
                   weights.b_down)
        if not all(t is None or t.is_contiguous() for t in tensors):
            return None
        return weights


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of checkpoints)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The causal LM for every supported architecture, over a paged KV pool."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        # every layer as CpuKernels.decode_layer reads it, built at the first decode step;
        # weights change in place (copy_), and whatever replaces tensors drops it
        self._decode_layers: list[DecodeLayerWeights] | None = None

    def output_weight(self) -> torch.Tensor:
        """The LM head matrix (the embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def weight_bytes(self) -> int:
        """Bytes held by the parameters (a fused matrix counted once, through its views)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def materialize_buffers(self, device: torch.device) -> None:
        """Recompute non-persistent buffers (RoPE frequencies, float32) on device.

        Needed after building the model on the meta device and assigning loaded weights.
        """
        self.rotary.inv_freq = rope_inv_freq(self.config)[0].to(device)

    def release_parameters(self) -> None:
        """Free every weight; shapes and dtypes stay (on the meta device).

        :meth:`allocate_parameters` gives the model storage again; weights are loaded next.
        """
        for layer in self.model.layers:
            layer.self_attn.qkv_weight = layer.self_attn.qkv_bias = None
            layer.mlp.gate_up_weight = layer.mlp.gate_up_bias = None
        self._decode_layers = None
        self.to_empty(device="meta")

    def allocate_parameters(self, device: torch.device) -> None:
        """Fresh, uninitialised parameters on device, fused as the forward wants them."""
        self.to_empty(device=device)
        self.materialize_buffers(device)
        self.fuse_projections()

    def use_cpu_kernels(self, kernels: Any) -> None:
        """RMSNorm, RoPE and SwiGLU through model/cpu_kernels.py's CpuKernels (None: torch's
        ops). The caller checks that they apply: float32 weights on the CPU."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = kernels
        self._decode_layers = None

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up matmuls (call after loading weights; names keep working)."""
        with torch.no_grad():
            for layer in self.model.layers:
                layer.self_attn.fuse()
                layer.mlp.fuse()
        self._decode_layers = None

    def decode_layers(self) -> list[DecodeLayerWeights] | None:
        """Every layer for ``CpuKernels.decode_layer``, or None when one of them cannot go
        that way (see ``DecoderLayer.decode_weights``; LoRA is looked at every time)."""
        if self._decode_layers is None:
            layers = [layer.decode_weights() for layer in self.model.layers]
            self._decode_layers = [w for w in layers if w is not None]
        if len(self._decode_layers) != self.config.num_layers:
            return None
        if any(w.lora_hooks() for w in self._decode_layers):
            return None
        return self._decode_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) of the flattened new tokens."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        batch = meta.decode_batch
        if batch is not None and meta.num_decode == x.shape[0]:
            # decode only, CPU kernels: each layer in one call (no per-op dispatch)
            layers = self.decode_layers()
            if layers is not None:
                for i, weights in enumerate(layers):
                    batch.kernel.decode_layer(x, weights, cos, sin, k_caches[i], v_caches[i],
                                              meta.out_slots, batch)
                return x
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, meta, k_caches[i], v_caches[i])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for selected hidden rows (applies the final norm)."""
        kernels = self.model.norm.kernels
        weight = self.output_weight()
        if kernels is not None and weight.is_contiguous():  # a few rows: see CpuKernels.linear
            return kernels.linear(self.model.norm(hidden).contiguous(), weight)
        return F.linear(self.model.norm(hidden), weight)
