"""What this CPU can do, read from /proc/cpuinfo: the feature flags that pick a dtype
(cpu_dtype.py) and a kernel (cpu_kernels.py, quant/gemv.py). A leaf module: it imports
nothing of the package."""

from __future__ import annotations

import functools


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


@functools.cache
def cpu_has_tile_matmul() -> bool:
    """True when the CPU has AMX-BF16 tiles, which torch's bfloat16 flash attention and
    oneDNN's GEMMs use (read once)."""
    return "amx_bf16" in cpu_flags()
