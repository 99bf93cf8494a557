#!/usr/bin/env python3
"""Soak a worker: N concurrent streams for T seconds, mixed with admin calls and
cancellations, every output checked against its solo greedy run.

    python tools/soak.py --streams 64 --duration 60 --json soak.json
    python tools/soak.py --target 127.0.0.1:30000 --streams 8 --duration 10

What it does:

1. Starts its own server (``python -m sglang_admin serve`` on a free loopback port, the
   embedded default model) unless given ``--target``, which must be a loopback address.
2. Builds a fixed pool of prompts (half share a common prefix, so the radix cache is hit)
   and runs each one alone, greedy, to get its reference output.
3. For ``--duration`` seconds (and at most ``--max-requests`` requests), ``--streams``
   workers each run one request after another: streaming or not, and a
   ``--cancel-share`` of them cancelled part way (half by the client cancelling the call,
   half through the Abort RPC). A finished request must equal its reference token for
   token; a cancelled one must be a prefix of it.
4. Meanwhile an admin loop cycles FlushCache (with a timeout), GetServerInfo, GetLoads and
   StartProfile/StopProfile. UNIMPLEMENTED profile RPCs are skipped with a note.
5. Samples the resident memory (VmRSS from /proc) of the server process and its scheduler
   ranks every second, and at the end checks that no request holds KV any more.

Exit status 0 when: no wrong output, no lost request (one that never ended), no failed
call other than the intended cancellations, no failed admin call, KV back to idle, RSS
growth between the first and last ``--rss-window`` seconds (medians of 1 Hz samples) under
``--max-rss-growth`` percent (checked on runs of at least 30 s), and the server it started
exits 0 on SIGTERM. Bounded: the run
stops after ``--duration`` seconds plus a drain of at most ``--request-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.client.testing import free_port
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc

MAX_STREAMS = 512
MAX_DURATION_S = 3600.0


# ---------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="HOST:PORT of a running worker (loopback only); "
                   "default: start one")
    p.add_argument("--streams", type=int, default=64, help="concurrent request loops")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-requests", type=int, default=None,
                   help="stop starting requests after this many (default: no count bound)")
    p.add_argument("--cancel-share", type=float, default=0.1,
                   help="fraction of requests cancelled part way")
    p.add_argument("--admin-interval", type=float, default=1.0,
                   help="seconds between admin calls (0: none)")
    p.add_argument("--flush-timeout", type=float, default=2.0,
                   help="FlushCache timeout_s (it waits for idle up to this long)")
    p.add_argument("--profile-mode", choices=["steps", "alternate", "off"], default="steps",
                   help="profile sessions: 'steps' stop by themselves after 5 forward steps "
                   "(StopProfile then finds none running), 'alternate' makes every other one "
                   "run until StopProfile exports it, 'off' skips the profile RPCs")
    p.add_argument("--prompts", type=int, default=32, help="size of the prompt pool")
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="deadline of each call, and the most the final drain waits")
    p.add_argument("--dp-size", type=int, default=1, help="ranks of the server it starts")
    p.add_argument("--api-key", help="sent as 'authorization: Bearer KEY' on inference calls")
    p.add_argument("--admin-api-key", help="sent on admin calls (default: --api-key)")
    p.add_argument("--max-rss-growth", type=float, default=5.0,
                   help="percent RSS growth allowed between the first and last windows")
    p.add_argument("--rss-window", type=float, default=10.0, help="seconds per RSS window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write the report here as JSON")
    p.add_argument("--server-log", help="keep the started server's log here")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    ns = p.parse_args(argv)
    if not 1 <= ns.streams <= MAX_STREAMS:
        p.error(f"--streams must be in [1, {MAX_STREAMS}]")
    if not 0 < ns.duration <= MAX_DURATION_S:
        p.error(f"--duration must be in (0, {MAX_DURATION_S:.0f}]")
    if ns.max_requests is not None and ns.max_requests < 1:
        p.error("--max-requests must be >= 1")
    if not 0.0 <= ns.cancel_share <= 1.0:
        p.error("--cancel-share must be in [0, 1]")
    if not 1 <= ns.min_new <= ns.max_new:
        p.error("need 1 <= --min-new <= --max-new")
    if ns.target:
        try:
            check_loopback(ns.target)
        except ValueError as exc:
            p.error(str(exc))
    return ns


def split_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--target {target!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def check_loopback(target: str) -> None:
    """Refuse anything that is not this machine's loopback interface."""
    host, port = split_target(target)
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ValueError(f"--target {target!r}: cannot resolve {host!r}: {exc}") from None
    addrs = {info[4][0] for info in infos}
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"--target {target!r} is not a loopback address (soak is local only)")


