#!/usr/bin/env python
"""The CPU kernels (model/cpu_kernels.py) against torch's ops, side by side in one run.

1. A decode step of one rank (scheduler + model runner in-process, one torch thread, the
   embedded model, float32) with ``--attention-backend auto`` (the kernels) and
   ``torch_native`` (torch's ops), at 8, 32 and 64 running requests of the mixed workload's
   prompts, after 40 decoded tokens; the two runners alternate, the median step counts.
2. The elementwise kernels against the torch ops they replace, at a decode batch (32 rows)
   and a prefill lane (2048 rows): RMSNorm, RoPE over 10 q/k heads, silu(gate) * up.
3. The projections of one decoder layer (q/k/v, o, gate/up, down of the embedded model)
   through ``CpuKernels.linear`` against ``F.linear``, at decode batch sizes.

Usage: python tools/bench_cpu_kernels.py [--steps N] [--rounds N] [--warm-tokens N]
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

from sglang_admin.messages import GenerateReq, SamplingParams  # noqa: E402
from sglang_admin.model.cpu_kernels import CpuKernels  # noqa: E402
from sglang_admin.model.cpu_kernels_build import load_cpu_kernels  # noqa: E402
from sglang_admin.model.rotary import apply_rope  # noqa: E402
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.scheduler.rank.model_step import batch_inputs  # noqa: E402
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from tools.workloads import mixed_workload  # noqa: E402


class DecodeLoop:
    """One runner and its scheduler, decoding ``batch`` requests (step() times one step)."""

    def __init__(self, backend: str, batch: int, warm_tokens: int = 40) -> None:
        self.runner = ModelRunner(None, device="cpu", dtype="float32", max_running_requests=64,
                                  attention_backend=backend)
        info = self.runner.info
        self.sched = Scheduler(SchedulerConfig(
            token_capacity=self.runner.token_capacity, max_running_requests=64,
            max_prefill_tokens=4096, context_length=info.context_length,
            eos_token_ids=tuple(info.eos_token_ids)))
        work = mixed_workload(info.vocab_size)
        for i, prompt in enumerate(work.prompts[:batch]):
            self.sched.add_request(GenerateReq(
                f"r{i}", prompt, SamplingParams(max_new_tokens=100_000, ignore_eos=True)))
        for _ in range(warm_tokens + 8):  # prefill, then decode a while
            self.step()

    def step(self) -> float:
        batch = self.sched.schedule()
        seqs = batch_inputs(batch)
        t0 = time.perf_counter()
        results = self.runner.forward_step(seqs)
        seconds = time.perf_counter() - t0
        self.sched.postprocess(batch, results)
        self.sched.take_outputs()
        return seconds


def _time(fn, repeat: int) -> float:  # noqa: ANN001 - a thunk
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def _elementwise(kernels: CpuKernels, rows: int, gen: torch.Generator) -> None:
    """One row count: each elementwise kernel against the torch ops it replaces."""
    x = torch.randn(rows, 256, generator=gen)
    w = torch.randn(256, generator=gen)
    qkv = torch.randn(rows, 12, 32, generator=gen)
    cos, sin = (torch.randn(rows, 1, 32, generator=gen) for _ in range(2))
    gate_up = torch.randn(rows, 2 * 688, generator=gen)
    repeat = 200 if rows < 1000 else 20
    pairs = {
        "rms_norm [T, 256]": (lambda: F.rms_norm(x, (256,), w, 1e-6),
                              lambda: kernels.rms_norm(x, w, 1e-6)),
        "rope [T, 10, 32]": (lambda: apply_rope(qkv[:, :10], cos, sin),
                             lambda: kernels.rope(qkv[:, :10], cos, sin)),
        "silu*up [T, 2x688]": (lambda: F.silu(gate_up[:, :688]) * gate_up[:, 688:],
                               lambda: kernels.silu_mul(gate_up)),
    }
    for name, (torch_op, kernel_op) in pairs.items():
        a, b = _time(torch_op, repeat) * 1e6, _time(kernel_op, repeat) * 1e6
        print(f"  T={rows:<5} {name:<20} {a:9.1f} / {b:8.1f}  {a / b:5.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per backend")
    p.add_argument("--warm-tokens", type=int, default=40,
                   help="tokens decoded by every request before the timed steps")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    kernels = load_cpu_kernels()
    if kernels is None:
        print("the CPU kernels did not build here (no C compiler?): nothing to compare")
        return 1
    print(f"kernels: {kernels.path}; one torch thread; median of {ns.rounds} x {ns.steps} steps")
    print("\ndecode step (model runner forward + sampling), ms")
    print(f"{'running':>8} {'torch_native':>13} {'kernels':>9} {'ratio':>7}")
    with torch.inference_mode():
        for batch in (8, 32, 64):
            loops = {b: DecodeLoop(b, batch, ns.warm_tokens) for b in ("torch_native", "auto")}
            times: dict[str, list[float]] = {b: [] for b in loops}
            for _ in range(ns.rounds):
                for backend, loop in loops.items():
                    times[backend] += [loop.step() for _ in range(ns.steps)]
            slow = statistics.median(times["torch_native"]) * 1e3
            fast = statistics.median(times["auto"]) * 1e3
            print(f"{batch:>8} {slow:>13.2f} {fast:>9.2f} {slow / fast:>6.2f}x")

        print("\nelementwise ops, us (torch / kernel)")
        gen = torch.Generator().manual_seed(0)
        for rows in (32, 2048):
            _elementwise(kernels, rows, gen)

        print("\nprojections of one layer (q/k/v, o, gate/up, down), us (torch / kernel)")
        weights = [torch.randn(n, k, generator=gen)
                   for n, k in ((384, 256), (256, 256), (1376, 256), (256, 688))]
        for rows in (1, 8, 32, 64):
            xs = [torch.randn(rows, w.shape[1], generator=gen) for w in weights]
            pairs = list(zip(xs, weights))
            a = _time(lambda p=pairs: [F.linear(x, w) for x, w in p], 100) * 1e6
            b = _time(lambda p=pairs: [kernels.linear(x, w) for x, w in p], 100) * 1e6
            print(f"  rows={rows:<4} {a:9.1f} / {b:8.1f}  {a / b:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
