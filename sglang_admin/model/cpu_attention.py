"""Decode attention read in place from the paged KV pool, on the CPU.

Torch's decode path gathers every sequence's K and V rows into padded tensors and runs
``scaled_dot_product_attention`` per group of similar length: on a CPU step that copy and the
kernel's per-call cost were a third of a decode step at 64 streams. ``csrc/decode_attention.c``
reads the rows where they are, through the request-to-token table; this module builds it with
the machine's C compiler at first use (cached under the sglang_admin cache directory, keyed by
source, flags and CPU), checks it against torch on a small case, and calls it through ctypes
(which releases the GIL, so lanes run it at once). No compiler, or a kernel that disagrees
with torch: :func:`load_decode_kernel` returns None and the runner keeps torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
# tried in order: the machine's vector units first (AVX2 + glibc's vector expf), then plain C
_FLAG_SETS = (
    (["-O3", "-march=native", "-fno-math-errno"], ["-lmvec", "-lm"]),
    (["-O3", "-fno-math-errno"], ["-lm"]),
)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class DecodeKernel:
    """The built kernel: ``attend`` computes one layer's decode attention of n sequences."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fn = ctypes.CDLL(path).decode_attention
        self._fn.restype = None
        self._fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                             _I64, ctypes.c_float, _I64, _PTR, _PTR]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, scale: float,
               window: int | None, scores: torch.Tensor) -> torch.Tensor:
        """q [n, H, D] (heads contiguous), pools [slots, KV, D], table [R, ctx] int64 slots,
        rows/lens [n] int64 (each sequence's table row and length, its new token included),
        scores a float32 scratch of at least H * max(lens) -> [n, H * D].

        The caller guarantees what C cannot check: float32 CPU tensors, rows and slots in
        range, lens within the table's width (the runner validates every sequence first).
        """
        n, heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        if not (q.stride(2) == 1 and q.stride(1) == dim and k_cache.is_contiguous()
                and v_cache.is_contiguous() and table.is_contiguous()
                and rows.is_contiguous() and lens.is_contiguous()):
            raise ValueError("decode kernel: a tensor is not laid out as expected")
        out = torch.empty(n, heads * dim, dtype=torch.float32)
        if n:
            self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                     table.data_ptr(), table.shape[1], rows.data_ptr(), lens.data_ptr(), n,
                     heads, kv_heads, dim, scale, window or 0, scores.data_ptr(),
                     out.data_ptr())
        return out


@dataclass
class DecodeBatch:
    """One forward's decode sequences for the kernel, shared by every layer."""

    kernel: DecodeKernel
    table: torch.Tensor  # [R, ctx] the runner's req_to_token
    rows: torch.Tensor  # [n] int64 table row of each decode sequence
    lens: torch.Tensor  # [n] int64 its length, the new token included
    scores: torch.Tensor  # float32 scratch, heads * max(lens) at least

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, window: int | None) -> torch.Tensor:
        """One layer: q [n, H, D] against its pool -> [n, H * D]."""
        return self.kernel.attend(q, k_cache, v_cache, self.table, self.rows, self.lens,
                                  scale, window, self.scores)


def reference_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, scale: float,
                     window: int | None) -> torch.Tensor:
    """What :meth:`DecodeKernel.attend` computes, with torch, one sequence at a time."""
    outs = []
    for i in range(q.shape[0]):
        length = int(lens[i])
        start = max(0, length - window) if window else 0
        slots = table[int(rows[i]), start:length]
        k = k_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, KV, L, D]
        v = v_cache[slots].transpose(0, 1).unsqueeze(0)
        qi = q[i].unsqueeze(0).unsqueeze(2)  # [1, H, 1, D]
        o = F.scaled_dot_product_attention(qi, k, v, scale=scale, enable_gqa=True)
        outs.append(o.reshape(1, -1))
    return torch.cat(outs)


def _cache_dir() -> Path:
    from sglang_admin.model.default_model import default_cache_dir

    return Path(default_cache_dir()) / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: a build is reused only on the same kind of CPU."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compile(cc: str, cflags: list[str], libs: list[str]) -> str | None:
    """The kernel built with these flags (cached); None when the compiler refuses."""
    key = hashlib.sha256(b"\0".join(
        [SOURCE.read_bytes(), " ".join(cflags + libs).encode(), platform.machine().encode(),
         _cpu_signature().encode(), cc.encode()])).hexdigest()[:16]
    target = _cache_dir() / f"decode_attention-{key}.so"
    if target.exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *cflags, "-shared", "-fPIC", str(SOURCE), "-o", tmp, *libs]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(tmp)
        logger.info("decode kernel: %s failed: %s", cc, exc)
        return None
    if done.returncode != 0:
        os.unlink(tmp)
        logger.info("decode kernel: %s %s failed: %s", cc, " ".join(cflags),
                    done.stderr.strip()[-500:])
        return None
    os.replace(tmp, target)  # atomic: ranks building at once each land a whole file
    return str(target)


def _build(cc: str) -> str | None:
    for cflags, libs in _FLAG_SETS:
        path = _compile(cc, cflags, libs)
        if path is not None:
            return path
    return None


def _agrees_with_torch(kernel: DecodeKernel) -> bool:
    """A small case with GQA, a sliding window and scattered slots, against torch."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots = 8, 2, 32, 64
    k = torch.randn(slots, kv_heads, dim, generator=gen)
    v = torch.randn(slots, kv_heads, dim, generator=gen)
    table = torch.randperm(slots, generator=gen).view(2, 32).clone()
    rows = torch.tensor([1, 0, 1])
    lens = torch.tensor([32, 9, 1])
    q = torch.randn(3, heads, dim, generator=gen)
    scores = torch.empty(heads * 32)
    for window in (None, 5):
        got = kernel.attend(q, k, v, table, rows, lens, 0.17, window, scores)
        want = reference_attend(q, k, v, table, rows, lens, 0.17, window)
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
            return False
    return True


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """The decode kernel, built once per machine and process; None when it cannot be built or
    disagrees with torch (the reason is logged)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("decode kernel: no C compiler found; decode attention stays on torch")
        return None
    try:
        path = _build(cc)
        kernel = DecodeKernel(path) if path is not None else None
    except OSError as exc:
        logger.warning("decode kernel: could not load it: %s", exc)
        return None
    if kernel is None:
        logger.info("decode kernel: not built; decode attention stays on torch")
        return None
    with torch.inference_mode():
        if not _agrees_with_torch(kernel):
            logger.warning("decode kernel %s disagrees with torch; not used", kernel.path)
            return None
    return kernel