# ---------------------------------------------------------------------- the server


class OwnServer:
    """A worker started for this run, stopped with SIGTERM at the end."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="soak-"))
        self.log_path = Path(args.server_log) if args.server_log else self.tmp / "server.log"
        cmd = [
            sys.executable, "-m", "sglang_admin", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--grpc-http-sidecar-port", str(free_port()),
            "--dp-size", str(args.dp_size),
            "--max-running-requests", str(max(64, args.streams)),
            "--profile-dir", str(self.tmp / "profiles"),
            "--log-level", "warning",
        ]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        if args.admin_api_key:
            cmd += ["--admin-api-key", args.admin_api_key]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.exit_code: int | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float = 300.0) -> None:
        deadline = time.time() + timeout
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                       + self.log_path.read_text()[-3000:])
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"server not SERVING after {timeout:.0f}s")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.exit_code = self.proc.returncode
        self._log.close()
        shutil.rmtree(self.tmp / "profiles", ignore_errors=True)
        if not self.log_path.is_relative_to(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.exit_code

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---------------------------------------------------------------------- memory


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_of(int(entry)) == pid:
            out.append(int(entry))
    return out


def is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return True


@dataclass
class RssSampler:
    """VmRSS of the server process plus its scheduler ranks, once a second."""

    server_pid: int | None
    rank_pids: list[int]
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds, KiB)
    per_pid: dict[int, list[tuple[float, int]]] = field(default_factory=dict)

    def pids(self) -> list[int]:
        pids = list(self.rank_pids)
        if self.server_pid is not None:
            pids = [self.server_pid] + [
                c for c in children_of(self.server_pid) if not is_resource_tracker(c)
            ]
        return pids

    def sample(self, t: float) -> None:
        total = 0
        for pid in self.pids():
            value = rss_kib(pid)
            if value is not None:
                total += value
                self.per_pid.setdefault(pid, []).append((t, value))
        if total:
            self.samples.append((t, total))

    def summary(self, duration: float, window: float) -> dict[str, Any]:
        if not self.samples:
            return {"available": False}
        window = min(window, max(duration / 3, 1.0))
        first = [v for t, v in self.samples if t <= window]
        last = [v for t, v in self.samples if t >= duration - window]
        first = first or [self.samples[0][1]]
        last = last or [self.samples[-1][1]]
        # A window's figure is the median of its 1 Hz samples: a sustained rise (a leak)
        # moves it, a transient peak (a profile export, a large batch) does not. The
        # means are reported too.
        first_mib = statistics.median(first) / 1024
        last_mib = statistics.median(last) / 1024
        first_mean = statistics.mean(first) / 1024
        last_mean = statistics.mean(last) / 1024

        def mib(series: list[tuple[float, int]], lo: float, hi: float) -> float | None:
            vals = [v for t, v in series if lo <= t <= hi]
            return round(statistics.median(vals) / 1024, 1) if vals else None

        role = {self.server_pid: "server"} if self.server_pid is not None else {}
        return {
            "available": True,
            "processes": len(self.pids()),
            "window_s": round(window, 1),
            "first_window_mib": round(first_mib, 1),
            "last_window_mib": round(last_mib, 1),
            "peak_mib": round(max(v for _, v in self.samples) / 1024, 1),
            "growth_pct": round((last_mib - first_mib) / first_mib * 100, 2),
            "first_window_mean_mib": round(first_mean, 1),
            "last_window_mean_mib": round(last_mean, 1),
            "growth_of_means_pct": round((last_mean - first_mean) / first_mean * 100, 2),
            "samples": len(self.samples),
            "by_process": {
                f"{role.get(pid, 'rank')}:{pid}": {
                    "first_window_mib": mib(series, 0, window),
                    "last_window_mib": mib(series, duration - window, duration + 1),
                }
                for pid, series in self.per_pid.items()
            },
            "series_mib": [(round(t, 1), round(v / 1024, 1)) for t, v in self.samples],
        }


# ---------------------------------------------------------------------- the run


@dataclass
class Prompt:
    ids: list[int]
    max_new: int
    reference: list[int] = field(default_factory=list)


@dataclass
class Tally:
    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    wrong: int = 0
    lost: int = 0
    tokens: int = 0
    by_mode: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)  # "CODE: details" -> count
    wrong_examples: list[dict[str, Any]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


@dataclass
class AdminTally:
    ok: int = 0
    refused: int = 0  # success=false answers (busy, timed out waiting for idle, ...)
    failed: int = 0
    skipped: int = 0
    messages: Counter = field(default_factory=Counter)


class Soak:
    def __init__(self, args: argparse.Namespace, target: str) -> None:
        self.args = args
        self.target = target
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.admin: dict[str, AdminTally] = {}
        self.notes: list[str] = []
        self.md = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
        admin_key = args.admin_api_key or args.api_key
        self.admin_md = (("authorization", f"Bearer {admin_key}"),) if admin_key else ()
        self.stop_at = 0.0
        self.t0 = 0.0
        self.prompts: list[Prompt] = []
        self.profile_unimplemented = False
        self.profiling = False
        self.profile_sessions = 0

    def log(self, text: str) -> None:
        if not self.args.quiet:
            print(f"[soak {time.monotonic() - self.t0:7.1f}s] {text}", flush=True)

    # ------------------------------------------------------------------ setup

    def make_prompts(self, vocab: int) -> None:
        shared = [self.rng.randrange(1, vocab) for _ in range(48)]
        for i in range(self.args.prompts):
            body = [self.rng.randrange(1, vocab) for _ in range(self.rng.randrange(4, 160))]
            ids = shared + body if i % 2 == 0 else body
            n = self.rng.randrange(self.args.min_new, self.args.max_new + 1)
            self.prompts.append(Prompt(ids, n))

    @staticmethod
    def request(prompt: Prompt, rid: str, stream: bool) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            request_id=rid,
            tokenized=pb.TokenizedInput(input_ids=prompt.ids),
            sampling_params=pb.SamplingParams(
                temperature=0.0, max_new_tokens=prompt.max_new, ignore_eos=True
            ),
            stream=stream,
        )

    async def references(self, stub: pb_grpc.SglangSchedulerStub) -> None:
        """Each prompt alone, greedy, non-streaming: the expected output."""
        for i, prompt in enumerate(self.prompts):
            resp = None
            async for r in stub.Generate(self.request(prompt, f"soak-ref-{i}", False),
                                         timeout=self.args.request_timeout, metadata=self.md):
                resp = r
            assert resp is not None and resp.HasField("complete")
            prompt.reference = list(resp.complete.output_ids)
            if len(prompt.reference) != prompt.max_new:
                raise RuntimeError(f"reference {i}: {len(prompt.reference)} tokens, "
                                   f"expected {prompt.max_new}")

    # ------------------------------------------------------------------ load

    async def one(self, stub: pb_grpc.SglangSchedulerStub, worker: int, seq: int,
                  rng: random.Random) -> None:
        t = self.tally
        idx = rng.randrange(len(self.prompts))
        prompt = self.prompts[idx]
        rid = f"soak-{worker}-{seq}"
        cancel = rng.random() < self.args.cancel_share
        mode = ("cancel" if rng.random() < 0.5 else "abort") if cancel else "plain"
        stream = cancel or rng.random() < 0.5
        cut = rng.randint(1, max(1, prompt.max_new // 2))  # tokens before cancelling
        t.by_mode[mode + ("-stream" if stream else "")] += 1
        t.started += 1
        t0 = time.monotonic()
        tokens: list[int] = []
        complete = None
        call = stub.Generate(self.request(prompt, rid, stream),
                             timeout=self.args.request_timeout, metadata=self.md)
        aborted = cancelled = False
        try:
            async for resp in call:
                if resp.HasField("chunk"):
                    tokens.extend(resp.chunk.token_ids)
                else:
                    complete = resp.complete
                if cancel and not (aborted or cancelled) and len(tokens) >= cut \
                        and complete is None:
                    if mode == "cancel":
                        call.cancel()
                        cancelled = True
                        break
                    ok = await stub.Abort(pb.AbortRequest(request_id=rid, reason="soak"),
                                          timeout=10, metadata=self.md)
                    aborted = ok.success
        except grpc.aio.AioRpcError as exc:
            t.failed += 1
            t.failures[f"{exc.code().name}: {exc.details()}"[:160]] += 1
            return
        except asyncio.CancelledError:
            if not cancelled:
                raise
        if not stream and complete is not None:
            tokens = list(complete.output_ids)
        t.tokens += len(tokens)
        ref = prompt.reference
        if cancelled or (complete is not None and complete.finish_reason == "abort"):
            t.cancelled += 1
            good = tokens == ref[: len(tokens)]
        elif complete is None:
            t.failed += 1
            t.failures["stream ended without a final message"] += 1
            return
        else:
            t.completed += 1
            t.latencies.append(time.monotonic() - t0)
            good = (tokens == ref and complete.finish_reason == "length"
                    and complete.completion_tokens == prompt.max_new)
        if not good:
            t.wrong += 1
            if len(t.wrong_examples) < 5:
                first_diff = next((k for k, (a, b) in enumerate(zip(tokens, ref)) if a != b),
                                  min(len(tokens), len(ref)))
                t.wrong_examples.append({
                    "rid": rid, "prompt": idx, "stream": stream, "mode": mode,
                    "got": len(tokens), "expected": len(ref), "first_difference": first_diff,
                    "finish_reason": complete.finish_reason if complete else None,
                })

    async def worker(self, stub: pb_grpc.SglangSchedulerStub, worker: int) -> None:
        rng = random.Random(self.args.seed * 100003 + worker)
        seq = 0
        while time.monotonic() < self.stop_at:
            if self.args.max_requests is not None and self.tally.started >= self.args.max_requests:
                return
            await self.one(stub, worker, seq, rng)
            seq += 1

    # ------------------------------------------------------------------ admin

    def admin_tally(self, op: str) -> AdminTally:
        return self.admin.setdefault(op, AdminTally())

    async def admin_call(self, op: str, coro) -> Any:
        a = self.admin_tally(op)
        try:
            resp = await coro
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED and op.endswith("profile"):
                a.skipped += 1
                if not self.profile_unimplemented:
                    self.profile_unimplemented = True
                    self.notes.append(f"{op}: UNIMPLEMENTED on this server "
                                      f"({exc.details()}); profile calls skipped")
                return None
            a.failed += 1
            a.messages[f"{exc.code().name}: {exc.details()}"[:160]] += 1
            return None
        success = getattr(resp, "success", True)
        if success:
            a.ok += 1
        else:
            a.refused += 1
            a.messages[resp.message[:160]] += 1
        return resp

    async def admin_loop(self, stub: pb_grpc.SglangSchedulerStub) -> None:
        if self.args.admin_interval <= 0:
            return
        i = 0
        md = self.admin_md
        while time.monotonic() < self.stop_at:
            await asyncio.sleep(self.args.admin_interval)
            op = ("flush", "server_info", "loads", "profile")[i % 4]
            i += 1
            if op == "flush":
                ft = self.args.flush_timeout
                await self.admin_call("flush_cache", stub.FlushCache(
                    pb.FlushCacheRequest(timeout_s=ft), timeout=ft + 45, metadata=md))
            elif op == "server_info":
                await self.admin_call("get_server_info", stub.GetServerInfo(
                    pb.GetServerInfoRequest(), timeout=10, metadata=self.md))
            elif op == "loads":
                await self.admin_call("get_loads", stub.GetLoads(
                    pb.GetLoadsRequest(include=["all"]), timeout=10, metadata=self.md))
            elif not self.profile_unimplemented and self.args.profile_mode != "off":
                if not self.profiling:
                    # Every other session stops by itself after a few steps; the others
                    # run until StopProfile, which exports the trace.
                    self.profile_sessions += 1
                    steps = self.args.profile_mode == "steps" or self.profile_sessions % 2
                    auto = {"num_steps": 5} if steps else {}
                    resp = await self.admin_call("start_profile", stub.StartProfile(
                        pb.StartProfileRequest(activities=["CPU"], with_stack=False,
                                               record_shapes=False, **auto),
                        timeout=120, metadata=md))
                    self.profiling = bool(resp is not None and resp.success)
                else:
                    # It may have stopped by itself after num_steps: "not in progress" is a
                    # refusal, not a failure.
                    await self.admin_call("stop_profile", stub.StopProfile(
                        pb.StopProfileRequest(), timeout=300, metadata=md))
                    self.profiling = False

    # ------------------------------------------------------------------ end state

    async def kv_state(self, stub: pb_grpc.SglangSchedulerStub) -> list[dict[str, int]]:
        info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10, metadata=self.md)
        return [
            {
                "rank": s.dp_rank,
                "running": s.num_running_reqs,
                "waiting": s.num_waiting_reqs,
                "used_tokens": s.num_used_tokens,
                "evictable_tokens": s.num_evictable_tokens,
                "held_tokens": s.num_used_tokens,
                "capacity": s.token_capacity,
                "pid": s.pid,
            }
            for s in info.rank_states
        ]

    async def wait_idle(self, stub: pb_grpc.SglangSchedulerStub,
                        timeout: float = 30.0) -> tuple[bool, list[dict[str, int]]]:
        deadline = time.monotonic() + timeout
        while True:
            ranks = await self.kv_state(stub)
            idle = all(r["running"] == 0 and r["waiting"] == 0 and r["held_tokens"] == 0
                       for r in ranks)
            if idle or time.monotonic() > deadline:
                return idle, ranks
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ main

    async def run(self, server_pid: int | None) -> dict[str, Any]:
        args = self.args
        self.t0 = time.monotonic()
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(self.target, options=options) as ch, \
                grpc.aio.insecure_channel(self.target, options=options) as admin_ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            admin_stub = pb_grpc.SglangSchedulerStub(admin_ch)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30,
                                           metadata=self.md)
            self.make_prompts(info.vocab_size)
            self.log(f"{len(self.prompts)} prompts; computing solo greedy references")
            await self.references(stub)
            flushed = await admin_stub.FlushCache(pb.FlushCacheRequest(timeout_s=10),
                                                  timeout=60, metadata=self.admin_md)
            if not flushed.success:
                self.notes.append(f"pre-run flush failed: {flushed.message}")
            ranks = await self.kv_state(stub)
            rss = RssSampler(server_pid or parent_of(ranks[0]["pid"]) if ranks else None,
                             [r["pid"] for r in ranks])
            self.log(f"load: {args.streams} streams for {args.duration:.0f}s")
            start = time.monotonic()
            self.stop_at = start + args.duration
            workers = [asyncio.create_task(self.worker(stub, w)) for w in range(args.streams)]
            admin = asyncio.create_task(self.admin_loop(admin_stub))
            while time.monotonic() < self.stop_at:
                rss.sample(time.monotonic() - start)
                await asyncio.sleep(min(1.0, max(0.0, self.stop_at - time.monotonic())))
                self.log(f"started={self.tally.started} completed={self.tally.completed} "
                         f"cancelled={self.tally.cancelled} failed={self.tally.failed} "
                         f"wrong={self.tally.wrong}")
            rss.sample(time.monotonic() - start)
            load_s = time.monotonic() - start
            done, pending = await asyncio.wait(workers + [admin],
                                               timeout=args.request_timeout + 15)
            for task in pending:  # lost: a call that never ended
                task.cancel()
            self.tally.lost = sum(1 for t in pending if t is not admin)
            for task in done:
                if task.exception() is not None:
                    self.notes.append(f"task error: {task.exception()!r}")
            drain_s = time.monotonic() - start - load_s
            idle, ranks_end = await self.wait_idle(stub)
            after_flush = await admin_stub.FlushCache(pb.FlushCacheRequest(timeout_s=10),
                                                      timeout=60, metadata=self.admin_md)
            ranks_flushed = await self.kv_state(stub)
        t = self.tally
        lat = sorted(t.latencies)
        return {
            "config": {
                "target": self.target, "streams": args.streams, "duration_s": args.duration,
                "max_requests": args.max_requests, "cancel_share": args.cancel_share,
                "admin_interval_s": args.admin_interval, "flush_timeout_s": args.flush_timeout,
                "prompts": args.prompts, "max_new": [args.min_new, args.max_new],
                "profile_mode": args.profile_mode,
                "seed": args.seed, "started_server": server_pid is not None,
            },
            "requests": {
                "started": t.started, "completed": t.completed, "cancelled": t.cancelled,
                "failed": t.failed, "wrong": t.wrong, "lost": t.lost,
                "by_mode": dict(t.by_mode), "failures": dict(t.failures),
                "wrong_examples": t.wrong_examples,
            },
            "throughput": {
                "load_s": round(load_s, 1), "drain_s": round(drain_s, 1),
                "output_tokens": t.tokens,
                "tokens_per_s": round(t.tokens / max(load_s + drain_s, 1e-9), 1),
                "requests_per_s": round((t.completed + t.cancelled) / max(load_s + drain_s, 1e-9),
                                        2),
                "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
                "latency_p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3)
                if lat else None,
            },
            "admin": {op: {k: v for k, v in asdict(a).items() if k != "messages"}
                      | {"messages": dict(a.messages)} for op, a in self.admin.items()},
            "kv": {
                "idle": idle,
                "ranks": ranks_end,
                "final_flush": {"success": after_flush.success,
                                "message": after_flush.message},
                # held or cached: a flush must empty the pool
                "used_tokens_after_flush": sum(r["used_tokens"] + r["evictable_tokens"]
                                               for r in ranks_flushed),
            },
            "rss": rss.summary(load_s, args.rss_window),
            "notes": self.notes,
        }


def verdict(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    problems = []
    r = report["requests"]
    for key in ("wrong", "lost", "failed"):
        if r[key]:
            problems.append(f"{r[key]} {key} request(s)")
    if r["completed"] == 0:
        problems.append("no request completed")
    for op, a in report["admin"].items():
        if a["failed"]:
            problems.append(f"{a['failed']} failed {op} call(s): {a['messages']}")
    if not report["kv"]["idle"]:
        problems.append(f"KV not back to idle: {report['kv']['ranks']}")
    rss = report["rss"]
    if rss.get("available") and args.duration >= 30 and rss["growth_pct"] >= args.max_rss_growth:
        problems.append(f"RSS grew {rss['growth_pct']}% (limit {args.max_rss_growth}%)")
    code = report.get("server_exit_code")
    if code not in (None, 0):
        problems.append(f"server exited with {code} on SIGTERM")
    return problems


def print_summary(report: dict[str, Any]) -> None:
    r, th, kv, rss = report["requests"], report["throughput"], report["kv"], report["rss"]
    print("== soak summary ==")
    print(f"requests: started {r['started']}  completed {r['completed']}  cancelled "
          f"{r['cancelled']}  failed {r['failed']}  wrong {r['wrong']}  lost {r['lost']}")
    print(f"throughput: {th['output_tokens']} output tokens, {th['tokens_per_s']} tok/s, "
          f"{th['requests_per_s']} req/s, latency p50 {th['latency_p50_s']}s "
          f"p99 {th['latency_p99_s']}s (load {th['load_s']}s, drain {th['drain_s']}s)")
    for op, a in report["admin"].items():
        print(f"admin {op}: ok {a['ok']}  refused {a['refused']}  failed {a['failed']}  "
              f"skipped {a['skipped']}")
    held = sum(x["held_tokens"] for x in kv["ranks"])
    print(f"kv: idle {kv['idle']}  held {held} tokens  cached(evictable) "
          f"{sum(x['evictable_tokens'] for x in kv['ranks'])}  used after flush "
          f"{kv['used_tokens_after_flush']}")
    if rss.get("available"):
        print(f"rss (server + ranks, {rss['processes']} processes, window medians): first "
              f"{rss['window_s']}s {rss['first_window_mib']} MiB, last {rss['window_s']}s "
              f"{rss['last_window_mib']} MiB, growth {rss['growth_pct']}% (of means "
              f"{rss['growth_of_means_pct']}%), peak {rss['peak_mib']} MiB")
    for note in report["notes"]:
        print(f"note: {note}")
    if report.get("server_exit_code") is not None:
        print(f"server exit code on SIGTERM: {report['server_exit_code']}")
    print("verdict:", "PASS" if not report["problems"] else "FAIL: " + "; ".join(report["problems"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    try:
        if args.target:
            target, server_pid = args.target, None
        else:
            server = OwnServer(args)
            if not args.quiet:
                print(f"[soak] starting a server on {server.target}", flush=True)
            server.wait_serving()
            target, server_pid = server.target, server.proc.pid
        soak = Soak(args, target)
        report = asyncio.run(soak.run(server_pid))
        if server is not None:
            report["server_exit_code"] = server.stop()
    finally:
        if server is not None:
            if server.exit_code is None:
                server.stop()
            if not args.server_log:
                server.cleanup()
    report["problems"] = verdict(report, args)
    report["passed"] = not report["problems"]
    print_summary(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
