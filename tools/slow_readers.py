#!/usr/bin/env python3
"""Slow and stalled readers against one worker, with the server's memory sampled.

    python tools/slow_readers.py --target 127.0.0.1:30000 --server-pid PID --seconds 90

``--slow`` streams read one message every ``--read-interval`` seconds and ``--stalled``
streams never read; each asks for ``--max-new-tokens`` greedy tokens (EOS ignored) and a
slow reader starts a new request when one ends (a slow reader still reading when the time
is up is counted "still reading at the end"). The server's VmRSS (from /proc, so the
server must run on this machine) is sampled every second. At the end every stalled
stream is read for up to 20 s to learn its status ("still running at the end" when it was
neither aborted nor finished by then). Prints one JSON report (statuses per kind,
RSS at start / max / end in MiB) and exits 1 when the server is no longer SERVING.
All traffic goes to the given loopback address only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tools.soak import check_loopback, rss_kib

MAX_SECONDS = 3600.0
DRAIN_S = 20.0  # how long the stalled calls are read at the end before they are cancelled
SETTLE_S = 3.0  # after every call ended, before the last RSS sample


@dataclass
class SlowReadersReport:
    """What a run saw: final statuses per reader kind, the server's RSS (MiB), the healthy
    streams' token rate beside the slow ones, and how a short probe call fared."""

    seconds: float
    top_logprobs: int = 0
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)
    rss_start_mib: float = 0.0
    rss_max_mib: float = 0.0
    rss_end_mib: float = 0.0  # when the time was up (the slow calls still open)
    rss_after_mib: float = 0.0  # every call ended, SETTLE_S later
    healthy_tokens_per_s_alone: float = 0.0  # the healthy streams before the slow ones start
    healthy_tokens_per_s_beside: float = 0.0  # the same streams while the slow ones run
    probes_ok: int = 0
    probes_failed: int = 0
    probe_max_s: float = 0.0
    probe_median_s: float = 0.0
    serving_after: bool = False

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_end_mib - self.rss_start_mib

    @property
    def rss_max_growth_mib(self) -> float:
        return self.rss_max_mib - self.rss_start_mib

    @property
    def healthy_rate_ratio(self) -> float:
        """Token rate of the healthy streams beside the slow ones / alone (1: unaffected)."""
        alone = self.healthy_tokens_per_s_alone
        return self.healthy_tokens_per_s_beside / alone if alone else 0.0


def _request(prompt_seed: int, max_new_tokens: int, top_logprobs: int = 0) -> pb.GenerateRequest:
    """A greedy streaming request; ``top_logprobs`` > 0 asks for the logprobs of each
    token and its ``top_logprobs`` best alternatives (a logprob-heavy stream)."""
    return pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[(prompt_seed * 7 + i) % 200 + 1 for i in range(8)]),
        sampling_params=pb.SamplingParams(
            temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True
        ),
        stream=True,
        return_logprob=top_logprobs > 0,
        top_logprobs_num=top_logprobs,
    )


def _status(exc: grpc.RpcError | None) -> str:
    return "OK" if exc is None else exc.code().name  # type: ignore[union-attr]


def _rss(server_pid: int | None) -> int | None:
    return rss_kib(server_pid) if server_pid is not None else None


