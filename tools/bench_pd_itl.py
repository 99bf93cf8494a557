#!/usr/bin/env python
"""Why PD exists: inter-token latency (ITL) of running streams while long prompts arrive,
a prefill/decode pair vs one plain worker on the same total cores, side by side in one run.

Three workers are started: a plain one pinned (taskset) to CORES, and a PD pair splitting
the same cores: prefill on the first half, decode on the second (zmq KV transfer). After one
warm-up request each, every round drives the plain worker, then the pair, with the same
workload:

- ``--streams`` greedy streams of ``--stream-tokens`` tokens each start together;
- while they run, ``--long`` requests with prompts of ``--long-tokens`` tokens (one output
  token) arrive every ``--long-every`` seconds.

The pair is driven as the SMG router drives it: each request to both legs at once with the
same bootstrap room. Printed: p50/p99 of the gaps between consecutive tokens of the running
streams (their first token excluded), per worker, and the ratio pair/plain (goal p99 <= 0.5x),
and whether the streams' tokens were equal.

Usage: python tools/bench_pd_itl.py [--model-path smollm2] [--cores 0,1] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.client.testing import free_port, wait_serving  # noqa: E402
from sglang_admin.pb import common_pb2 as pb  # noqa: E402
from sglang_admin.pb import common_pb2_grpc as pb_grpc  # noqa: E402


def start(tmp: Path, cores: str, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "sglang_admin", "serve", "--port",
           str(port), "--grpc-http-sidecar-port", str(free_port()), *args]
    with open(tmp / f"worker-{port}.log", "w") as log:  # the child keeps its own copy
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, port


def request(ids: list[int], n: int, rid: str, room: int | None, bport: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=rid, stream=True, tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
    if room is not None:
        req.disaggregated_params.bootstrap_host = "127.0.0.1"
        req.disaggregated_params.bootstrap_port = bport
        req.disaggregated_params.bootstrap_room = room
    return req


async def one(stubs: list, ids: list[int], n: int, rid: str, room: int | None, bport: int,
              ) -> tuple[list[float], list[int]]:
    """Run one request (on every leg at once); the token arrival times and tokens of the last
    leg (decode, or the plain worker)."""
    async def leg(stub) -> tuple[list[float], list[int]]:
        times, tokens = [], []
        async for resp in stub.Generate(request(ids, n, rid, room, bport), timeout=600):
            if resp.HasField("chunk"):
                for t in resp.chunk.token_ids:
                    times.append(time.perf_counter())
                    tokens.append(t)
        return times, tokens

    results = await asyncio.gather(*(leg(s) for s in stubs))
    return results[-1]


async def workload(stubs: list, args: argparse.Namespace, bport: int, pd: bool,
                   rng: random.Random) -> tuple[list[float], list[list[int]]]:
    streams = [[rng.randrange(0, 200) for _ in range(16)] for _ in range(args.streams)]
    longs = [[rng.randrange(0, 200) for _ in range(args.long_tokens)] for _ in range(args.long)]

    def room() -> int | None:
        return rng.randrange(0, 2**31 - 1) if pd else None

    running = [asyncio.create_task(one(stubs, ids, args.stream_tokens, f"s{i}-{time.time()}",
                                       room(), bport)) for i, ids in enumerate(streams)]
    await asyncio.sleep(args.long_every)
    arrivals = []
    for i, ids in enumerate(longs):
        arrivals.append(asyncio.create_task(one(stubs, ids, 1, f"l{i}-{time.time()}", room(),
                                                bport)))
        await asyncio.sleep(args.long_every)
    done = await asyncio.gather(*running)
    await asyncio.gather(*arrivals)
    gaps = [b - a for times, _ in done for a, b in zip(times[1:], times[2:])]
    return gaps, [tokens for _, tokens in done]


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 1 else 0.0


async def main_async(args: argparse.Namespace) -> dict:
    import grpc

    cores = args.cores.split(",")
    half = len(cores) // 2 or 1
    tmp = Path(tempfile.mkdtemp(prefix="bench_pd_itl-"))
    bport = free_port()
    model = ["--model-path", args.model_path] if args.model_path else []
    common = [*model, "--disaggregation-transfer-backend", "zmq"]
    procs = []
    plain = start(tmp, args.cores, *model)
    prefill = start(tmp, ",".join(cores[:half]), *common, "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(bport))
    decode = start(tmp, ",".join(cores[half:]) or cores[0], *common,
                   "--disaggregation-mode", "decode")
    procs = [plain[0], prefill[0], decode[0]]
    try:
        for proc, port in (plain, prefill, decode):
            wait_serving(f"127.0.0.1:{port}", proc, 300)
        chans = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}")
                 for name, (_, port) in (("plain", plain), ("prefill", prefill),
                                         ("decode", decode))}
        stubs = {k: pb_grpc.SglangSchedulerStub(c) for k, c in chans.items()}
        # warm-up (kernels, first long prefill), not measured
        warm = [1 + i % 150 for i in range(args.long_tokens)]
        await one([stubs["plain"]], warm, 4, "warm-plain", None, bport)
        await one([stubs["prefill"], stubs["decode"]], warm, 4, "warm-pd", 7, bport)
        rows: dict[str, list[float]] = {"plain": [], "pd": []}
        equal = True
        for r in range(args.rounds):
            seed = 1000 + r
            g_plain, t_plain = await workload([stubs["plain"]], args, bport, False,
                                              random.Random(seed))
            g_pd, t_pd = await workload([stubs["prefill"], stubs["decode"]], args, bport, True,
                                        random.Random(seed))
            equal = equal and t_plain == t_pd
            rows["plain"] += g_plain
            rows["pd"] += g_pd
        for c in chans.values():
            await c.close()
        out = {k: {"itl_p50_ms": pct(v, 50), "itl_p99_ms": pct(v, 99), "gaps": len(v)}
               for k, v in rows.items()}
        out["p99_ratio_pd_over_plain"] = (out["pd"]["itl_p99_ms"] / out["plain"]["itl_p99_ms"]
                                          if out["plain"]["itl_p99_ms"] else 0.0)
        out["tokens_equal"] = equal
        out["config"] = {k: v for k, v in vars(args).items() if k != "json"}
        return out
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the embedded model")
    p.add_argument("--cores", default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=96)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--long-every", type=float, default=0.4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'':8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'gaps':>6}")
    for k in ("plain", "pd"):
        print(f"{k:8} {out[k]['itl_p50_ms']:11.2f} {out[k]['itl_p99_ms']:11.2f} {out[k]['gaps']:6d}")
    print(f"p99 ratio pd/plain: {out['p99_ratio_pd_over_plain']:.2f}x (goal <= 0.5x); "
          f"tokens equal: {out['tokens_equal']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
