"""The dtype ``--dtype auto`` picks on CPU: bfloat16 where the CPU computes it natively and the
checkpoint is half precision, else float32 (docs/cpu-dtypes.md)."""

from __future__ import annotations

import torch

# /proc/cpuinfo flags of native bfloat16 arithmetic: AVX-512 BF16 (dot products of bf16
# pairs, Cooper Lake, Sapphire Rapids, Zen 4 and later) and AMX-BF16 (tile matmuls,
# Sapphire Rapids and later). Without them torch (oneDNN) converts bf16 to float32 around
# each op, which is slower than float32 itself.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
HALF_PRECISION = frozenset({"bfloat16", "float16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (the first ``flags`` line of /proc/cpuinfo); empty where that
    file does not exist or has none (not Linux, not x86)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU has AVX-512 BF16 or AMX-BF16 and torch's oneDNN backend is built
    (it is what runs bfloat16 matmuls with them)."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & NATIVE_BF16_FLAGS) and torch.backends.mkldnn.is_available()


def auto_cpu_dtype(checkpoint_dtype: str, flags: frozenset[str] | None = None) -> torch.dtype:
    """``--dtype auto`` on CPU: bfloat16 for a bfloat16 or float16 checkpoint on a CPU with
    native bfloat16 (float16 has no fast CPU path; bfloat16 holds its range), else float32.
    A float32 checkpoint stays float32: rounding its weights is the user's choice
    (``--dtype bfloat16``), not a default."""
    if checkpoint_dtype in HALF_PRECISION and cpu_has_native_bf16(flags):
        return torch.bfloat16
    return torch.float32
