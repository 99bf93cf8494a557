"""Which attention path a rank runs, decided in this one place: on CUDA, and on a CPU which
prefill chunks go to the CPU kernel (:func:`extend_kernel_takes`).

On CUDA (unless ``--attention-backend torch_native``) decode sequences attend through the
Triton paged kernel (model/attention/triton_decode.py), which reads each key through the
request-to-token table instead of a gathered, padded copy, and an extend sequence with a
cached prefix attends through SDPA with a bottom-right causal bias instead of a boolean mask
(a mask rules out the flash kernel; with the bias and grouped heads SDPA takes it). A
sliding window in reach of a prefill chunk still takes the mask.

Elsewhere nothing changes: the CPU kernels (model/cpu_kernels.py) or torch's SDPA over
gathered rows. ``torch_native`` keeps torch's path on CUDA too, which is how
tools/check_attention.py compares the two on a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from sglang_admin.model.cpu_features import cpu_has_tile_matmul

__all__ = ["EXTEND_MAX_TOKENS", "cuda_attention_applies", "extend_kernel_takes", "kernel_problem",
           "triton_available"]

logger = logging.getLogger(__name__)


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (torch's CUDA wheels ship it)."""
    return importlib.util.find_spec("triton") is not None


def cuda_attention_applies(device: torch.device, backend: str, heads: int, kv_heads: int,
                           head_dim: int, dtype: torch.dtype) -> bool:
    """True where a rank on ``device`` with ``--attention-backend backend`` runs the CUDA
    attention path: a CUDA device, a backend other than ``torch_native``, Triton installed,
    and the decode kernel passing its start-up check for the model's heads and dtype (it
    compiles, runs and agrees with torch); otherwise the rank logs why and keeps torch's
    path."""
    if device.type != "cuda" or backend == "torch_native":
        return False
    if not triton_available():
        logger.warning("triton is not installed: decode attention on %s runs torch's SDPA over "
                       "a gathered copy of the KV cache (slow); install triton", device)
        return False
    problem = kernel_problem(device, heads, kv_heads, head_dim, dtype)
    if problem is not None:
        logger.warning("the Triton decode kernel failed its start-up check on %s (%s): decode "
                       "attention runs torch's SDPA over a gathered copy of the KV cache",
                       device, problem)
        return False
    logger.info("attention on %s: decode through the Triton paged kernel, prefill after a "
                "cached prefix without a mask (--attention-backend torch_native: torch's)", device)
    return True


def kernel_problem(device: torch.device, heads: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> str | None:
    """model/attention/triton_decode.py's ``startup_check`` (imported here: only a rank
    that may run the kernel imports triton)."""
    from sglang_admin.model.attention.triton_decode import startup_check

    return startup_check(device, heads, kv_heads, head_dim, dtype)


# The prefill kernel reads a query token's keys once per token, where torch's flash attention
# reuses them across a block of queries: at 8 heads of 32 dims, one thread, it is 1.45x-1.5x
# torch at 256-512 new tokens, 1.05x at 1024 and 0.87x at 1536 (one thread, in-process), so longer
# chunks go to torch. It runs on one thread, so only where torch runs one thread too.
EXTEND_MAX_TOKENS = 1024


def extend_kernel_takes(dtype: torch.dtype, prefix: int, n: int,
                        tile_matmul: bool | None = None, kernel_tiles: bool = False) -> bool:
    """Whether a prefill chunk of ``n`` new tokens after ``prefix`` cached ones goes through
    the CPU prefill kernel rather than torch's SDPA (where the build has the kernel): float32
    chunks up to ``EXTEND_MAX_TOKENS``; bfloat16 chunks of any length where the kernel
    multiplies on AMX tiles (``kernel_tiles``: model/extend_batch.py's ``tile_kernel``;
    every bfloat16 chunk of a step in one call, 1.5-2.3x torch's flash attention per
    sequence from 16 to 2048 new tokens with and without a cached prefix, one thread, and
    3.3-4.3x on a step of 32 short prompts; docs/cpu-performance.md), or where the CPU has no
    AMX tiles (the flash kernel on AVX512_BF16: 2-3.5x torch's bfloat16 SDPA from 16 tokens
    up), and none where the CPU has tiles the kernel does not use (torch's flash attention
    multiplies its blocks on the tiles: 1.6-2.9x the AVX512_BF16 kernel from 64 new tokens
    up). ``tile_matmul``: whether the CPU has AMX-BF16 (default: this machine)."""
    if dtype == torch.bfloat16:
        if n <= 0:
            return False
        if kernel_tiles:
            return True
        if tile_matmul is None:
            tile_matmul = cpu_has_tile_matmul()
        return not tile_matmul
    return n <= EXTEND_MAX_TOKENS
