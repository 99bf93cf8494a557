#!/usr/bin/env python
"""Admin-path latency, streaming overhead and admin throughput, each figure beside its reference.

Everything is measured side by side in one run (the machine may be shared and noisy), so every
figure is a ratio against a reference taken at the same time, with calls interleaved:

1. floor: a bare grpc.aio server (started by this tool, no interceptors) whose GetServerInfo
   and FlushCache handlers do one ZMQ PUSH/PULL round trip over ipc:// to a child process
   that echoes a reply of the size our rank's reply has, and return a response of the size
   our server's response has (captured from it). Same client, same stubs, same sizes.
2. FlushCache(timeout_s=0) and GetServerInfo on an idle dp 1 server: p50 <= 1.3x the floor's
   (the two servers' calls interleaved).
3. The same on a dp 4 server: p50 <= 1.5x dp 1's (the ranks answer concurrently; dp 1 and
   dp 4 calls interleaved).
4. The same on the dp 1 server while 32 streams decode: p99 <= the floor's p99 (measured
   interleaved, under the same load) + 2 scheduler steps (the mean step period seen, from
   rank_states forward_steps over the probe window).
5. Streaming: output tokens/s that 32 gRPC streaming clients (a separate process) see, against
   the scheduler and model runner driven in-process with the same workload and the same torch
   thread count as the rank (as tools/bench_engine.py drives them): ratio >= 0.9.
6. Admin throughput: 200 concurrent GetServerInfo calls (grpc.aio), calls/s with read
   coalescing on and off (--no-coalesce), beside the floor server's at the same concurrency,
   and the worker's CPU per call (server + ranks, from /proc): coalescing on <= off.
7. With --metrics: a dp 1 worker with --enable-metrics (its exporter scraped every second, as
   Prometheus would, while it streams) beside the plain dp 1 worker: the idle GetServerInfo
   and FlushCache p50 (calls interleaved) and figure 5's streaming tok/s (rounds alternating)
   within 3% of metrics off.
8. Streaming at 32 and 64 streams: output tokens/s of the gRPC clients against the engine
   in-process (same workload, same threads): ratio >= 0.9 each; the server process's own CPU
   (/proc/PID/stat of the server, not its ranks) over the clients' run, as a share of one
   core and per token, and projected to the engine's token rate: < 60% of a core. Then the
   first-token latency of a new request (a fresh prompt) while 64 streams decode, beside the
   same probe on the idle server and the rank's step period (the figure to compare between
   trees: tools/ab_admin.py --ttft).

Usage: python tools/bench_admin.py [--samples N] [--quick] [--metrics] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.pb import common_pb2 as pb  # noqa: E402
from sglang_admin.pb import common_pb2_grpc as pb_grpc  # noqa: E402
from tools.bench_serving import percentile  # noqa: E402

STREAMS = 32
PROMPT_LEN = 64
OUTPUT_LEN = 256  # figure 5: tokens per stream
LOAD_OUTPUT_LEN = 1024  # figure 4: long outputs, so streams rarely restart (prefill steps)
STREAM_COUNTS = (32, 64)  # figure 8
TTFT_STREAMS = 64  # figure 8: streams decoding while a new request's first token is timed
# figure 8's worker admits more than 64 requests, so that the probe runs beside the 64 streams
# instead of waiting in the queue for one of them to finish
FIG8_MAX_RUNNING = 80
CONCURRENCY = 200
INFO = pb.GetServerInfoRequest()
FLUSH = pb.FlushCacheRequest(timeout_s=0)


# ====================================================================== floor server


def echo_main(inbox: str, outbox: str) -> None:
    """The floor's 'rank': receive a request, send back a reply of the size it names."""
    import zmq

    ctx = zmq.Context(1)
    pull = ctx.socket(zmq.PULL)
    pull.bind(inbox)
    push = ctx.socket(zmq.PUSH)
    push.connect(outbox)
    replies: dict[int, bytes] = {}
    parent = os.getppid()
    while True:
        if not pull.poll(1000):
            if os.getppid() != parent:  # the floor server is gone
                break
            continue
        msg = pull.recv()
        (size,) = struct.unpack_from("<I", msg)
        if size == 0:
            break
        reply = replies.get(size)
        if reply is None:
            reply = replies[size] = bytes(size)
        push.send(reply)


