"""Which device a rank runs on and how much of its memory the KV pool takes.

A rank's device is resolved once, in the rank's own process: ``auto`` is CUDA when torch sees
a GPU, else the CPU. On CUDA each data-parallel rank takes its own GPU, as SGLang assigns
them: ``--base-gpu-id + rank * --gpu-id-step`` (indices as the rank sees them, i.e. within
``CUDA_VISIBLE_DEVICES``), and the rank makes it its current device so every allocation
and NCCL communicator lands there.

The KV pool's default size (no ``--max-total-tokens``) follows SGLang's
``--mem-fraction-static``: weights plus KV pool take at most that fraction of the GPU's
memory, so the pool gets what that fraction leaves once the weights (and whatever else was
already allocated) are in, and never more than the requests can use
(``--max-running-requests`` x the context length): on a large GPU a small model would
otherwise get a pool of a hundred million slots whose host-side free list alone costs
seconds and gigabytes.
"""

from __future__ import annotations

import torch

from sglang_admin.config import DEFAULT_MEM_FRACTION_STATIC
from sglang_admin.model.loader import ModelLoadError

__all__ = ["DEFAULT_MEM_FRACTION_STATIC", "default_token_capacity", "kv_token_capacity",
           "resolve_device", "use_device"]
# Room kept outside the pool for activations, sampling and the allocator's slack.
_ACTIVATION_RESERVE_BYTES = 1 << 30
# CPU: the pool's size when no --max-total-tokens is given.
CPU_KV_BUDGET_BYTES = 1 << 30
CPU_MAX_TOKENS = 65536


def resolve_device(device: str, index: int = 0) -> torch.device:
    """"auto" -> ``cuda:index`` when CUDA is available, else cpu; "cuda" -> ``cuda:index``;
    "cuda:N" and "cpu" as given. Raises :class:`ModelLoadError` for a device torch cannot
    see (no CUDA, or an index past the visible devices)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise ModelLoadError("device cuda requested but CUDA is not available")
    if dev.index is None:
        dev = torch.device("cuda", index)
    count = torch.cuda.device_count()
    if dev.index >= count:
        raise ModelLoadError(
            f"this rank's GPU is cuda:{dev.index} but only {count} CUDA device(s) are visible "
            "(CUDA_VISIBLE_DEVICES); check --base-gpu-id, --gpu-id-step and --dp-size")
    return dev


def use_device(dev: torch.device) -> None:
    """Make ``dev`` the process's current CUDA device (nothing to do on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)


def kv_token_capacity(
    per_token_bytes: int,
    *,
    free_bytes: int,
    total_bytes: int,
    mem_fraction_static: float,
    max_useful_tokens: int,
) -> int:
    """KV slots for a GPU with ``free_bytes`` of ``total_bytes`` free (weights loaded).

    The pool gets ``total * mem_fraction_static`` less what is already used and an
    activation reserve, capped at ``max_useful_tokens``; raises :class:`ModelLoadError`
    when that leaves no room for a single request's context."""
    if not 0.0 < mem_fraction_static <= 1.0:
        raise ModelLoadError(f"--mem-fraction-static must lie in (0, 1], got {mem_fraction_static}")
    used = total_bytes - free_bytes
    budget = int(total_bytes * mem_fraction_static) - used - _ACTIVATION_RESERVE_BYTES
    tokens = min(budget // per_token_bytes, max_useful_tokens) if budget > 0 else 0
    if tokens <= 0:
        raise ModelLoadError(
            f"no GPU memory left for a KV cache: --mem-fraction-static {mem_fraction_static} of "
            f"{total_bytes / 2**30:.1f} GiB, {used / 2**30:.1f} GiB already in use; raise "
            "--mem-fraction-static or free the GPU")
    return int(tokens)


def default_token_capacity(
    device: torch.device, per_token_bytes: int, *, mem_fraction_static: float,
    max_useful_tokens: int,
) -> int:
    """The KV pool's size when ``--max-total-tokens`` is not given (see the module doc)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return kv_token_capacity(
            per_token_bytes, free_bytes=free, total_bytes=total,
            mem_fraction_static=mem_fraction_static, max_useful_tokens=max_useful_tokens)
    return int(min(CPU_MAX_TOKENS, CPU_KV_BUDGET_BYTES // per_token_bytes))
