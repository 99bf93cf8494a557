#!/usr/bin/env python
"""The in-process batched decode step of two source trees, side by side in one run.

Each round runs, in a subprocess per tree (alternating, so both see the same minutes of a
shared machine), the real runner and scheduler on the packaged SmolLM2-135M-Instruct Q4_1
GGUF kept quantized (bfloat16), ``--batch`` prompts of ``--context`` tokens, and times
``--steps`` decode steps (bench_decode.py's ``time_decode``). With one thread (the default)
each step is timed in the stepping thread's CPU time, which a busy neighbour does not
inflate the way it does the wall clock; with more, the wall clock. Prints each round's median
step per tree, then the median over rounds and the ratio (the second tree against the
first). The rank's memory settings (huge pages through glibc, OpenMP spinning) are set as a
served rank's are.

Usage: python tools/bench_decode_ab.py --trees BASE_DIR THIS_DIR [--rounds 3] [--steps 48]
       [--batch 32] [--context 80] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import statistics, sys, time, types
sys.path.insert(0, "tools")
import torch
import bench_decode
from sglang_admin.model.gguf import ensure_converted, packaged_model
from sglang_admin.model.runner import ModelRunner
batch, context, steps, threads = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(threads)
if threads == 1:
    bench_decode.time = types.SimpleNamespace(perf_counter=time.thread_time)
runner = ModelRunner(ensure_converted(packaged_model("smollm2")), device="cpu",
                     dtype="bfloat16", max_total_tokens=8192, max_running_requests=batch,
                     quantization="gguf")
times = bench_decode.time_decode(runner, batch, context, steps)
print("STEP_MS", statistics.median(times) * 1e3)
"""


def run_tree(tree: Path, args: argparse.Namespace) -> float:
    """The median decode step (ms) of one subprocess on ``tree``'s sources."""
    from sglang_admin.constants import RANK_OPENMP_DEFAULTS, rank_memory_environment

    env = rank_memory_environment(dict(os.environ)) | RANK_OPENMP_DEFAULTS | {
        "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(args.batch), str(args.context), str(args.steps),
         str(args.threads)], cwd=tree, env=env, capture_output=True, text=True, check=True,
        timeout=900).stdout
    return float(next(line.split()[1] for line in out.splitlines()
                      if line.startswith("STEP_MS")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trees", nargs=2, type=Path, required=True, metavar=("BASE", "THIS"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=80)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    clock = "thread CPU" if args.threads == 1 else "wall"
    got: dict[Path, list[float]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            got[tree].append(run_tree(tree, args))
        print(f"round {r + 1}: " + "; ".join(f"{t} {got[t][-1]:.2f} ms" for t in args.trees),
              flush=True)
    base, this = (statistics.median(got[t]) for t in args.trees)
    print(f"decode step of {args.batch} rows at context {args.context}+, {args.threads} "
          f"thread(s), {clock} clock, median of {args.rounds} rounds: {args.trees[0]} "
          f"{base:.2f} ms, {args.trees[1]} {this:.2f} ms, ratio {this / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
