"""The model's configuration: the subset of a Hugging Face config.json that the Llama family
needs, parsed and checked (RoPE settings, sliding windows, supported architectures)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_admin.model.rotary import rope_inv_freq

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
