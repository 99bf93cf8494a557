"""A/B the idle admin round trip of several code trees side by side.

    python tools/ab_admin.py TREE [TREE ...] [--calls 1500]

Each TREE is a checkout of this project (e.g. a `git worktree add /tmp/old COMMIT`); one
dp 1 worker per tree is started from it (its own code, this venv), then GetServerInfo and
FlushCache(timeout_s=0) calls to every worker are shuffled together, so every tree sees
the same machine, and the p50 of each (tree, op) is printed. Loopback only.
"""

from __future__ import annotations

import argparse
import os
import random
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


def start(tree: str) -> tuple[subprocess.Popen, pb_grpc.SglangSchedulerStub]:
    """A worker running the code of ``tree``, once it is healthy."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_admin", "serve", "--port", str(port),
         "--log-level", "warning"],
        cwd=tree, env=dict(os.environ, PYTHONPATH=tree),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
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
    ns = parser.parse_args()
    servers = [start(tree) for tree in ns.trees]
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
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            proc.wait(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
