"""The dtype ``--dtype auto`` picks, and why: on CPU bfloat16 where the CPU computes it natively
and the checkpoint's weights are half precision or quantized (a GGUF), else float32
(docs/cpu-dtypes.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_admin.model.cpu_features import cpu_flags
from sglang_admin.model.gguf import GGUF_WEIGHT_TYPE_KEY
from sglang_admin.model.loader import dtype_from_name, read_hf_config

# /proc/cpuinfo flags of native bfloat16 arithmetic: AVX-512 BF16 (dot products of bf16
# pairs, Cooper Lake, Sapphire Rapids, Zen 4 and later) and AMX-BF16 (tile matmuls,
# Sapphire Rapids and later). Without them torch (oneDNN) converts bf16 to float32 around
# each op, which is slower than float32 itself.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
HALF_PRECISION = frozenset({"bfloat16", "float16"})
# GGUF weight types whose values float32 holds and bfloat16 would round: full precision
FULL_PRECISION_GGUF = frozenset({"F32", "F64"})


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype a rank runs in and, in a few words, why (its start line prints both)."""

    dtype: torch.dtype
    reason: str


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU has AVX-512 BF16 or AMX-BF16 and torch's oneDNN backend is built
    (it is what runs bfloat16 matmuls with them)."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & NATIVE_BF16_FLAGS) and torch.backends.mkldnn.is_available()


def gguf_weight_type(model_path: str) -> str:
    """The GGUF weight type a converted checkpoint's config.json records ("Q4_1" ...); ""
    for any other checkpoint (or a value that is not a type name)."""
    value = read_hf_config(model_path).get(GGUF_WEIGHT_TYPE_KEY)
    return value if isinstance(value, str) and value.isidentifier() else ""


def _weights(checkpoint_dtype: str, gguf_weight_type: str) -> tuple[str, bool]:
    """(how the weights are described, whether bfloat16 holds what they have)."""
    if gguf_weight_type:
        low = gguf_weight_type not in FULL_PRECISION_GGUF
        return f"{gguf_weight_type} GGUF weights", low
    return f"a {checkpoint_dtype} checkpoint", checkpoint_dtype in HALF_PRECISION


def auto_cpu_choice(checkpoint_dtype: str, gguf_weight_type: str = "",
                    flags: frozenset[str] | None = None) -> DtypeChoice:
    """``--dtype auto`` on CPU: bfloat16 for a bfloat16 or float16 checkpoint, or a GGUF
    file whose weights are quantized or half precision, on a CPU with native bfloat16
    (float16 has no fast CPU path; bfloat16 holds its range); else float32. Full-precision
    weights stay float32: rounding them is the user's choice (``--dtype bfloat16``), not a
    default. ``gguf_weight_type`` is a converted GGUF's weight type ("" for other
    checkpoints); ``flags`` the CPU's (default: this machine's)."""
    flags = cpu_flags() if flags is None else flags
    weights, low_precision = _weights(checkpoint_dtype, gguf_weight_type)
    native = cpu_has_native_bf16(flags)
    have = ", ".join(sorted(flags & NATIVE_BF16_FLAGS))
    if not low_precision:
        return DtypeChoice(torch.float32, f"{weights}: float32 keeps every weight "
                                          "(--dtype bfloat16 rounds them)")
    if native:
        return DtypeChoice(torch.bfloat16, f"{weights} and a CPU with native bfloat16 ({have})")
    why = ("torch has no oneDNN" if flags & NATIVE_BF16_FLAGS
           else "no avx512_bf16 or amx_bf16 on this CPU")
    return DtypeChoice(torch.float32, f"{weights}, but bfloat16 would be emulated ({why})")


def auto_cpu_dtype(checkpoint_dtype: str, flags: frozenset[str] | None = None,
                   gguf_weight_type: str = "") -> torch.dtype:
    """The dtype of :func:`auto_cpu_choice`."""
    return auto_cpu_choice(checkpoint_dtype, gguf_weight_type, flags).dtype


def choose_dtype(dtype: str, device: torch.device, checkpoint_dtype: str,
                 gguf_weight_type: str = "") -> DtypeChoice:
    """``--dtype`` resolved: a named dtype as given; "auto" on CPU by
    :func:`auto_cpu_choice`, on CUDA the checkpoint's half dtype, else bfloat16."""
    if dtype != "auto":
        return DtypeChoice(dtype_from_name(dtype), "--dtype " + dtype)
    if device.type != "cuda":
        choice = auto_cpu_choice(checkpoint_dtype, gguf_weight_type)
        return DtypeChoice(choice.dtype, "--dtype auto: " + choice.reason)
    if checkpoint_dtype in HALF_PRECISION:
        return DtypeChoice(dtype_from_name(checkpoint_dtype),
                           f"--dtype auto: a {checkpoint_dtype} checkpoint on CUDA")
    return DtypeChoice(torch.bfloat16, "--dtype auto: bfloat16 on CUDA")