def floor_main(port: int, payload_file: str) -> None:
    """A trivial grpc.aio SglangScheduler: one ZMQ round trip per call, canned responses."""
    import zmq
    import zmq.asyncio

    spec = json.loads(Path(payload_file).read_text())
    ipc = tempfile.mkdtemp(prefix="bench-floor-")
    server_addr, child_addr = f"ipc://{ipc}/server", f"ipc://{ipc}/child"
    child = subprocess.Popen(
        [sys.executable, __file__, "echo", "--inbox", child_addr, "--outbox", server_addr]
    )

    def request(size: int, reply_size: int) -> bytes:
        return struct.pack("<I", reply_size) + bytes(max(size - 4, 0))

    class Floor(pb_grpc.SglangSchedulerServicer):
        def __init__(self) -> None:
            ctx = zmq.asyncio.Context()
            self.pull = ctx.socket(zmq.PULL)
            self.pull.bind(server_addr)
            self.push = ctx.socket(zmq.PUSH)
            self.push.connect(child_addr)
            self.info = pb.GetServerInfoResponse.FromString(bytes.fromhex(spec["info"]))
            self.flush = pb.FlushCacheResponse.FromString(bytes.fromhex(spec["flush"]))
            self.info_req = request(spec["state_req"], spec["state_reply"])
            self.flush_req = request(spec["flush_req"], spec["flush_reply"])

        async def GetServerInfo(self, request: Any, context: Any) -> pb.GetServerInfoResponse:
            await self.push.send(self.info_req)
            await self.pull.recv()
            return self.info

        async def FlushCache(self, request: Any, context: Any) -> pb.FlushCacheResponse:
            await self.push.send(self.flush_req)
            await self.pull.recv()
            return self.flush

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_SglangSchedulerServicer_to_server(Floor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(0)

    try:
        asyncio.run(serve())
    finally:
        child.kill()
        child.wait()


# ====================================================================== streaming clients


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of one process, every thread of it (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _streams_async(
    target: str, streams: int, prompt_len: int, output_len: int, duration: float, seed: int,
    cpu_pid: int = 0,
) -> dict[str, Any]:
    """`streams` streaming Generate calls. duration 0: one request each, all at once; else
    each stream starts a new request when its last one finishes, until duration has passed.
    With `cpu_pid`, also the CPU seconds that process used from the first send to the end."""
    rng = random.Random(seed)
    tokens = 0
    first_send = 0.0
    last_token = 0.0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        t0 = time.perf_counter()
        stop_at = t0 + duration

        async def one(i: int) -> None:
            nonlocal tokens, last_token
            while True:
                req = pb.GenerateRequest(
                    tokenized=pb.TokenizedInput(
                        input_ids=[rng.randrange(3, 256) for _ in range(prompt_len)]
                    ),
                    sampling_params=pb.SamplingParams(
                        temperature=0.0, max_new_tokens=output_len, ignore_eos=True
                    ),
                    stream=True,
                )
                async for resp in stub.Generate(req, timeout=600):
                    if resp.HasField("chunk"):
                        tokens += len(resp.chunk.token_ids)
                        last_token = time.perf_counter()
                if time.perf_counter() >= stop_at:
                    return

        cpu0 = process_cpu(cpu_pid) if cpu_pid else 0.0
        first_send = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(streams)))
        end = time.perf_counter()
        cpu = process_cpu(cpu_pid) - cpu0 if cpu_pid else 0.0
    elapsed = last_token - first_send
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed if elapsed else 0.0,
            "cpu_s": cpu, "cpu_wall_s": end - first_send}


def streams_main(ns: argparse.Namespace) -> None:
    result = asyncio.run(
        _streams_async(ns.target, ns.streams, ns.prompt_len, ns.output_len, ns.duration, ns.seed,
                       ns.cpu_pid)
    )
    print(json.dumps(result), flush=True)


def start_streams(target: str, output_len: int, duration: float, seed: int,
                  streams: int = STREAMS, cpu_pid: int = 0) -> subprocess.Popen:
    """The streaming clients in a process of their own (`streams` concurrent calls); with
    `cpu_pid`, they also report that process's CPU over their run."""
    return subprocess.Popen(
        [sys.executable, __file__, "streams", "--target", target, "--streams", str(streams),
         "--prompt-len", str(PROMPT_LEN), "--output-len", str(output_len),
         "--duration", str(duration), "--seed", str(seed), "--cpu-pid", str(cpu_pid)],
        stdout=subprocess.PIPE, text=True,
    )


