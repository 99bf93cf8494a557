"""Batched projections on kept int4 weights through AMX tiles (``csrc/quant_amx.c``), where
the CPU has AMX-BF16: each 16 x 32 tile of 4-bit weights is dequantized once per call into
bfloat16 and multiplied with up to 48 activation rows by ``TDPBF16PS``.

Why (measured, docs/cpu-performance.md): a decode step of a few dozen rows is bound by
reading its weights; oneDNN's packed bfloat16 copy reads 2 bytes a weight where the codes
and their scales are ~0.6, and AMX's arithmetic at 16-48 rows is cheap beside it.

The weights multiplied are the dense bfloat16 copy's (model/quant/linear.py): ``(q - 8) *
scale + zero`` in float32, one FMA, rounded to bfloat16 (the check at load compares them).
:func:`amx_kernel` is None where the CPU lacks AMX (checked from /proc/cpuinfo), the
compiler cannot build it, Linux refuses the tile state, or it disagrees with the dense
GEMM on small cases: the projections then keep their dense copy.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "quant_amx.c"
# what the kernel's instructions need (the /proc/cpuinfo names)
AMX_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"})
BLOCK_ROWS = 16  # output rows of a tile
GROUP = 32  # inputs per scale (a tile's depth)
# rows from which a step takes this kernel instead of torch's int4 one (measured over
# SmolLM2's layers, one core: torch's 11.8 / 15.1 / 22.5 / 26.4 ms at 3 / 4 / 6 / 8 rows,
# this kernel 15.8-16.5 ms at any of them: its cost is the dequantization), and up to which
# it takes it instead of the dense copy (past that, prefill's GEMMs are compute-bound:
# oneDNN's, reading the dense copy once for many rows)
MIN_ROWS = 5
MAX_ROWS = 64

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def cpu_has_amx_kernel(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU has the instructions the kernel uses (AVX-512 BF16, AMX-BF16)."""
    if flags is None:
        from sglang_admin.model.cpu_features import cpu_flags

        flags = cpu_flags()
    return flags >= AMX_FLAGS


class AmxKernel:
    """The built kernel library: :meth:`q4`."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        self.applies = bool(lib.amx_applies()) and lib.amx_init() == 0
        self._q4 = lib.q4_amx_bf16
        self._q8 = lib.q8_amx_f32
        for fn in (self._q4, self._q8):
            fn.restype = None
            fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64]

    def q4(self, x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, n: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
        """bfloat16 x [M, K] (rows contiguous) times an int4 weight of ``n`` rows packed by
        :func:`pack_int4`: bfloat16 [M, n] (into ``out`` when given, rows contiguous)."""
        m, k = x.shape
        if out is None:
            out = torch.empty(m, n, dtype=torch.bfloat16)
        self._q4(x.data_ptr(), m, x.stride(0), k, codes.data_ptr(), sz.data_ptr(), n,
                 out.data_ptr(), out.stride(0))
        return out

    def q8(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, n: int) -> torch.Tensor:
        """bfloat16 x [M, K] (rows contiguous) times an int8-block weight of ``n`` rows
        packed by :func:`pack_int8`: float32 [M, n], the blocks' values as stored."""
        m, k = x.shape
        out = torch.empty(m, n, dtype=torch.float32)
        self._q8(x.data_ptr(), m, x.stride(0), k, codes.data_ptr(), d.data_ptr(), n,
                 out.data_ptr(), n)
        return out


def shape_applies(n: int, k: int, group: int) -> bool:
    """Whether a weight [n, k] with scales per ``group`` inputs fits the kernel."""
    return group == GROUP and k % GROUP == 0 and n % BLOCK_ROWS == 0 and n > 0 and k > 0


