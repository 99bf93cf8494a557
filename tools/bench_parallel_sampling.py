#!/usr/bin/env python
"""TTFT of parallel sampling (n > 1) against n = 1, side by side, on a served worker.

A client process (this one) flushes the worker's cache, then sends streaming Generate
calls with a fresh random prompt each (nothing cached), alternating n = 1 and n = ``--n`` so that both see the same machine
load, one call at a time, and prints the median time to the first token of the first
sample and of the last sample (every sample has a token), with their ratios to n = 1.
Parallel sampling prefills the prompt once and forks it: the ratio stays near 1 where an
n-fold prefill would cost about n.

Example (a worker on the default model at 127.0.0.1:30000)::

    python tools/bench_parallel_sampling.py --target 127.0.0.1:30000 --input-len 1024 --n 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc


@dataclass
class Timing:
    """One call: seconds to the first token of any sample and of every sample."""

    first: float
    all_samples: float


def one_call(stub: pb_grpc.SglangSchedulerStub, prompt: list[int], n: int, output_len: int,
             temperature: float) -> Timing:
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=prompt), stream=True,
        sampling_params=pb.SamplingParams(n=n, max_new_tokens=output_len, ignore_eos=True,
                                          temperature=temperature))
    start = time.perf_counter()
    first: float | None = None
    seen: set[int] = set()
    every: float | None = None
    completes = 0
    for resp in stub.Generate(req, timeout=600):
        now = time.perf_counter() - start
        got = resp.chunk if resp.HasField("chunk") else resp.complete
        tokens = resp.chunk.token_ids if resp.HasField("chunk") else resp.complete.output_ids
        if resp.HasField("complete"):
            completes += 1
            if resp.complete.finish_reason == "abort":
                raise RuntimeError("a sample was aborted")
        if tokens:
            first = now if first is None else first
            seen.add(got.index)
            if every is None and len(seen) == n:
                every = now
    if completes != n or first is None or every is None:
        raise RuntimeError(f"expected {n} samples with tokens, got {completes} completes")
    return Timing(first, every)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, metavar="HOST:PORT")
    p.add_argument("--n", type=int, default=8, help="samples of the parallel case")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10, help="calls per case (alternating)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    args = p.parse_args(argv)
    if args.n < 2 or args.input_len < 1 or args.rounds < 1 or args.output_len < 1:
        p.error("--n must be >= 2; --input-len, --output-len and --rounds >= 1")
    rng = random.Random(args.seed)
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        vocab = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size
        low = min(32, vocab - 1)

        def prompt() -> list[int]:
            return [rng.randrange(low, vocab) for _ in range(args.input_len)]

        # nothing of an earlier run may be cached: every prompt below is new to the worker
        flushed = stub.FlushCache(pb.FlushCacheRequest(timeout_s=60), timeout=120)
        if not flushed.success:
            print(f"FlushCache failed: {flushed.message}", file=sys.stderr)
            return 1
        one_call(stub, prompt(), args.n, args.output_len, args.temperature)  # warm-up
        one_call(stub, prompt(), 1, args.output_len, args.temperature)
        times: dict[int, list[Timing]] = {1: [], args.n: []}
        for _ in range(args.rounds):
            for n in (1, args.n):
                times[n].append(one_call(stub, prompt(), n, args.output_len, args.temperature))
    med = {n: (statistics.median(t.first for t in ts), statistics.median(t.all_samples for t in ts))
           for n, ts in times.items()}
    base = med[1][0]
    print(f"prompt {args.input_len} tokens, {args.rounds} calls per case, alternating, "
          f"output {args.output_len} tokens, temperature {args.temperature}")
    print(f"{'case':<8}{'TTFT first (ms)':>18}{'TTFT all n (ms)':>18}{'ratio (all n)':>16}")
    for n, (first, every) in med.items():
        print(f"{'n=' + str(n):<8}{first * 1e3:>18.1f}{every * 1e3:>18.1f}{every / base:>16.2f}")
    if args.json:
        print(json.dumps({"input_len": args.input_len, "n": args.n, "rounds": args.rounds,
                          "ttft_first_s": {str(k): v[0] for k, v in med.items()},
                          "ttft_all_s": {str(k): v[1] for k, v in med.items()},
                          "ratio_all": med[args.n][1] / base}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
