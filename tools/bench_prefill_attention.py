#!/usr/bin/env python
"""bfloat16 prefill attention on CPU: the flash kernel (``CpuKernels.extend_attend``; on AMX
tiles where the CPU has them, else AVX512_BF16) against torch's ``scaled_dot_product_attention`` as the extend path calls it, side by side in
one run, at real model shapes (SmolLM2-135M: 9 query / 3 kv heads; Qwen2.5-0.5B: 14 / 2;
head_dim 64), one sequence of 1..2048 new tokens (no cached prefix) and a chunk after a
cached prefix; the two alternate per round, the median counts.

With ``--model-path DIR`` it times instead one whole prefill step of the model runner
(``--tokens`` new tokens, one sequence, bfloat16) with the kernel and with SDPA for the
bfloat16 extend sequences, alternating in one process (the rule flipped per step).

Usage: python tools/bench_prefill_attention.py [--threads 2] [--rounds 5] [--clock cpu]
       python tools/bench_prefill_attention.py --model-path DIR [--tokens 1500] [--rounds 3]

``--clock cpu`` times the process's CPU seconds instead of the wall clock: with
``--threads 1`` a ratio that holds on a busy machine (another process's load does not count).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.model.cpu_kernels_build import load_cpu_kernels  # noqa: E402

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


def _prefill_step(path: str, tokens: int, rounds: int, clock) -> int:  # noqa: ANN001
    """One prefill step of ``tokens`` through the model runner in bfloat16, the extend
    attention through the kernel and through SDPA alternately."""
    from sglang_admin.messages import GenerateReq, SamplingParams
    from sglang_admin.model import batch as batch_module
    from sglang_admin.model.runner import ModelRunner
    from sglang_admin.scheduler.rank.model_step import batch_inputs
    from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig

    runner = ModelRunner(path, device="cpu", dtype="bfloat16", max_running_requests=8,
                         max_total_tokens=tokens + 64, lanes=1)
    info = runner.info
    rule = batch_module.extend_kernel_takes

    def sdpa_rule(dtype: torch.dtype, prefix: int, n: int, **kw: bool) -> bool:
        return dtype != torch.bfloat16 and rule(dtype, prefix, n, **kw)

    def step(kernel: bool, seed: int) -> float:
        batch_module.extend_kernel_takes = rule if kernel else sdpa_rule
        sched = Scheduler(SchedulerConfig(
            token_capacity=runner.token_capacity, max_running_requests=8,
            max_prefill_tokens=tokens + 64, context_length=info.context_length,
            eos_token_ids=tuple(info.eos_token_ids)))
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(2, info.vocab_size, (tokens,), generator=gen).tolist()
        sched.add_request(GenerateReq(f"p{seed}", prompt, SamplingParams(
            max_new_tokens=1, ignore_eos=True, temperature=0.0)))
        batch = sched.schedule()
        seqs = batch_inputs(batch)
        t0 = clock()
        runner.forward_step(seqs)
        seconds = clock() - t0
        runner.reset()
        return seconds

    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        with torch.inference_mode():
            step(True, 0)
            step(False, 0)
            for r in range(rounds):
                for kernel in (False, True):
                    times[kernel].append(step(kernel, r + 1))
    finally:
        batch_module.extend_kernel_takes = rule
    a, b = statistics.median(times[False]), statistics.median(times[True])
    print(f"bfloat16 prefill step of {tokens} tokens, {torch.get_num_threads()} threads, "
          f"median of {rounds}: SDPA {a * 1e3:.0f} ms, kernel {b * 1e3:.0f} ms: "
          f"{a / b:.3f}x, {(1 - b / a) * 100:.1f}% less time")
    print("  SDPA", [round(t * 1e3) for t in times[False]],
          "kernel", [round(t * 1e3) for t in times[True]])
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--model-path", help="a checkpoint: time its whole prefill step instead")
    p.add_argument("--tokens", type=int, default=1500, help="the prefill's new tokens")
    ns = p.parse_args(argv)
    clock = time.perf_counter if ns.clock == "wall" else time.process_time
    torch.set_num_threads(ns.threads)
    if ns.model_path:
        return _prefill_step(ns.model_path, ns.tokens, ns.rounds, clock)
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

                torch_op = functools.partial(_sdpa, q, k_rows, v_rows, prefix, scale)
                kernel_op = functools.partial(kernels.extend_attend, q, pool_k, pool_v, slots,
                                              prefix, scale, None)

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
