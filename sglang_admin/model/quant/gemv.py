"""Few-row projections on kept int4 and int8-block weights through a C kernel of our own
(``csrc/quant_gemv.c``) where the CPU has AVX512_VNNI and AVX512_BF16: ``vpdpbusd``
multiplies the weights' bytes (4-bit codes, or int8 values + 128) with the activations in
24-bit fixed point per group of 32 inputs (three int8 parts), 16 output rows per vector.
The layouts (:func:`pack_int4`, :func:`pack_int8`) put 16 rows side by side, so the
weights stream once, in order, and each group's scales apply once.

Why (measured, docs/cpu-performance.md): at batch 1, torch's ``_weight_int4pack_mm_for_cpu``
reads about 12-16 GB/s of weights on one core even with them in the L1/L2 caches: its
arithmetic (float32 FMAs after dequantizing each weight), not the memory, bounds it; and the
int8 LM head went through it as two 4-bit halves (35 MB a token where the values are 30 MB).
This kernel reads 26-30 GB/s of cached weights on one core, 2.2x torch's, so a token's
weights stream at the memory's speed.

Arithmetic: int4 as torch's kernel (``(q - 8) * scale + zero``, the same bfloat16 scales
and zeros), summed as ``scale * sum(q x) + (zero - 8 scale) * sum(x)`` per group: the
integer sums are exact, the activations' fixed point errs by at most 2^-24 of a group's
largest value, so the outputs are float32 arithmetic's to its rounding (then rounded to
bfloat16: 99.9% of outputs equal torch's kernel's). int8 blocks as stored (``q * d``, d
the block's float16 scale): float32 logits, so the LM head needs no float32 refinement of
its top logits.

:func:`gemv_kernel` is None where the CPU lacks the instructions (checked from
/proc/cpuinfo, :func:`cpu_has_gemv_kernel`), the compiler cannot build it, or it disagrees
with torch on small cases: the projections then keep torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "quant_gemv.c"
# what the kernel's instructions need (the /proc/cpuinfo names)
GEMV_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"})
BLOCK_ROWS = 16  # output rows side by side in the layouts
GROUP = 32  # inputs per scale

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def cpu_has_gemv_kernel(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU has the instructions the kernel uses (AVX-512 BW, VNNI and BF16)."""
    if flags is None:
        from sglang_admin.model.cpu_features import cpu_flags

        flags = cpu_flags()
    return flags >= GEMV_FLAGS


class GemvKernel:
    """The built kernel library: :meth:`q4` and :meth:`q8`."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        self.applies = bool(lib.gemv_applies())
        self._q4 = lib.q4_gemv_bf16
        self._q8 = lib.q8_gemv_bf16
        for fn in (self._q4, self._q8):
            fn.restype = None
            fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64]

    def bind(self, kind: str, w: torch.Tensor, s: torch.Tensor, n: int
             ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> out`` for one weight (``kind`` "int4": :meth:`q4`, else :meth:`q8`), its
        pointers bound once: a few microseconds less a call than :meth:`q4` at batch 1."""
        fn, dtype = (self._q4, torch.bfloat16) if kind == "int4" else (self._q8, torch.float32)
        wp, sp = w.data_ptr(), s.data_ptr()
        keep = (w, s)  # the bound pointers' storage lives as long as the closure

        def call(x: torch.Tensor) -> torch.Tensor:
            m, k = x.shape
            out = torch.empty(m, n, dtype=dtype)
            fn(x.data_ptr(), m, k, k, wp, sp, n, out.data_ptr(), n)
            return out

        call.keep = keep  # type: ignore[attr-defined]
        return call

    def q4(self, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, n: int) -> torch.Tensor:
        """bfloat16 x [M, K] (rows contiguous) times an int4 weight of ``n`` rows packed by
        :func:`pack_int4`: bfloat16 [M, n]."""
        m, k = x.shape
        out = torch.empty(m, n, dtype=torch.bfloat16)
        self._q4(x.data_ptr(), m, x.stride(0), k, w.data_ptr(), sz.data_ptr(), n,
                 out.data_ptr(), n)
        return out

    def q8(self, x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, n: int) -> torch.Tensor:
        """bfloat16 x [M, K] times an int8-block weight of ``n`` rows packed by
        :func:`pack_int8`: float32 [M, n]."""
        m, k = x.shape
        out = torch.empty(m, n, dtype=torch.float32)
        self._q8(x.data_ptr(), m, x.stride(0), k, w.data_ptr(), d.data_ptr(), n,
                 out.data_ptr(), n)
        return out


