"""Builds model/csrc/cpu_kernels.c with the machine's compiler at first use (cached under the
sglang_admin cache directory, keyed by source, flags and CPU), checks each kernel against
torch on small cases (the reference implementations here), and loads it. No compiler, or a
kernel that disagrees with torch: :func:`load_cpu_kernels` returns None and the model keeps
torch's ops."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_admin.model.cpu_kernels import CpuKernels

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
# tried in order: the machine's vector units first (AVX2 + glibc's vector expf), then plain C;
# no fused multiply-adds but the written ones, so that a*b + c*d rounds as torch's ops do
# OpenMP (bfloat16 decode attention's tasks) binds at load to the libgomp torch has loaded
_FLAG_SETS = (
    (["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"],
     ["-lmvec", "-lm"]),
    (["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off"], ["-lmvec", "-lm"]),
    (["-O3", "-fno-math-errno", "-ffp-contract=off"], ["-lm"]),
)


def reference_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, prefix: int, scale: float,
                     window: int | None) -> torch.Tensor:
    """What :meth:`CpuKernels.extend_attend` computes, through torch: the keys and values of
    positions [0, prefix + n) gathered from the pools, causal (and windowed) attention."""
    n, heads, dim = q.shape
    keys = torch.arange(prefix + n)[None, :]
    pos = torch.arange(prefix, prefix + n)[:, None]
    mask = keys <= pos
    if window is not None:
        mask &= keys > pos - window
    k, v = k_cache[slots], v_cache[slots]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, heads * dim)


def reference_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, scale: float,
                     window: int | None) -> torch.Tensor:
    """What :meth:`CpuKernels.attend` computes, with torch, one sequence at a time."""
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


def _compile(cc: str, cflags: list[str], libs: list[str], source: Path = SOURCE
             ) -> str | None:
    """The kernel (``source``) built with these flags (cached); None when the compiler
    refuses."""
    key = hashlib.sha256(b"\0".join(
        [source.read_bytes(), " ".join(cflags + libs).encode(), platform.machine().encode(),
         _cpu_signature().encode(), cc.encode()])).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    from sglang_admin.model.gguf import cache_lock

    # processes that start at once (a worker's ranks, a test run's) take turns: one compiles,
    # the others load what it built instead of compiling the same file beside it
    with cache_lock(str(target.parent / f".{target.name}.lock")):
        if target.exists():
            return str(target)
        return _compile_into(cc, cflags, libs, source, target)


def _compile_into(cc: str, cflags: list[str], libs: list[str], source: Path, target: Path
                  ) -> str | None:
    """:func:`_compile`'s build, the library renamed into ``target`` once whole."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *cflags, "-shared", "-fPIC", str(source), "-o", tmp, *libs]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(tmp)
        logger.info("cpu kernels: %s failed: %s", cc, exc)
        return None
    if done.returncode != 0:
        os.unlink(tmp)
        logger.info("cpu kernels: %s %s failed: %s", cc, " ".join(cflags),
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


def _agrees_with_torch(kernel: CpuKernels) -> bool:
    """Small cases against torch: attention with GQA, a sliding window and scattered slots;
    RMSNorm, silu(gate) * up, the projection and argmax with widths off the vector width."""
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
    x = torch.randn(5, 21, generator=gen)
    w = torch.randn(21, generator=gen)
    if not torch.allclose(kernel.rms_norm(x, w, 1e-6), F.rms_norm(x, (21,), w, 1e-6),
                          atol=1e-5, rtol=1e-4):
        return False
    gate_up = torch.randn(3, 2 * 19, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    if not torch.allclose(kernel.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-4):
        return False
    qkv = torch.randn(4, 5, 8, generator=gen)
    cos, sin = torch.randn(4, 1, 8, generator=gen), torch.randn(4, 1, 8, generator=gen)
    x = qkv[:, :3]
    want = x * cos + x.roll(4, dims=-1) * sin
    if not torch.allclose(kernel.rope(x, cos, sin), want, atol=1e-6, rtol=1e-5):
        return False
    logits = torch.randn(3, 37, generator=gen)
    logits[1, 30] = logits[1, 5] = 9.0  # a tie: the first wins
    if kernel.argmax(logits) != logits.argmax(dim=-1).tolist():
        return False
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((5, 21), (7, 21), (7,)))
    if not torch.allclose(kernel.linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-4):
        return False
    q = torch.randn(19, 6, 32, generator=gen)  # 6 query heads, 2 kv heads: G = 3
    pool = torch.randn(2, 40, 2, 32, generator=gen)
    slots = torch.randperm(40, generator=gen)[:26]  # a 7-token prefix and the 19 new tokens
    if not kernel.extend_applies(32):
        return True  # a build without the prefill kernel: torch's attention
    for window in (None, 5):
        got = kernel.extend_attend(q, pool[0], pool[1], slots, 7, 0.17, window)
        if not torch.allclose(got, reference_extend(q, pool[0], pool[1], slots, 7, 0.17, window),
                              atol=1e-5, rtol=1e-4):
            return False
    return True


def _bf16_agrees_with_torch(kernel: CpuKernels) -> bool:
    """The bfloat16 kernels against torch's bfloat16 ops on small cases (within bfloat16's
    rounding: the kernels sum in another order): decode and prefill attention with GQA and a
    window, RMSNorm with the residual add, RoPE with the K/V write, silu(gate) * up, argmax."""
    gen = torch.Generator().manual_seed(1)
    bf = torch.bfloat16

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return got.dtype == bf and torch.allclose(got.float(), want.float(), atol=1e-2,
                                                  rtol=1.6e-2)

    heads, kv_heads, dim, slots = 6, 2, 32, 64
    k = torch.randn(slots, kv_heads, dim, generator=gen).to(bf)
    v = torch.randn(slots, kv_heads, dim, generator=gen).to(bf)
    table = torch.randperm(slots, generator=gen).view(2, 32).clone()
    rows, lens = torch.tensor([1, 0, 1]), torch.tensor([32, 9, 1])
    q = torch.randn(3, heads, dim, generator=gen).to(bf)
    for window in (None, 5):
        got = kernel.attend(q, k, v, table, rows, lens, 0.17, window, torch.empty(heads * 32))
        want = reference_attend(q.float(), k.float(), v.float(), table, rows, lens, 0.17, window)
        if not close(got, want):
            return False
    x = torch.randn(5, 21, generator=gen).to(bf)
    delta = torch.randn(5, 21, generator=gen).to(bf)
    w = torch.randn(21, generator=gen).to(bf)

    def norm(h: torch.Tensor) -> torch.Tensor:
        f = h.float()
        return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf)

    if not close(kernel.rms_norm(x, w, 1e-6), norm(x)):
        return False
    summed = x + delta
    if not (close(kernel.add_rms_norm(x, delta, w, 1e-6), norm(summed))
            and torch.equal(x, summed)):
        return False
    gate_up = (torch.randn(3, 2 * 19, generator=gen) * 4).to(bf)
    gate, up = gate_up.chunk(2, dim=-1)
    if not close(kernel.silu_mul(gate_up), F.silu(gate) * up):
        return False
    qkv = torch.randn(4, 7, 16, generator=gen).to(bf)  # 3 q heads, 2 k, 2 v
    cos, sin = (torch.randn(4, 1, 16, generator=gen).to(bf) for _ in range(2))
    pool_k, pool_v = torch.zeros(9, 2, 16, dtype=bf), torch.zeros(9, 2, 16, dtype=bf)
    out_slots = torch.tensor([8, 2, 5, 1])
    want = qkv[:, :5] * cos + qkv[:, :5].roll(8, dims=-1) * sin
    got = kernel.rope_store(qkv, cos, sin, 3, pool_k, pool_v, out_slots)
    if not (close(got, want) and torch.equal(pool_k[out_slots], got[:, 3:])
            and torch.equal(pool_v[out_slots], qkv[:, 5:])):
        return False
    logits = torch.randn(3, 37, generator=gen).to(bf)
    logits[1, 30] = logits[1, 5] = 9.0
    if kernel.argmax(logits) != logits.argmax(dim=-1).tolist():
        return False
    if not kernel._extend_bf16_applies(32):
        return True  # a build without the bfloat16 prefill kernel: torch's attention
    q = torch.randn(19, 6, 32, generator=gen).to(bf)  # G = 3, a 7-token prefix, 19 new
    pool = torch.randn(2, 40, 2, 32, generator=gen).to(bf)
    slots = torch.randperm(40, generator=gen)[:26]
    for window in (None, 5):
        got = kernel.extend_attend(q, pool[0], pool[1], slots, 7, 0.17, window)
        if not close(got, reference_extend(q, pool[0], pool[1], slots, 7, 0.17, window)):
            return False
    return True


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The kernels, built once per machine and loaded once per process; None when they cannot
    be built or disagree with torch (the reason is logged)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("cpu kernels: no C compiler found; the model keeps torch's ops")
        return None
    try:
        path = _build(cc)
        kernel = CpuKernels(path) if path is not None else None
    except OSError as exc:
        logger.warning("cpu kernels: could not load it: %s", exc)
        return None
    if kernel is None:
        logger.info("cpu kernels: not built; the model keeps torch's ops")
        return None
    with torch.inference_mode():
        if not _agrees_with_torch(kernel):
            logger.warning("cpu kernels %s disagree with torch; not used", kernel.path)
            return None
        kernel.bf16 = _bf16_agrees_with_torch(kernel)
        if not kernel.bf16:
            logger.warning("cpu kernels %s: the bfloat16 ones disagree with torch; bfloat16 "
                           "keeps torch's ops", kernel.path)
    return kernel