def stream_result(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"streaming clients failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


# ====================================================================== measurement helpers


class Prober:
    """Sequential unary calls through one sync channel per server (the same client for all)."""

    def __init__(self, targets: dict[str, str]) -> None:
        self.channels = {name: grpc.insecure_channel(t) for name, t in targets.items()}
        self.stubs = {name: pb_grpc.SglangSchedulerStub(ch) for name, ch in self.channels.items()}

    def call(self, server: str, op: str) -> tuple[float, Any]:
        stub = self.stubs[server]
        fn, req = (stub.GetServerInfo, INFO) if op == "info" else (stub.FlushCache, FLUSH)
        t0 = time.perf_counter()
        resp = fn(req, timeout=30)
        return time.perf_counter() - t0, resp

    def interleaved(
        self, pairs: list[tuple[str, str]], samples: int, on_response: Callable | None = None
    ) -> dict[tuple[str, str], list[float]]:
        """`samples` calls of every (server, op), in shuffled rounds so that each pair sees the
        same conditions (machine load) as the others."""
        times: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
        rng = random.Random(0)
        order = list(pairs)
        for _ in range(samples):
            rng.shuffle(order)
            for pair in order:
                dt, resp = self.call(*pair)
                times[pair].append(dt)
                if on_response is not None:
                    on_response(pair, resp)
        return times

    def add(self, name: str, target: str) -> None:
        """Probe one more server."""
        self.channels[name] = grpc.insecure_channel(target)
        self.stubs[name] = pb_grpc.SglangSchedulerStub(self.channels[name])

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


def p50_p99(times: list[float]) -> tuple[float, float]:
    ms = [t * 1e3 for t in times]
    return percentile(ms, 50), percentile(ms, 99)


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children (a server and its ranks)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    total = 0.0
    for p in [pid, *map(int, kids)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def _throughput(target: str, concurrency: int, duration: float) -> tuple[int, float]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        await asyncio.gather(*(stub.GetServerInfo(INFO, timeout=30) for _ in range(concurrency)))
        count = 0
        t0 = time.perf_counter()
        stop_at = t0 + duration

        async def worker() -> None:
            nonlocal count
            while time.perf_counter() < stop_at:
                await stub.GetServerInfo(INFO, timeout=30)
                count += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return count, time.perf_counter() - t0


def throughput(target: str, pid: int, concurrency: int, duration: float) -> tuple[float, float]:
    """(calls/s, CPU us per call of the worker's processes) of `concurrency` callers."""
    cpu = tree_cpu(pid)
    calls, seconds = asyncio.run(_throughput(target, concurrency, duration))
    return calls / seconds, (tree_cpu(pid) - cpu) / calls * 1e6


def wait_running(stub: pb_grpc.SglangSchedulerStub, n: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = stub.GetServerInfo(INFO, timeout=10)
        if sum(s.num_running_reqs for s in info.rank_states) >= n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{n} streams not running after {timeout}s")


def wait_idle(stub: pb_grpc.SglangSchedulerStub, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = stub.GetServerInfo(INFO, timeout=10)
        if all(s.num_running_reqs == 0 and s.num_waiting_reqs == 0 for s in info.rank_states):
            return
        time.sleep(0.05)
    raise TimeoutError("server did not go idle")


def engine_tok_s(threads: int, output_len: int, seed: int, streams: int = STREAMS) -> float:
    """The scheduler + model runner driven in-process (as a rank drives them), same workload."""
    import torch

    from sglang_admin.config import ServerArgs
    from sglang_admin.model.runner import ModelRunner
    from tools.bench_engine import Workload, run_engine

    torch.set_num_threads(threads)
    args = ServerArgs()
    runner = getattr(engine_tok_s, "runner", None)
    if runner is None:
        runner = ModelRunner(None, device="cpu", dtype="float32",
                             max_running_requests=args.max_running_requests, seed=args.seed)
        engine_tok_s.runner = runner  # type: ignore[attr-defined]
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(PROMPT_LEN)] for _ in range(streams)]
    work = Workload("streams", prompts, [output_len] * streams)
    runner.reset()
    seconds, _ = run_engine(runner, work, args.max_running_requests)
    return work.output_tokens / seconds


def first_token_latencies(target: str, count: int, seed: int) -> list[float]:
    """Seconds from sending a new streaming request (a fresh prompt, so no cached prefix) to
    its first chunk, for `count` requests one after another (each read to its end)."""
    rng = random.Random(seed)
    times = []
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        for _ in range(count):
            req = pb.GenerateRequest(
                tokenized=pb.TokenizedInput(
                    input_ids=[rng.randrange(3, 256) for _ in range(PROMPT_LEN)]),
                sampling_params=pb.SamplingParams(
                    temperature=0.0, max_new_tokens=2, ignore_eos=True),
                stream=True,
            )
            t0 = time.perf_counter()
            first = None
            for resp in stub.Generate(req, timeout=60):
                if first is None and resp.HasField("chunk"):
                    first = time.perf_counter() - t0
            if first is None:
                raise RuntimeError("a probe request ended without a chunk")
            times.append(first)
    return times


def step_period_ms(stub: pb_grpc.SglangSchedulerStub, seconds: float) -> float:
    """The rank's mean loop period over `seconds` (from forward_steps), in ms."""
    a = stub.GetServerInfo(INFO, timeout=10).rank_states[0].forward_steps
    t0 = time.perf_counter()
    time.sleep(seconds)
    b = stub.GetServerInfo(INFO, timeout=10).rank_states[0].forward_steps
    return (time.perf_counter() - t0) / max(b - a, 1) * 1e3


def streams_and_first_token(ns: argparse.Namespace, server: Any, threads: int,
                            log: Callable[[str], None]) -> dict[str, Any]:
    """Figure 8: 32 and 64 streams against the engine, the server process's CPU over the
    gRPC runs, and the first-token latency of a new request while 64 streams decode."""
    stub = server.stub()
    pid = server.proc.pid  # the server process itself; its ranks are its children
    out: dict[str, Any] = {}
    for streams in STREAM_COUNTS:
        log(f"streaming: {streams} streams x {OUTPUT_LEN} tokens, engine in-process vs gRPC "
            f"clients (server CPU from /proc/{pid}/stat), {ns.stream_rounds} rounds")
        engine_runs, grpc_runs = [], []
        for r in range(ns.stream_rounds):
            engine_runs.append(engine_tok_s(threads, OUTPUT_LEN, seed=100 + r, streams=streams))
            stub.FlushCache(pb.FlushCacheRequest(timeout_s=30), timeout=60)
            grpc_runs.append(stream_result(start_streams(
                server.target, OUTPUT_LEN, 0, seed=100 + r, streams=streams, cpu_pid=pid), 300))
        out[str(streams)] = {"engine_tok_s": engine_runs, "grpc": grpc_runs}
    stub.FlushCache(pb.FlushCacheRequest(timeout_s=30), timeout=60)
    idle = first_token_latencies(server.target, ns.ttft_samples, seed=7)
    log(f"first token of a new request while {TTFT_STREAMS} streams decode: "
        f"{ns.ttft_samples} probes")
    load = start_streams(server.target, LOAD_OUTPUT_LEN, 1e9, seed=2000, streams=TTFT_STREAMS)
    try:
        wait_running(stub, TTFT_STREAMS)
        period = step_period_ms(stub, 1.0)
        busy = first_token_latencies(server.target, ns.ttft_samples, seed=8)
    finally:
        load.send_signal(signal.SIGTERM)
        load.wait(30)
    wait_idle(stub)
    out["ttft"] = {"idle": idle, "busy": busy, "step_period_ms": period}
    return out


# ====================================================================== the benchmark


def bench(ns: argparse.Namespace) -> dict[str, Any]:
    from sglang_admin.client.testing import free_port, start_server, wait_serving
    from sglang_admin.messages import (
        AdminReply,
        FlushCacheReq,
        RankState,
        StateReq,
        encode,
    )

    tmp = Path(tempfile.mkdtemp(prefix="bench-admin-"))
    servers: dict[str, Any] = {}
    procs: list[subprocess.Popen] = []
    prober: Prober | None = None
    out: dict[str, Any] = {"load_before": os.getloadavg()}
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    try:
        if ns.streams_only:
            from sglang_admin.config import ServerArgs

            log(f"starting dp1 (--max-running-requests {FIG8_MAX_RUNNING}); figure 8 only")
            servers["dp1"] = start_server(tmp, "--max-running-requests", str(FIG8_MAX_RUNNING),
                                          port=free_port())
            threads = ServerArgs().rank_threads
            engine_tok_s(threads, 8, seed=99)  # warm up (model load, first steps)
            stream_result(start_streams(servers["dp1"].target, 8, 0, seed=99), 300)
            out["streams"] = streams_and_first_token(ns, servers["dp1"], threads, log)
            return out
        log("starting servers: dp1, dp4, dp1 --no-coalesce")
        servers["dp1"] = start_server(tmp, "--max-running-requests", str(FIG8_MAX_RUNNING),
                                      port=free_port(), wait=False)
        servers["dp4"] = start_server(tmp, "--dp-size", "4", port=free_port(), wait=False)
        servers["nocoal"] = start_server(tmp, "--no-coalesce", port=free_port(), wait=False)
        for srv in servers.values():
            wait_serving(srv.target, srv.proc)
        stub1 = servers["dp1"].stub()
        info = stub1.GetServerInfo(INFO, timeout=30)
        flush = stub1.FlushCache(FLUSH, timeout=30)
        # the sizes our server and rank exchange for these calls
        rid = "0" * 32
        state = RankState(dp_rank=0, **{
            f: getattr(info.rank_states[0], f)
            for f in ("num_running_reqs", "token_capacity", "device", "pid", "last_step_time_s")
        })
        spec = {
            "info": info.SerializeToString().hex(),
            "flush": flush.SerializeToString().hex(),
            "state_req": len(encode(StateReq(rid, deadline=time.time() + 5))),
            "state_reply": len(encode(AdminReply(rid, 0, True, "", {"state": state}))),
            "flush_req": len(encode(FlushCacheReq(rid, 0.0, time.time() + 30))),
            "flush_reply": len(encode(AdminReply(rid, 0, True, "Cache flushed successfully",
                                                 {"tokens_freed": 0}))),
        }
        spec_file = tmp / "floor.json"
        spec_file.write_text(json.dumps(spec))
        out["sizes"] = {k: (len(v) // 2 if k in ("info", "flush") else v)
                        for k, v in spec.items()}
        floor_port = free_port()
        floor = subprocess.Popen(
            [sys.executable, __file__, "floor", "--port", str(floor_port),
             "--payload", str(spec_file)]
        )
        procs.append(floor)
        targets = {name: srv.target for name, srv in servers.items()}
        targets["floor"] = f"127.0.0.1:{floor_port}"
        prober = Prober(targets)
        deadline = time.time() + 30
        while True:
            try:
                prober.call("floor", "info")
                break
            except grpc.RpcError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)

        # ---- 1, 2, 3: idle latency; each comparison interleaves its two servers only
        out["idle"] = {}
        for a, b in (("floor", "dp1"), ("dp1", "dp4")):
            pairs = [(s, op) for s in (a, b) for op in ("info", "flush")]
            prober.interleaved(pairs, 30)  # warm up every path
            log(f"idle latency, {a} vs {b}: {ns.samples} calls of each (server, op) pair")
            times = prober.interleaved(pairs, ns.samples)
            out["idle"][f"{a} vs {b}"] = {f"{s}/{op}": p50_p99(t) for (s, op), t in times.items()}

        # ---- 6: admin throughput, coalescing on / off and the floor, interleaved rounds
        log(f"throughput: {CONCURRENCY} concurrent GetServerInfo, {ns.rounds} rounds")
        pids = {name: srv.proc.pid for name, srv in servers.items()}
        pids["floor"] = floor.pid
        tput: dict[str, list[tuple[float, float]]] = {"floor": [], "dp1": [], "nocoal": []}
        for _ in range(ns.rounds):
            for name in tput:
                tput[name].append(
                    throughput(targets[name], pids[name], CONCURRENCY, ns.tput_seconds)
                )
        out["throughput"] = {
            k: {"calls_s": statistics.median(x[0] for x in v),
                "cpu_us_per_call": statistics.median(x[1] for x in v)}
            for k, v in tput.items()
        }
        for name in ("dp4", "nocoal"):
            servers[name].stop()

        # ---- 7: metrics on against off (dp 1 each), latency interleaved, streams alternating
        if ns.metrics:
            out["metrics"] = metrics_on_off(ns, tmp, servers, prober, targets, log)

        # ---- 5: streaming through gRPC vs the engine in-process, alternating, best of each
        from sglang_admin.config import ServerArgs

        threads = ServerArgs().rank_threads  # what a dp 1 rank's lanes use
        log(f"streaming: {STREAMS} streams x {OUTPUT_LEN} tokens, engine in-process "
            f"({threads} torch thread(s)) vs gRPC clients, {ns.stream_rounds} rounds")
        engine_runs, grpc_runs = [], []
        engine_tok_s(threads, 8, seed=99)  # warm up (model load, first steps)
        run = start_streams(servers["dp1"].target, 8, 0, seed=99)
        stream_result(run, 300)
        for r in range(ns.stream_rounds):
            engine_runs.append(engine_tok_s(threads, OUTPUT_LEN, seed=r))
            stub1.FlushCache(pb.FlushCacheRequest(timeout_s=30), timeout=60)
            grpc_runs.append(stream_result(start_streams(
                servers["dp1"].target, OUTPUT_LEN, 0, seed=r), 300)["tok_s"])
        out["streaming"] = {"engine_tok_s": engine_runs, "grpc_tok_s": grpc_runs}

        # ---- 8: 32 and 64 streams, the server process's CPU, first token under 64 streams
        out["streams"] = streams_and_first_token(ns, servers["dp1"], threads, log)

        # ---- 4: latency while 32 streams decode (dp1), floor interleaved under the same load
        log(f"under load: {STREAMS} streams decoding, {ns.load_samples} calls of each pair")
        stub1.FlushCache(pb.FlushCacheRequest(timeout_s=30), timeout=60)
        load = start_streams(servers["dp1"].target, LOAD_OUTPUT_LEN, 1e9, seed=1000)
        procs.append(load)
        wait_running(stub1, STREAMS)
        steps: list[tuple[float, int, float, int]] = []

        def on_response(pair: tuple[str, str], resp: Any) -> None:
            if pair == ("dp1", "info"):
                s = resp.rank_states[0]
                steps.append((time.perf_counter(), s.forward_steps, s.last_step_time_s,
                              s.num_running_reqs))

        pairs = [(s, op) for s in ("floor", "dp1") for op in ("info", "flush")]
        times = prober.interleaved(pairs, ns.load_samples, on_response)
        load.send_signal(signal.SIGTERM)
        load.wait(30)
        (t_a, n_a, _, _), (t_b, n_b, _, _) = steps[0], steps[-1]
        out["load"] = {f"{s}/{op}": p50_p99(t) for (s, op), t in times.items()}
        out["load"]["step_period_ms"] = (t_b - t_a) / max(n_b - n_a, 1) * 1e3
        out["load"]["step_forward_ms"] = statistics.fmean(s[2] for s in steps) * 1e3
        out["load"]["running_min"] = min(s[3] for s in steps)
        wait_idle(stub1)
    finally:
        if prober is not None:
            prober.close()
        for srv in servers.values():
            srv.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        out["load_after"] = os.getloadavg()
        out["seconds"] = time.perf_counter() - t_start
    return out


class Scraper(threading.Thread):
    """GETs a metrics exporter every second until stopped (what Prometheus does)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.stopped = threading.Event()
        self.scrapes = 0

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            with urllib.request.urlopen(self.url, timeout=10) as resp:
                resp.read()
            self.scrapes += 1


def metrics_on_off(ns: argparse.Namespace, tmp: Path, servers: dict[str, Any],
                   prober: Prober, targets: dict[str, str],
                   log: Callable[[str], None]) -> dict[str, Any]:
    """Figure 7: the dp 1 worker against one with --enable-metrics, side by side."""
    from sglang_admin.client.testing import free_port, start_server

    port = free_port()
    servers["metrics"] = srv = start_server(tmp, "--enable-metrics", "--metrics-port", str(port),
                                            port=free_port())
    targets["metrics"] = srv.target
    prober.add("metrics", srv.target)
    pairs = [(s, op) for s in ("dp1", "metrics") for op in ("info", "flush")]
    prober.interleaved(pairs, 30)
    log(f"metrics on vs off: {ns.samples} idle calls of each pair, {ns.stream_rounds} "
        f"alternating streaming rounds")
    times = prober.interleaved(pairs, ns.samples)
    result: dict[str, Any] = {f"{s}/{op}": p50_p99(t) for (s, op), t in times.items()}
    stream_result(start_streams(srv.target, 8, 0, seed=99), 300)  # warm up
    runs: dict[str, list[float]] = {"dp1": [], "metrics": []}
    scraper = Scraper(port)
    scraper.start()
    for r in range(ns.stream_rounds):
        for name in ("dp1", "metrics"):
            stub = servers[name].stub()
            stub.FlushCache(pb.FlushCacheRequest(timeout_s=30), timeout=60)
            runs[name].append(stream_result(start_streams(
                targets[name], OUTPUT_LEN, 0, seed=r), 300)["tok_s"])
    scraper.stopped.set()
    scraper.join(15)
    result["streaming"] = runs
    result["scrapes"] = scraper.scrapes
    servers["metrics"].stop()
    return result


def report_metrics(m: dict[str, Any], met: list[bool]) -> None:
    """Figure 7's lines: metrics on against off, target within 3%."""
    names = {"info": "GetServerInfo", "flush": "FlushCache"}
    print(f"\n7 metrics on vs off (dp 1 each; exporter scraped every second while streaming, "
          f"{m['scrapes']} scrapes):")
    for op in ("info", "flush"):
        on, off = m[f"metrics/{op}"][0], m[f"dp1/{op}"][0]
        ok = on <= 1.03 * off
        met.append(ok)
        print(f"  idle {names[op]:<14} p50 on {on:.3f} ms, off {off:.3f} ms = {on / off:.3f}x "
              f"(target <= 1.03x) met: {'yes' if ok else 'NO'}")
    on, off = max(m["streaming"]["metrics"]), max(m["streaming"]["dp1"])
    ok = on >= 0.97 * off
    met.append(ok)
    print(f"  streaming (best of {len(m['streaming']['dp1'])}): on {on:.0f} tok/s, off "
          f"{off:.0f} tok/s = {on / off:.3f}x (target >= 0.97x) met: {'yes' if ok else 'NO'}")
    print(f"  runs: on {[round(x) for x in m['streaming']['metrics']]}, "
          f"off {[round(x) for x in m['streaming']['dp1']]}")


def report_streams(st: dict[str, Any], met: list[bool]) -> None:
    """Figure 8's lines: 32 and 64 streams against the engine with the server process's
    CPU, then the first-token latency under 64 streams."""
    print(f"\n8 streaming x {OUTPUT_LEN} tokens (best of {len(st['32']['grpc'])}), the server "
          f"process's CPU over the gRPC run (/proc/PID/stat of the server, not its ranks):")
    for streams in STREAM_COUNTS:
        runs = st[str(streams)]
        best = max(runs["grpc"], key=lambda x: x["tok_s"])
        eng = max(runs["engine_tok_s"])
        ok = best["tok_s"] >= 0.9 * eng
        share = best["cpu_s"] / best["cpu_wall_s"]
        us_token = best["cpu_s"] / best["tokens"] * 1e6
        at_engine = us_token * eng / 1e6
        cpu_ok = max(share, at_engine) < 0.6
        met += [ok, cpu_ok]
        print(f"  {streams} streams: gRPC {best['tok_s']:.0f} tok/s vs engine {eng:.0f} tok/s "
              f"= {best['tok_s'] / eng:.2f}x (target >= 0.9x) met: {'yes' if ok else 'NO'}")
        print(f"     server CPU {share * 100:.0f}% of a core over the run, {us_token:.0f} us a "
              f"token = {at_engine * 100:.0f}% at the engine's rate (target < 60%) met: "
              f"{'yes' if cpu_ok else 'NO'}")
        print(f"     runs: gRPC {[round(x['tok_s']) for x in runs['grpc']]}, "
              f"engine {[round(x) for x in runs['engine_tok_s']]}")
    t = st["ttft"]
    idle = [x * 1e3 for x in t["idle"]]
    busy = [x * 1e3 for x in t["busy"]]
    print(f"  first token of a new request ({PROMPT_LEN}-token prompt), {len(busy)} probes: "
          f"while {TTFT_STREAMS} streams decode p50 {percentile(busy, 50):.1f} ms, p90 "
          f"{percentile(busy, 90):.1f} ms; idle p50 {percentile(idle, 50):.1f} ms; the rank's "
          f"step period under that load {t['step_period_ms']:.1f} ms (compare trees: "
          f"tools/ab_admin.py --ttft)")


def report(r: dict[str, Any]) -> list[bool]:
    """Print every figure with its reference, ratio, target and whether it is met."""
    met: list[bool] = []
    rows: list[tuple[str, ...]] = []

    def row(label: str, p50: float, p99: float, ref: str = "", ratio: str = "",
            target: str = "", ok: bool | None = None) -> None:
        if ok is not None:
            met.append(ok)
        rows.append((label, f"{p50:8.3f}", f"{p99:8.3f}", ref, ratio, target,
                     "" if ok is None else ("yes" if ok else "NO")))

    idle, idle3, load = r["idle"]["floor vs dp1"], r["idle"]["dp1 vs dp4"], r["load"]
    names = {"info": "GetServerInfo", "flush": "FlushCache"}
    for op in ("info", "flush"):
        row(f"1 floor {names[op]}", *idle[f"floor/{op}"])
    for op in ("info", "flush"):
        p50, p99 = idle[f"dp1/{op}"]
        fp50 = idle[f"floor/{op}"][0]
        row(f"2 idle dp1 {names[op]}", p50, p99, f"floor p50 {fp50:.3f}",
            f"{p50 / fp50:.2f}x", "p50 <= 1.3x", p50 <= 1.3 * fp50)
    for op in ("info", "flush"):
        p50, p99 = idle3[f"dp4/{op}"]
        d1 = idle3[f"dp1/{op}"][0]
        row(f"3 idle dp4 {names[op]}", p50, p99, f"dp1 p50 {d1:.3f}",
            f"{p50 / d1:.2f}x", "p50 <= 1.5x", p50 <= 1.5 * d1)
    step = load["step_period_ms"]
    for op in ("info", "flush"):
        fp50, fp99 = load[f"floor/{op}"]
        row(f"4 load floor {names[op]}", fp50, fp99)
    for op in ("info", "flush"):
        p50, p99 = load[f"dp1/{op}"]
        fp99 = load[f"floor/{op}"][1]
        limit = fp99 + 2 * step
        row(f"4 load dp1 {names[op]}", p50, p99, f"floor p99 {fp99:.3f} + 2x{step:.2f}",
            f"{p99 / limit:.2f}x", f"p99 <= {limit:.2f}", p99 <= limit)
    print(f"\n{'figure':<28}{'p50 ms':>9}{'p99 ms':>9}  {'reference':<26}{'ratio':>7}  "
          f"{'target':<15}met")
    for label, p50, p99, ref, ratio, target, ok in rows:
        print(f"{label:<28}{p50:>9}{p99:>9}  {ref:<26}{ratio:>7}  {target:<15}{ok}")
    idle_limit = max(idle["floor/info"][1], idle["floor/flush"][1]) + 2 * step
    worst = max(load["dp1/info"][1], load["dp1/flush"][1])
    print(f"  4: the floor ran interleaved under the same load; the step is the mean period "
          f"of the rank's loop ({step:.2f} ms, from forward_steps over the probe window; mean "
          f"forward time {load['step_forward_ms']:.2f} ms), >= {load['running_min']} streams "
          f"running. Against the idle floor instead: p99 {worst:.2f} <= {idle_limit:.2f} "
          f"{'yes' if worst <= idle_limit else 'NO'}. FlushCache(timeout_s=0) on a busy rank "
          f"answers 'pending requests'.")

    st = r["streaming"]
    eng, grp = max(st["engine_tok_s"]), max(st["grpc_tok_s"])
    ok = grp >= 0.9 * eng
    met.append(ok)
    print(f"\n5 streaming, {STREAMS} streams x {OUTPUT_LEN} tokens (best of "
          f"{len(st['grpc_tok_s'])}): gRPC clients {grp:.0f} tok/s vs engine in-process "
          f"{eng:.0f} tok/s = {grp / eng:.2f}x (target >= 0.9x) met: {'yes' if ok else 'NO'}")
    print(f"  runs: gRPC {[round(x) for x in st['grpc_tok_s']]}, "
          f"engine {[round(x) for x in st['engine_tok_s']]}")

    tp = r["throughput"]
    on, off, fl = tp["dp1"], tp["nocoal"], tp["floor"]
    ok = on["cpu_us_per_call"] <= off["cpu_us_per_call"]
    met.append(ok)
    print(f"\n6 throughput, {CONCURRENCY} concurrent GetServerInfo from one grpc.aio client "
          f"(median of rounds):")
    for label, x in (("coalescing on", on), ("coalescing off", off), ("floor", fl)):
        print(f"  {label:<15}{x['calls_s']:8.0f} calls/s  {x['cpu_us_per_call']:6.0f} us of "
              f"worker CPU (server + ranks) per call")
    print(f"  calls/s on/off {on['calls_s'] / off['calls_s']:.2f}x, on/floor "
          f"{on['calls_s'] / fl['calls_s']:.2f}x; CPU per call on/off "
          f"{on['cpu_us_per_call'] / off['cpu_us_per_call']:.2f}x (target <= 1.0x) met: "
          f"{'yes' if ok else 'NO'}")
    if "metrics" in r:
        report_metrics(r["metrics"], met)
    report_streams(r["streams"], met)
    la, lb = r["load_before"], r["load_after"]
    print(f"\nload average before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, after "
          f"{lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}; {os.cpu_count()} CPUs; "
          f"sizes {r['sizes']}; took {r['seconds']:.0f}s")
    print(f"targets met: {sum(met)}/{len(met)}")
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode")
    p = sub.add_parser("floor", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--payload", required=True)
    p = sub.add_parser("echo", help=argparse.SUPPRESS)
    p.add_argument("--inbox", required=True)
    p.add_argument("--outbox", required=True)
    p = sub.add_parser("streams", help=argparse.SUPPRESS)
    p.add_argument("--target", required=True)
    p.add_argument("--streams", type=int, default=STREAMS)
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--duration", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-pid", type=int, default=0)
    parser.add_argument("--samples", type=int, default=400,
                        help="idle calls per (server, op) pair")
    parser.add_argument("--load-samples", type=int, default=300,
                        help="calls per (server, op) pair while streams decode")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds")
    parser.add_argument("--tput-seconds", type=float, default=1.5)
    parser.add_argument("--stream-rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--metrics", action="store_true",
                        help="also compare a worker with --enable-metrics against dp 1 (7)")
    parser.add_argument("--ttft-samples", type=int, default=40,
                        help="first-token probes, idle and under 64 streams (figure 8)")
    parser.add_argument("--streams-only", action="store_true",
                        help="figure 8 alone (streaming at 32 and 64, server CPU, first token)")
    parser.add_argument("--json", help="also write the raw figures to this file")
    ns = parser.parse_args(argv)
    if ns.mode == "floor":
        floor_main(ns.port, ns.payload)
        return 0
    if ns.mode == "echo":
        echo_main(ns.inbox, ns.outbox)
        return 0
    if ns.mode == "streams":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        streams_main(ns)
        return 0
    if ns.quick:
        ns.samples, ns.load_samples, ns.rounds, ns.tput_seconds = 60, 60, 1, 0.5
        ns.stream_rounds, ns.ttft_samples = 1, 15
    result = bench(ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1))
    if ns.streams_only:
        met: list[bool] = []
        report_streams(result["streams"], met)
        print(f"targets met: {sum(met)}/{len(met)}")
    else:
        report(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