def pack_int4(q: np.ndarray, scale: torch.Tensor, zero: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of 4-bit codes ``q`` (uint8 [N, K], 0..15; N % 16 == 0) with
    per-32-input ``scale`` and ``zero`` (float [N, K / 32], rounded to bfloat16 here):
    (uint8 [N / 16, K / 32, 16, 16], bfloat16 [N / 16, K / 32, 2, 16]). Tile row r holds
    inputs 2r and 2r + 1: byte i the lane i (low nibble) and 16 + i (high), lane L output
    row L // 2 of the block, input 2r + L % 2."""
    n, k = q.shape
    nb, g = n // BLOCK_ROWS, k // GROUP
    codes = np.asarray(q, dtype=np.uint8).reshape(nb, BLOCK_ROWS, g, 16, 2)
    lanes = codes.transpose(0, 2, 3, 1, 4).reshape(nb, g, 16, 32)
    packed = lanes[..., :16] | (lanes[..., 16:] << 4)
    sz = torch.stack([scale.float(), zero.float()])  # [2, N, G]
    sz = sz.view(2, nb, BLOCK_ROWS, g).permute(1, 3, 0, 2)
    return (torch.from_numpy(np.ascontiguousarray(packed)), sz.to(torch.bfloat16).contiguous())


def pack_int8(q: np.ndarray, d: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of int8 values ``q`` [N, K] (N % 16 == 0) with per-32-input
    scales ``d`` [N, K / 32]: (int8 [N / 16, K / 32, 16, 32], float32 [N / 16, K / 32, 16]);
    tile row r holds inputs 2r and 2r + 1, byte L output row L // 2, input 2r + L % 2."""
    n, k = q.shape
    nb, g = n // BLOCK_ROWS, k // GROUP
    codes = np.asarray(q, dtype=np.int8).reshape(nb, BLOCK_ROWS, g, 16, 2)
    packed = codes.transpose(0, 2, 3, 1, 4).reshape(nb, g, 16, 32)
    scales = np.asarray(d, dtype=np.float32).reshape(nb, BLOCK_ROWS, g).transpose(0, 2, 1)
    return (torch.from_numpy(np.ascontiguousarray(packed)),
            torch.from_numpy(np.ascontiguousarray(scales)))


def dequantized(q: np.ndarray, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weights [N, K] the kernel multiplies with (its arithmetic, in torch)."""
    n, k = q.shape
    s = scale.to(torch.bfloat16).float().repeat_interleave(GROUP, 1)
    z = zero.to(torch.bfloat16).float().repeat_interleave(GROUP, 1)
    qf = torch.from_numpy(np.asarray(q, dtype=np.float32)) - 8
    return torch.addcmul(z, qf, s).to(torch.bfloat16)


def _agrees(kernel: AmxKernel) -> bool:
    """Small cases (rows off the 16-row blocks, more than one pass) against float32."""
    gen = torch.Generator().manual_seed(11)
    n, k = 48, 128
    q4 = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8).numpy()
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.1).to(torch.bfloat16).float()
    zero = (torch.randn(n, k // GROUP, generator=gen) * 0.05).to(torch.bfloat16).float()
    w = dequantized(q4, scale, zero).float()
    packed = pack_int4(q4, scale, zero)
    for m in (1, 17, 50):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        got = kernel.q4(x, *packed, n).float()
        if not torch.allclose(got, x.float() @ w.t(), atol=2e-2, rtol=1e-2):
            return False
        q8 = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8).numpy()
        d = (torch.rand(n, k // GROUP, generator=gen) * 0.01).half().float().numpy()
        w8 = (torch.from_numpy(q8).double().view(n, -1, GROUP)
              * torch.from_numpy(d).double()[..., None]).view(n, k)
        ref = x.double() @ w8.t()
        got8 = kernel.q8(x, *pack_int8(q8, d), n).double()
        if not torch.allclose(got8, ref, atol=1e-5, rtol=1e-5):
            return False
    return True


@functools.cache
def _load() -> AmxKernel | None:
    from sglang_admin.model.cpu_kernels_build import _FLAG_SETS, _compile

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("quantized AMX kernel: no C compiler; the dense copies serve")
        return None
    cflags, libs = _FLAG_SETS[0]  # -march=native with OpenMP
    try:
        path = _compile(cc, cflags, libs, source=SOURCE)
        kernel = AmxKernel(path) if path is not None else None
    except OSError as exc:
        logger.warning("quantized AMX kernel: could not load it: %s", exc)
        return None
    if kernel is None or not kernel.applies:
        logger.info("quantized AMX kernel: not built for this CPU or no tile state; "
                    "the dense copies serve")
        return None
    with torch.inference_mode():
        if not _agrees(kernel):
            logger.warning("quantized AMX kernel %s disagrees with torch; not used", kernel.path)
            return None
    return kernel


def amx_kernel() -> AmxKernel | None:
    """The kernel where this CPU has its instructions and it builds and checks; else None
    (asked when a weight is packed, not at each call)."""
    if not cpu_has_amx_kernel():
        return None
    return _load()