def run(
    target: str,
    seconds: float,
    slow: int = 8,
    stalled: int = 8,
    max_new_tokens: int = 8000,
    read_interval: float = 1.0,
    server_pid: int | None = None,
    client_window: int | None = None,
    top_logprobs: int = 0,
    healthy: int = 0,
    healthy_alone_s: float = 10.0,
    probe_interval: float = 0.0,
    drain_s: float = DRAIN_S,
) -> SlowReadersReport:
    """Run the readers for `seconds` against `target` (loopback only) and report.

    `client_window` (bytes) shrinks the readers' HTTP/2 receive window (and turns off
    its growth), so a stalled reader stalls the server's writes after a few messages;
    None keeps grpc's default client settings. `top_logprobs` > 0 makes every slow and
    stalled stream logprob-heavy. `healthy` streams (on their own channel, reading as fast
    as they can, same request kind) run `healthy_alone_s` alone first and then beside the
    slow ones: their token rates give ``healthy_rate_ratio``. `probe_interval` > 0 sends a
    short Generate (8 tokens, own channel) that often and records how each fared.
    `drain_s`: how long the stalled calls are read at the end to learn how they ended
    (0: cancelled at once; their statuses then say "still running at the end")."""
    check_loopback(target)
    report = SlowReadersReport(seconds=seconds, top_logprobs=top_logprobs)
    counts: dict[str, Counter] = {"slow": Counter(), "stalled": Counter()}
    lock = threading.Lock()
    stop = threading.Event()
    stop_healthy = threading.Event()
    samples: list[int] = []
    options = []
    if client_window:
        options = [("grpc.http2.lookahead_bytes", client_window), ("grpc.http2.bdp_probe", 0)]
    channel = grpc.insecure_channel(target, options=options)
    stub = pb_grpc.SglangSchedulerStub(channel)
    healthy_channel = grpc.insecure_channel(target)
    healthy_stub = pb_grpc.SglangSchedulerStub(healthy_channel)
    healthy_tokens: list[tuple[float, int]] = []  # (monotonic time, tokens) per message

    def record(kind: str, status: str) -> None:
        with lock:
            counts[kind][status] += 1

    def healthy_reader(i: int) -> None:
        seq = 0
        while not stop_healthy.is_set():
            seq += 1
            call = healthy_stub.Generate(
                _request(50_000 + i * 1000 + seq, max_new_tokens, top_logprobs),
                timeout=seconds + healthy_alone_s + 120)
            try:
                for resp in call:
                    got = len(resp.chunk.token_ids) + len(resp.complete.output_ids)
                    with lock:
                        healthy_tokens.append((time.monotonic(), got))
                    if stop_healthy.is_set():
                        call.cancel()
                        break
            except grpc.RpcError:
                pass

    def healthy_rate(t0: float, t1: float) -> float:
        with lock:
            got = sum(n for t, n in healthy_tokens if t0 <= t < t1)
        return got / (t1 - t0) if t1 > t0 else 0.0

    probe_times: list[float] = []

    def prober() -> None:
        with grpc.insecure_channel(target) as ch:
            probe_stub = pb_grpc.SglangSchedulerStub(ch)
            seq = 0
            while not stop.wait(probe_interval):
                seq += 1
                began = time.monotonic()
                try:
                    for _ in probe_stub.Generate(_request(90_000 + seq, 8), timeout=30):
                        pass
                    report.probes_ok += 1
                except grpc.RpcError:
                    report.probes_failed += 1
                probe_times.append(time.monotonic() - began)
                report.probe_max_s = max(report.probe_max_s, probe_times[-1])

    def slow_reader(i: int) -> None:
        seq = 0
        while not stop.is_set():
            seq += 1
            call = stub.Generate(_request(i * 1000 + seq, max_new_tokens, top_logprobs),
                                 timeout=seconds + 120)
            try:
                for _ in call:
                    if stop.wait(read_interval):
                        call.cancel()
                        record("slow", "still reading at the end")
                        break
                else:
                    record("slow", "OK")
                    continue
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    record("slow", _status(exc))
                continue

    healthy_threads = [threading.Thread(target=healthy_reader, args=(i,), daemon=True)
                       for i in range(healthy)]
    for t in healthy_threads:
        t.start()
    t_alone = time.monotonic()
    if healthy:
        time.sleep(healthy_alone_s)
    t_beside = time.monotonic()
    first = _rss(server_pid)
    if first is not None:
        samples.append(first)
    stalled_calls = [
        stub.Generate(_request(10_000 + i, max_new_tokens, top_logprobs), timeout=seconds + 120)
        for i in range(stalled)
    ]
    threads = [threading.Thread(target=slow_reader, args=(i,), daemon=True) for i in range(slow)]
    if probe_interval > 0:
        threads.append(threading.Thread(target=prober, daemon=True))
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        time.sleep(1.0)
        kib = _rss(server_pid)
        if kib is not None:
            samples.append(kib)
    t_end = time.monotonic()
    stop.set()
    stop_healthy.set()
    if healthy:
        report.healthy_tokens_per_s_alone = round(healthy_rate(t_alone, t_beside), 1)
        report.healthy_tokens_per_s_beside = round(healthy_rate(t_beside, t_end), 1)
    for t in threads + healthy_threads:
        t.join(read_interval + 30)
    # Read what piled up, to learn how each stalled call ended; one still generating after
    # drain_s is cancelled and counted as such.
    timers = [threading.Timer(drain_s, call.cancel) for call in stalled_calls]
    for timer in timers:
        timer.start()
    for call in stalled_calls:
        try:
            for _ in call:
                pass
            record("stalled", "OK")
        except grpc.RpcError as exc:
            status = _status(exc)
            record("stalled", "still running at the end" if status == "CANCELLED" else status)
    for timer in timers:
        timer.cancel()
    with grpc.insecure_channel(target) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            report.serving_after = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            report.serving_after = False
    channel.close()
    healthy_channel.close()
    report.statuses = {k: dict(v) for k, v in counts.items()}
    if probe_times:
        report.probe_median_s = round(statistics.median(probe_times), 2)
    if samples:
        report.rss_start_mib = samples[0] / 1024
        report.rss_max_mib = max(samples) / 1024
        report.rss_end_mib = samples[-1] / 1024
        time.sleep(SETTLE_S)
        kib = _rss(server_pid)
        report.rss_after_mib = (kib or 0) / 1024
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HOST:PORT of a worker (loopback only)")
    p.add_argument("--server-pid", type=int, help="pid of the server process (for its RSS)")
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--slow", type=int, default=8, help="streams reading one message a second")
    p.add_argument("--stalled", type=int, default=8, help="streams that never read")
    p.add_argument("--max-new-tokens", type=int, default=8000)
    p.add_argument("--read-interval", type=float, default=1.0)
    p.add_argument("--client-window", type=int,
                   help="readers' HTTP/2 receive window, bytes (default: grpc's own settings)")
    p.add_argument("--top-logprobs", type=int, default=0,
                   help="top_logprobs_num of every stream (0: tokens only; >0 also sets "
                        "return_logprob): logprob-heavy streams")
    p.add_argument("--healthy", type=int, default=0,
                   help="streams reading as fast as they can, for the token-rate ratio")
    p.add_argument("--healthy-alone", type=float, default=10.0,
                   help="seconds the healthy streams run alone first")
    p.add_argument("--probe-interval", type=float, default=1.0,
                   help="seconds between short probe Generate calls (0: none)")
    ns = p.parse_args(argv)
    if not 0 < ns.seconds <= MAX_SECONDS:
        p.error(f"--seconds must be in (0, {MAX_SECONDS:g}]")
    if not (0 <= ns.slow <= 256 and 0 <= ns.stalled <= 256 and 0 <= ns.healthy <= 64):
        p.error("--slow and --stalled must be in 0..256, --healthy in 0..64")
    if not 0 <= ns.top_logprobs <= 100:
        p.error("--top-logprobs must be in 0..100")
    try:
        report = run(ns.target, ns.seconds, ns.slow, ns.stalled, ns.max_new_tokens,
                     ns.read_interval, ns.server_pid, ns.client_window, ns.top_logprobs,
                     ns.healthy, ns.healthy_alone, ns.probe_interval)
    except ValueError as exc:
        p.error(str(exc))
    out = asdict(report) | {
        "rss_growth_mib": round(report.rss_growth_mib, 1),
        "rss_max_growth_mib": round(report.rss_max_growth_mib, 1),
        "rss_after_growth_mib": round(report.rss_after_mib - report.rss_start_mib, 1),
        "healthy_rate_ratio": round(report.healthy_rate_ratio, 2),
    }
    print(json.dumps(out, indent=2))
    return 0 if report.serving_after else 1


if __name__ == "__main__":
    raise SystemExit(main())
