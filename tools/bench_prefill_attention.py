#!/usr/bin/env python
"""bfloat16 prefill attention on CPU: the AVX512_BF16 kernel (``CpuKernels.extend_attend``)
against torch's ``scaled_dot_product_attention`` as the extend path calls it, side by side in
one run, at real model shapes (SmolLM2-135M: 9 query / 3 kv heads; Qwen2.5-0.5B: 14 / 2;
head_dim 64), one sequence of 1..2048 new tokens (no cached prefix) and a chunk after a
cached prefix; the two alternate per round, the median counts.

Usage: python tools/bench_prefill_attention.py [--threads 2] [--rounds 5] [--clock cpu]

``--clock cpu`` times the process's CPU seconds instead of the wall clock: with
``--threads 1`` a ratio that holds on a busy machine (another process's load does not count).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.model.cpu_kernels import load_cpu_kernels  # noqa: E402

SHAPES = (("SmolLM2-135M", 9, 3, 64), ("Qwen2.5-0.5B", 14, 2, 64))
CASES = ((0, 16), (0, 64), (0, 256), (0, 512), (0, 1024), (0, 2048), (1024, 256), (1536, 16))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
          scale: float) -> torch.Tensor:
    """The extend path's SDPA call (model/attention/paged.py): causal, or a mask over the
    gathered prefix."""
    n = q.shape[0]
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if prefix == 0:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        keys = torch.arange(prefix + n)[None, :]
        mask = (keys <= torch.arange(prefix, prefix + n)[:, None]).view(1, 1, n, prefix + n)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, -1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ns = p.parse_args(argv)
    clock = time.perf_counter if ns.clock == "wall" else time.process_time
    torch.set_num_threads(ns.threads)
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.extend_applies(64, torch.bfloat16):
        print("no bfloat16 prefill kernel in this build (needs AVX512_BF16): nothing to compare")
        return 1
    print(f"{ns.threads} torch threads, median of {ns.rounds} alternating rounds, ms "
          f"({ns.clock} clock)")
    print(f"{'shape':<14} {'prefix':>6} {'new':>5} {'sdpa':>9} {'kernel':>9} {'ratio':>7}"
          f" {'kernel GFLOP/s':>15}")
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    with torch.inference_mode():
        for name, heads, kv_heads, dim in SHAPES:
            for prefix, n in CASES:
                length = prefix + n
                q = torch.randn(n, heads, dim, generator=gen).to(bf)
                pool_k = torch.randn(length + 64, kv_heads, dim, generator=gen).to(bf)
                pool_v = torch.randn(length + 64, kv_heads, dim, generator=gen).to(bf)
                slots = torch.randperm(length + 64, generator=gen)[:length].contiguous()
                scale = dim ** -0.5
                k_rows, v_rows = pool_k[slots], pool_v[slots]  # SDPA's gathered keys

                def torch_op() -> torch.Tensor:
                    return _sdpa(q, k_rows, v_rows, prefix, scale)

                def kernel_op() -> torch.Tensor:
                    return kernels.extend_attend(q, pool_k, pool_v, slots, prefix, scale, None)

                repeat = min(500, max(1, int(2e8 / (heads * n * length * dim))))
                times: dict[str, list[float]] = {"sdpa": [], "kernel": []}
                for fn in (torch_op, kernel_op):
                    fn()
                for _ in range(ns.rounds):
                    for key, fn in (("sdpa", torch_op), ("kernel", kernel_op)):
                        t0 = clock()
                        for _ in range(repeat):
                            fn()
                        times[key].append((clock() - t0) / repeat)
                a, b = statistics.median(times["sdpa"]), statistics.median(times["kernel"])
                # causal: each query sees prefix + i + 1 keys; 4 flops per (query, key, dim)
                flops = 4 * heads * dim * sum(prefix + i + 1 for i in range(n))
                print(f"{name:<14} {prefix:>6} {n:>5} {a * 1e3:>9.3f} {b * 1e3:>9.3f}"
                      f" {a / b:>6.2f}x {flops / b / 1e9:>15.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