def _blocks(n: int) -> int:
    return -(-n // BLOCK_ROWS)


def pack_int4(q: np.ndarray, scale: torch.Tensor, zero: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of 4-bit codes ``q`` (uint8 [N, K], 0..15) with per-32-input
    ``scale`` and ``zero`` (float [N, K / 32], rounded to bfloat16 here):
    (uint8 [N16 / 16, K / 8, 64], bfloat16 [N16 / 16, K / 32, 2, 16]). Byte 4j + i of
    chunk c holds row j's codes of inputs 8c + i (low nibble) and 8c + 4 + i (high)."""
    n, k = q.shape
    nb = _blocks(n)
    pad = nb * BLOCK_ROWS - n
    codes = np.asarray(q, dtype=np.uint8)
    if pad:  # q = 8, scale = zero = 0: rows of zeros, never stored
        codes = np.concatenate([codes, np.full((pad, k), 8, np.uint8)])
    c = codes.reshape(nb, BLOCK_ROWS, k // 8, 2, 4).transpose(0, 2, 1, 4, 3)
    packed = (c[..., 0] | (c[..., 1] << 4)).reshape(nb, k // 8, 4 * BLOCK_ROWS)
    sz = torch.stack([scale.float(), zero.float()])  # [2, N, G]
    if pad:
        sz = torch.cat([sz, torch.zeros(2, pad, k // GROUP)], 1)
    sz = sz.view(2, nb, BLOCK_ROWS, k // GROUP).permute(1, 3, 0, 2)
    return (torch.from_numpy(np.ascontiguousarray(packed)),
            sz.to(torch.bfloat16).contiguous())


def pack_int8(q: np.ndarray, d: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's layout of int8 values ``q`` [N, K] with per-32-input scales ``d``
    [N, K / 32]: (uint8 [N16 / 16, K / 4, 64] holding q + 128, byte 4j + i of chunk c
    row j's input 4c + i; float16 [N16 / 16, K / 32, 16]); None where a scale is not exact
    in float16 (GGUF's Q8_0 scales are)."""
    n, k = q.shape
    d16 = np.asarray(d, dtype=np.float16)
    if not np.array_equal(d16.astype(np.float32), np.asarray(d, dtype=np.float32)):
        return None
    nb = _blocks(n)
    pad = nb * BLOCK_ROWS - n
    codes = (np.asarray(q, dtype=np.int16) + 128).astype(np.uint8)
    if pad:
        codes = np.concatenate([codes, np.full((pad, k), 128, np.uint8)])
        d16 = np.concatenate([d16, np.zeros((pad, k // GROUP), np.float16)])
    packed = codes.reshape(nb, BLOCK_ROWS, k // 4, 4).transpose(0, 2, 1, 3)
    scales = d16.reshape(nb, BLOCK_ROWS, k // GROUP).transpose(0, 2, 1)
    return (torch.from_numpy(np.ascontiguousarray(packed).reshape(nb, k // 4, 4 * BLOCK_ROWS)),
            torch.from_numpy(np.ascontiguousarray(scales)))


def shape_applies(k: int, group: int) -> bool:
    """Whether a weight with ``k`` inputs and scales per ``group`` fits the kernel."""
    return group == GROUP and k % GROUP == 0 and k > 0


def _agrees(kernel: GemvKernel) -> bool:
    """Small cases against the dequantized weights in float32 (rows off the block of 16)."""
    gen = torch.Generator().manual_seed(7)
    n, k = 37, 96
    q4 = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8).numpy()
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.1).to(torch.bfloat16).float()
    zero = (torch.randn(n, k // GROUP, generator=gen) * 0.05).to(torch.bfloat16).float()
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    w = ((torch.from_numpy(q4).float() - 8).view(n, -1, GROUP) * scale[..., None]
         + zero[..., None]).view(n, k)
    got = kernel.q4(x, *pack_int4(q4, scale, zero), n).float()
    if not torch.allclose(got, x.float() @ w.t(), atol=2e-2, rtol=1e-2):
        return False
    q8 = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8).numpy()
    d = (torch.rand(n, k // GROUP, generator=gen) * 0.01).half().float().numpy()
    packed = pack_int8(q8, d)
    assert packed is not None
    w = (torch.from_numpy(q8).float().view(n, -1, GROUP) * torch.from_numpy(d)[..., None])
    got = kernel.q8(x, *packed, n)
    return torch.allclose(got, x.float() @ w.view(n, k).t(), atol=1e-4, rtol=1e-4)


@functools.cache
def _load() -> GemvKernel | None:
    from sglang_admin.model.cpu_kernels_build import _FLAG_SETS, _compile

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("quantized few-row kernel: no C compiler; torch's kernels serve")
        return None
    cflags, libs = _FLAG_SETS[0]  # -march=native with OpenMP, or nothing
    try:
        path = _compile(cc, cflags, libs, source=SOURCE)
        kernel = GemvKernel(path) if path is not None else None
    except OSError as exc:
        logger.warning("quantized few-row kernel: could not load it: %s", exc)
        return None
    if kernel is None or not kernel.applies:
        logger.info("quantized few-row kernel: not built for this CPU; torch's kernels serve")
        return None
    with torch.inference_mode():
        if not _agrees(kernel):
            logger.warning("quantized few-row kernel %s disagrees with torch; not used",
                           kernel.path)
            return None
    return kernel


def loaded() -> GemvKernel | None:
    """The kernel if it was built and loaded in this process (no check of the CPU: what
    holds the layouts of :func:`pack_int4` / :func:`pack_int8` asked :func:`gemv_kernel`)."""
    return _load()


def gemv_kernel() -> GemvKernel | None:
    """The kernel where this CPU has its instructions and it builds and checks; else None."""
    if not cpu_has_gemv_kernel():
        return None
    return _load()
