"""A/B the idle admin round trip, or a new request's first token under load, of several code
trees side by side.

    python tools/ab_admin.py TREE [TREE ...] [--calls 1500] [--dp-size 4]
    python tools/ab_admin.py TREE [TREE ...] --ttft [--rounds 6] [--probes 20]

Each TREE is a checkout of this project (e.g. a `git worktree add /tmp/old COMMIT`); one
dp 1 worker per tree is started from it (its own code, this venv). Default: GetServerInfo
and FlushCache(timeout_s=0) calls to every worker are shuffled together, so every tree sees
the same machine, and the p50 of each (tree, op) is printed (``--dp-size``: workers of that
many ranks instead of one). With ``--ttft``: in rounds (the
trees in a new order each round), one tree at a time gets 64 streams decoding (the clients
of tools/bench_admin.py) and, meanwhile, new streaming requests one after another whose
first-token latency is taken; the p50 and p90 per tree over all rounds, and each tree's p50
against the first tree's, are printed. Loopback only.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_admin.client.testing import free_port
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc

OPS = ("info", "flush")


TTFT_STREAMS = 64
# the workers admit more than the 64 streams, so that a probe decodes beside them instead of
# waiting in the queue for one of them to finish
TTFT_MAX_RUNNING = 80


def start(tree: str, *args: str) -> tuple[subprocess.Popen, pb_grpc.SglangSchedulerStub]:
    """A worker running the code of ``tree`` (with ``args``), once it is healthy."""
    port = free_port()
    proc = subprocess.Popen(
        # --metrics-port: the HTTP sidecar's port (its alias, known to older trees too) off
        # port + 1, which may be another worker's
        [sys.executable, "-m", "sglang_admin", "serve", "--port", str(port),
         "--metrics-port", str(free_port()), "--log-level", "warning", *args],
        cwd=tree, env=dict(os.environ, PYTHONPATH=tree),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    stub.target = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if stub.HealthCheck(pb.HealthCheckRequest(), timeout=2).healthy:
                return proc, stub
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{tree}: the worker did not become healthy")


def stop(servers: list[tuple[subprocess.Popen, pb_grpc.SglangSchedulerStub]]) -> None:
    """Stop every worker (SIGTERM to all first, so that they drain side by side); one that
    does not exit within 20 s is killed."""
    for proc, _ in servers:
        proc.terminate()
    for proc, _ in servers:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ttft(ns: argparse.Namespace) -> int:
    """First-token latency of new requests while 64 streams decode, tree against tree."""
    from tools.bench_admin import (
        LOAD_OUTPUT_LEN,
        first_token_latencies,
        start_streams,
        wait_idle,
        wait_running,
    )

    servers = [start(tree, "--max-running-requests", str(TTFT_MAX_RUNNING))
               for tree in ns.trees]
    times: dict[int, list[float]] = {i: [] for i in range(len(servers))}
    try:
        for _, stub in servers:  # warm up: the model's first steps, the client's channel
            first_token_latencies(stub.target, 3, seed=1)
        order = list(range(len(servers)))
        rng = random.Random(0)
        for r in range(ns.rounds):
            rng.shuffle(order)
            for i in order:
                stub = servers[i][1]
                stub.FlushCache(pb.FlushCacheRequest(timeout_s=30), timeout=60)
                load = start_streams(stub.target, LOAD_OUTPUT_LEN, 1e9, seed=3000 + r,
                                     streams=TTFT_STREAMS)
                try:
                    wait_running(stub, TTFT_STREAMS)
                    times[i] += first_token_latencies(stub.target, ns.probes, seed=r)
                finally:
                    load.send_signal(signal.SIGTERM)
                    load.wait(30)
                wait_idle(stub)
        base = statistics.median(times[0])
        print(f"first token of a new request while {TTFT_STREAMS} streams decode, "
              f"{ns.rounds} rounds x {ns.probes} probes per tree (load average "
              f"{os.getloadavg()[0]:.2f}):")
        for i, tree in enumerate(ns.trees):
            ms = sorted(x * 1e3 for x in times[i])
            p50, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
            print(f"{tree:40s} p50 {p50:.1f} ms   p90 {p90:.1f} ms   p50 / first tree's "
                  f"{p50 / (base * 1e3):.2f}x")
    finally:
        stop(servers)
    return 0


def call(stub: pb_grpc.SglangSchedulerStub, op: str) -> float:
    t0 = time.perf_counter()
    if op == "info":
        stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    else:
        stub.FlushCache(pb.FlushCacheRequest(), timeout=5)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--calls", type=int, default=1500, help="calls per (tree, op)")
    parser.add_argument("--dp-size", type=int, default=1,
                        help="data-parallel ranks of every worker (idle admin calls)")
    parser.add_argument("--ttft", action="store_true",
                        help="first-token latency under 64 streams instead of idle admin calls")
    parser.add_argument("--rounds", type=int, default=6, help="--ttft: rounds over the trees")
    parser.add_argument("--probes", type=int, default=20, help="--ttft: probes per round")
    ns = parser.parse_args()
    if ns.ttft:
        return ttft(ns)
    servers = [start(tree, "--dp-size", str(ns.dp_size)) for tree in ns.trees]
    try:
        for _ in range(50):  # warm up
            for _, stub in servers:
                call(stub, "info")
        order = [(i, op) for i in range(len(servers)) for op in OPS] * ns.calls
        random.Random(0).shuffle(order)
        times: dict[tuple[int, str], list[float]] = {(i, op): [] for i, op in order}
        for i, op in order:
            times[(i, op)].append(call(servers[i][1], op))
        for i, tree in enumerate(ns.trees):
            p50 = {op: statistics.median(times[(i, op)]) * 1e3 for op in OPS}
            print(f"{tree:40s} GetServerInfo p50 {p50['info']:.3f} ms   "
                  f"FlushCache p50 {p50['flush']:.3f} ms")
    finally:
        stop(servers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
