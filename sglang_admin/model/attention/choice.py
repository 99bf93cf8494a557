"""Which attention path a rank runs on CUDA, decided in this one place.

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

__all__ = ["cuda_attention_applies", "kernel_problem", "triton_available"]

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
