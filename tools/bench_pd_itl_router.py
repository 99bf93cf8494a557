#!/usr/bin/env python
"""Why PD exists, through the real SMG router: decode inter-token latency (ITL) of running
streams while long prompts arrive, a prefill/decode pair in the router's PD mode vs one plain
worker behind the router in its plain mode, on the same total cores, side by side in one run.

Setups (both started at once, driven one at a time):

- plain: one worker pinned (taskset) to all of CORES (two by default), behind
  ``smg launch --worker-urls grpc://...``;
- pd: a prefill worker on the first half of CORES and a decode worker on the second half
  (zmq KV transfer by default), behind ``smg launch --pd-disaggregation``.

A worker sizes its threads from the cores it may run on (``config.rank_lanes`` /
``rank_threads``): with 2 cores the plain worker computes a step on 2 lanes of 1 thread, each
PD leg on 1 lane of 1 thread; the printout says what each worker computes with.

Each round runs the same workload on each setup (the order alternates round to round); the
client is a process of its own (this script's ``client`` subcommand), speaking HTTP to the
router: ``--streams`` greedy streams of ``--stream-tokens`` tokens each (``/generate``,
``stream: true``) start together; while they run, a long prompt of ``--long-tokens`` tokens
(one output token) arrives every ``--long-every`` seconds, ``--long`` of them (the same
number on both setups). ITL: the gaps between consecutive tokens of a stream as the client
receives them (the wait for the first token excluded). Printed: p50/p99 per setup per round, the best round of each (lowest p99), and the
ratio pd/plain of the best rounds (goal p99 <= 0.5x). Each round has prompts of its own (none
served from the prefix cache), the same on both setups: each stream's greedy tokens and each
long prompt's token must be equal across the setups.

Usage: python tools/bench_pd_itl_router.py [--model-path smollm2] [--cores 0,1] [--rounds 2]
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
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.client.testing import free_port, wait_serving  # noqa: E402

# --------------------------------------------------------------------------- the client


async def stream(session, base: str, model: str, ids: list[int], n: int
                 ) -> tuple[list[float], list[int]]:
    """One streamed greedy request: the arrival time of each token and the tokens."""
    body = {"model": model, "input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    times: list[float] = []
    tokens: list[int] = []
    async with session.post(f"{base}/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"stream: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream: {event}")
            now = time.perf_counter()
            for t in event.get("output_ids", []):
                times.append(now)
                tokens.append(t)
    # the router's last event repeats the last token (as with a plain worker)
    if len(tokens) < n:
        raise RuntimeError(f"stream: {len(tokens)} tokens of {n}")
    return times[:n], tokens[:n]


async def long_prompt(session, base: str, model: str, ids: list[int]) -> int:
    """One long prompt, one greedy output token (not streamed): the token."""
    body = {"model": model, "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
    async with session.post(f"{base}/generate", json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"long prompt: HTTP {resp.status}: {text[:500]}")
    out = json.loads(text)
    out = out[0] if isinstance(out, list) else out
    return out["output_ids"][0]


async def client_async(args: argparse.Namespace) -> dict:
    import aiohttp

    rng = random.Random(args.seed)
    vocab = args.vocab
    streams = [[rng.randrange(1, vocab) for _ in range(16)] for _ in range(args.streams)]
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        running = [asyncio.create_task(stream(session, args.url, args.model, ids,
                                              args.stream_tokens)) for ids in streams]
        arrivals = []
        for i in range(args.long):  # the same number on every setup, whatever its speed
            await asyncio.sleep(args.long_every)
            ids = [random.Random(f"{args.seed}-{i}").randrange(1, vocab)
                   for _ in range(args.long_tokens)]
            arrivals.append(asyncio.create_task(long_prompt(session, args.url, args.model,
                                                            ids)))
        done = await asyncio.gather(*running)
        wall = time.perf_counter() - t0
        longs = await asyncio.gather(*arrivals)
    # the first token's wait (queue + prefill) is not an inter-token gap: token 1 to 2 is
    gaps = [b - a for times, _ in done for a, b in zip(times[:-1], times[1:])]
    return {"gaps": gaps, "tokens": [tokens for _, tokens in done], "long_tokens": longs,
            "wall_s": wall}


# --------------------------------------------------------------------------- the setups


def start_worker(tmp: Path, cores: str, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "sglang_admin", "serve", "--port",
           str(port), "--grpc-http-sidecar-port", str(free_port()), *args]
    with open(tmp / f"worker-{port}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, port


def start_router(tmp: Path, name: str, *workers: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "smg.launch_router", *workers,
           "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--worker-startup-check-interval", "1", "--log-level", "warn",
           # A worker busy with long prefills on a loaded machine answers probes late and
           # its waiting queue grows: that is the workload measured, so neither setup's
           # router may stop routing to a worker for it (one worker per role: nowhere else).
           "--health-check-interval-secs", "10", "--health-check-timeout-secs", "120",
           "--health-failure-threshold", "1000", "--worker-stall-secs", "3600",
           "--worker-wedge-secs", "3600", "--disable-worker-overload-protection",
           "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0"]
    with open(tmp / f"router-{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "NO_COLOR": "1"})
    return proc, f"http://127.0.0.1:{port}"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def wait_router(proc: subprocess.Popen, base: str, healthy: int, timeout: float = 180) -> str:
    """Wait until the router sees HEALTHY healthy workers; the served model's name."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router {base} exited with {proc.returncode}")
        try:
            workers = get_json(f"{base}/workers").get("workers", [])
            if sum(bool(w.get("is_healthy")) for w in workers) >= healthy:
                return get_json(f"{base}/v1/models")["data"][0]["id"]
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"router {base}: fewer than {healthy} healthy workers")


def worker_threads(cores: str, extra: list[str]) -> str:
    """The lanes and threads per lane a worker pinned to CORES computes a CPU step with
    (``config.ServerArgs`` under the same affinity; ``--torch-threads``/``--cpu-lanes`` in the
    workers' extra flags override it)."""
    code = ("from sglang_admin.config import ServerArgs; a = ServerArgs(); "
            "print(a.cores_per_rank, a.rank_lanes, a.rank_threads)")
    out = subprocess.run(["taskset", "-c", cores, sys.executable, "-c", code], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    note = " (overridden by --worker-arg)" if {"--torch-threads", "--cpu-lanes"} & {
        a.split("=")[0] for a in extra} else ""
    return f"cores {cores}: {out[0]} core(s), {out[1]} lane(s) x {out[2]} thread(s){note}"


def run_client(base: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    cmd = [sys.executable, __file__, "client", "--url", base, "--model", model,
           "--seed", str(seed), "--streams", str(args.streams),
           "--stream-tokens", str(args.stream_tokens), "--long-tokens", str(args.long_tokens),
           "--long-every", str(args.long_every), "--long", str(args.long),
           "--vocab", str(args.vocab)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"client against {base} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 1 else 0.0


def bench(args: argparse.Namespace) -> dict:
    cores = args.cores.split(",")
    half = len(cores) // 2 or 1
    tmp = Path(tempfile.mkdtemp(prefix="bench_pd_itl_router-"))
    bport = free_port()
    model = ["--model-path", args.model_path] if args.model_path else []
    extra = args.worker_arg or []
    pd_args = [*model, *extra, "--disaggregation-transfer-backend", args.backend]
    procs: list[subprocess.Popen] = []
    try:
        plain = start_worker(tmp, args.cores, *model, *extra)
        prefill = start_worker(tmp, ",".join(cores[:half]), *pd_args,
                               "--disaggregation-mode", "prefill",
                               "--disaggregation-bootstrap-port", str(bport))
        decode = start_worker(tmp, ",".join(cores[half:]) or cores[0], *pd_args,
                              "--disaggregation-mode", "decode")
        procs += [plain[0], prefill[0], decode[0]]
        for proc, port in (plain, prefill, decode):
            try:
                wait_serving(f"127.0.0.1:{port}", proc, 600)
            except (RuntimeError, TimeoutError):
                raise RuntimeError(f"worker {port} did not start; logs in {tmp}") from None
        r_plain = start_router(tmp, "plain", "--worker-urls", f"grpc://127.0.0.1:{plain[1]}")
        r_pd = start_router(tmp, "pd", "--pd-disaggregation",
                            "--prefill", f"grpc://127.0.0.1:{prefill[1]}", str(bport),
                            "--decode", f"grpc://127.0.0.1:{decode[1]}")
        procs += [r_plain[0], r_pd[0]]
        names = {"plain": wait_router(*r_plain, 1), "pd": wait_router(*r_pd, 2)}
        bases = {"plain": r_plain[1], "pd": r_pd[1]}
        threads = {"plain": worker_threads(args.cores, extra),
                   "prefill": worker_threads(",".join(cores[:half]), extra),
                   "decode": worker_threads(",".join(cores[half:]) or cores[0], extra)}
        # warm-up, not measured: one short workload on each setup (kernels, a long prefill)
        warm = argparse.Namespace(**{**vars(args), "streams": 2, "stream_tokens": 4,
                                     "long": 1})
        for k in ("plain", "pd"):
            run_client(bases[k], names[k], warm, 1)
        rounds: dict[str, list[dict]] = {"plain": [], "pd": []}
        equal = True
        loads = []
        for r in range(args.rounds):
            # new prompts each round (a prompt seen before would come from the prefix cache
            # and cost no prefill), the same ones on both setups (outputs compared)
            ref: dict | None = None
            order = ("plain", "pd") if r % 2 == 0 else ("pd", "plain")
            for k in order:
                loads.append(os.getloadavg()[0])
                out = run_client(bases[k], names[k], args, args.seed + 7919 * r)
                got = {"tokens": out["tokens"], "long_tokens": out["long_tokens"]}
                if ref is None:
                    ref = got
                elif got["tokens"] != ref["tokens"] or (
                        got["long_tokens"][:len(ref["long_tokens"])]
                        != ref["long_tokens"][:len(got["long_tokens"])]):
                    equal = False
                    diff = [i for i, (a, b) in enumerate(zip(got["tokens"], ref["tokens"]))
                            if a != b]
                    print(f"round {r} {k}: outputs differ from the other setup's "
                          f"(streams {diff})", file=sys.stderr)
                row = {"p50_ms": pct(out["gaps"], 50), "p99_ms": pct(out["gaps"], 99),
                       "gaps": len(out["gaps"]), "longs": len(out["long_tokens"]),
                       "wall_s": out["wall_s"]}
                rounds[k].append(row)
                print(f"round {r} {k:5}: ITL p50 {row['p50_ms']:8.2f} ms  p99 "
                      f"{row['p99_ms']:8.2f} ms  ({row['gaps']} gaps, {row['longs']} long "
                      f"prompts, {row['wall_s']:.1f} s)", file=sys.stderr)
        best = {k: min(v, key=lambda row: row["p99_ms"]) for k, v in rounds.items()}
        return {
            "rounds": rounds, "best": best,
            "p99_ratio_pd_over_plain": (best["pd"]["p99_ms"] / best["plain"]["p99_ms"]
                                        if best["plain"]["p99_ms"] else 0.0),
            "p50_ratio_pd_over_plain": (best["pd"]["p50_ms"] / best["plain"]["p50_ms"]
                                        if best["plain"]["p50_ms"] else 0.0),
            "outputs_equal": equal, "threads": threads,
            "loadavg_1m": [round(x, 1) for x in loads],
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "cmd")},
            "logs": str(tmp),
        }
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--long-every", type=float, default=2.0,
                   help="seconds between long prompts while the streams run")
    p.add_argument("--long", type=int, default=4, help="long prompts per workload")
    p.add_argument("--vocab", type=int, default=250,
                   help="prompt token ids in 1..this-1 (the embedded model has 256 + specials)")
    p.add_argument("--seed", type=int, default=1000)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("client", help="(internal) one workload against one router")
    c.add_argument("--url", required=True)
    c.add_argument("--model", required=True)
    add_workload_flags(c)
    add_workload_flags(p)
    p.add_argument("--model-path", default=None, help="default: the embedded model")
    p.add_argument("--worker-arg", action="append",
                   help="one more flag for every worker (repeatable), e.g. --worker-arg=--dtype "
                        "--worker-arg=float32")
    p.add_argument("--backend", default="zmq", help="--disaggregation-transfer-backend")
    p.add_argument("--cores", default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.cmd == "client":
        out = asyncio.run(client_async(args))
        print(json.dumps(out))
        return 0
    out = bench(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if out["outputs_equal"] else 1
    print(f"threads: {out['threads']}")
    print(f"{'best of ' + str(args.rounds):12} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'gaps':>6}")
    for k in ("plain", "pd"):
        b = out["best"][k]
        print(f"{k:12} {b['p50_ms']:11.2f} {b['p99_ms']:11.2f} {b['gaps']:6d}")
    print(f"p99 ratio pd/plain: {out['p99_ratio_pd_over_plain']:.2f}x (goal <= 0.5x); "
          f"p50 ratio {out['p50_ratio_pd_over_plain']:.2f}x; outputs equal: "
          f"{out['outputs_equal']}; load average (1 min) per run: {out['loadavg_1m']}")
    return 0 if out["outputs_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
