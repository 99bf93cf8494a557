#!/usr/bin/env python3
"""A burst of Generate streams started at once against one worker, with what each call ended in.

    python tools/burst.py --target 127.0.0.1:30000 --streams 2000 --channels 1 --server-pid PID

``--streams`` greedy streams of ``--max-new-tokens`` tokens (EOS ignored) are started at
once by one grpc.aio client over ``--channels`` connections. While they run, a prober calls
HealthCheck, FlushCache(timeout_s=0) and GetLoads every ``--probe-interval`` seconds on its
own connection and records the slowest answer of each. The report (JSON) gives the count of
each final status with its distinct details, the calls that ended OK without all their
tokens, time to first token at the 50th and 99th percentile (of the calls that got one),
the wall time, the server's VmRSS before and at its largest (``--server-pid``, from /proc),
and whether every rank's KV pool is back to idle afterwards (GetLoads).

The client's channels carry ``CHANNEL_OPTIONS`` (see docs/bursts.md): no client-side
cap on concurrent streams and keepalive pings that a busy server will not refuse.
All traffic goes to the given loopback address only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc

from sglang_admin.client.client import CHANNEL_OPTIONS, OWN_CONNECTION
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tools.soak import check_loopback, rss_kib

PROMPT_TOKENS = 8
BURST_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, OWN_CONNECTION]


@dataclass
class BurstReport:
    """What one burst saw; times in seconds, memory in MiB."""

    streams: int
    channels: int
    max_new_tokens: int
    wall_s: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    details: dict[str, dict[str, int]] = field(default_factory=dict)  # status: {detail: n}
    short_ok: int = 0  # OK calls that did not carry all their tokens
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    health_max_s: float = 0.0
    flush_max_s: float = 0.0
    loads_max_s: float = 0.0  # GetLoads: answered from the server's own state, no rank trip
    probe_failures: list[str] = field(default_factory=list)
    rss_before_mib: float | None = None
    rss_max_mib: float | None = None
    pool_idle_after: bool | None = None
    loads_after: list[dict[str, int]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Every call ended OK (HTTP: 200) or was refused with a message (RESOURCE_EXHAUSTED;
        HTTP: 429 or 503), and every OK call carried all its tokens."""
        refusals = {"RESOURCE_EXHAUSTED", "429", "503"}
        return (set(self.statuses) <= {"OK", "200"} | refusals and self.short_ok == 0
                and all(d for k in refusals for d in self.details.get(k, [])))


def _request(seed: int, max_new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        tokenized=pb.TokenizedInput(
            input_ids=[(seed * 7 + i) % 200 + 1 for i in range(PROMPT_TOKENS)]),
        sampling_params=pb.SamplingParams(
            temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True),
        stream=True,
    )


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one_stream(stub: pb_grpc.SglangSchedulerStub, seed: int, max_new_tokens: int,
                      start: float, timeout: float) -> tuple[str, str, float | None, int]:
    """(status name, details, seconds to the first token or None, tokens received)."""
    tokens = 0
    first: float | None = None
    try:
        async for resp in stub.Generate(_request(seed, max_new_tokens), timeout=timeout):
            if resp.HasField("chunk"):
                if first is None and resp.chunk.token_ids:
                    first = time.monotonic() - start
                tokens += len(resp.chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or "", first, tokens
    return "OK", "", first, tokens


async def _probe(target: str, interval: float, stop: mp.synchronize.Event,
                 ready: mp.synchronize.Event) -> dict:
    """HealthCheck, FlushCache(timeout_s=0) and GetLoads on a connection of their own, timed,
    until ``stop`` is set (``ready`` after the first round); returns the slowest answer of
    each and the failures."""
    out: dict = {"health_max_s": 0.0, "flush_max_s": 0.0, "loads_max_s": 0.0,
                 "probe_failures": []}
    async with grpc.aio.insecure_channel(target, options=BURST_CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        while not stop.is_set():
            for key, call in (
                ("health_max_s",
                 lambda: stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)),
                ("flush_max_s",
                 lambda: stub.FlushCache(pb.FlushCacheRequest(timeout_s=0), timeout=10)),
                ("loads_max_s", lambda: stub.GetLoads(pb.GetLoadsRequest(), timeout=10)),
            ):
                t0 = time.monotonic()
                try:
                    await call()
                except grpc.aio.AioRpcError as exc:
                    out["probe_failures"].append(f"{key}: {exc.code().name} {exc.details()}")
                out[key] = max(out[key], time.monotonic() - t0)
            ready.set()
            await asyncio.sleep(interval)
    return out


def _probe_process(target: str, interval: float, stop: mp.synchronize.Event,
                   ready: mp.synchronize.Event, results: mp.Queue) -> None:
    results.put(asyncio.run(_probe(target, interval, stop, ready)))


async def _sample_rss(pid: int, stop: asyncio.Event, report: BurstReport) -> None:
    while not stop.is_set():
        kib = rss_kib(pid)
        if kib is not None:
            report.rss_max_mib = max(report.rss_max_mib or 0.0, kib / 1024)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


async def _one_http(host: str, port: int, body: bytes,
                    timeout: float) -> tuple[str, str, float | None, int]:
    """One POST /generate over HTTP/1.1: (HTTP status, body when not 200, None, tokens)."""
    head = (f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(head + body)
        raw = await asyncio.wait_for(reader.read(), timeout)
        writer.close()
    except (OSError, asyncio.TimeoutError) as exc:
        return f"no answer ({type(exc).__name__})", str(exc), None, 0
    status_line, _, rest = raw.partition(b"\r\n")
    parts = status_line.split()
    status = parts[1].decode() if len(parts) > 1 else "malformed"
    payload = rest.partition(b"\r\n\r\n")[2].decode(errors="replace")
    if status != "200":
        return status, payload[:300], None, 0
    try:
        answer = json.loads(payload)
    except json.JSONDecodeError:  # chunked transfer: take the JSON between the chunk sizes
        answer = json.loads(payload[payload.index("{"):payload.rindex("}") + 1])
    if isinstance(answer, list):
        answer = answer[0]
    tokens = answer.get("meta_info", {}).get("completion_tokens", len(answer.get("output_ids", [])))
    return status, "", None, int(tokens)


async def _http_burst(url: str, model: str, streams: int, max_new_tokens: int,
                      timeout: float) -> list[tuple[str, str, float | None, int]]:
    hostport = url.split("://", 1)[-1].rstrip("/")
    check_loopback(hostport)
    host, _, port = hostport.rpartition(":")
    calls = []
    for i in range(streams):
        body = json.dumps({
            "model": model,
            "input_ids": [(i * 7 + k) % 200 + 1 for k in range(PROMPT_TOKENS)],
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                "ignore_eos": True},
        }).encode()
        calls.append(_one_http(host, int(port), body, timeout))
    return await asyncio.gather(*calls)


async def _loads_after(target: str, report: BurstReport, settle_s: float) -> None:
    """Wait up to settle_s for every rank to hold no request; record the last loads."""
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        deadline = time.monotonic() + settle_s
        while True:
            loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
            report.loads_after = [
                {"dp_rank": ld.dp_rank, "running": ld.num_running_reqs,
                 "waiting": ld.num_waiting_reqs, "used_tokens": ld.num_used_tokens}
                for ld in loads.loads]
            idle = all(ld.num_running_reqs == 0 and ld.num_waiting_reqs == 0
                       for ld in loads.loads)
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        flushed = await stub.FlushCache(pb.FlushCacheRequest(timeout_s=5), timeout=15)
        loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
        report.pool_idle_after = idle and flushed.success and all(
            ld.num_used_tokens == 0 for ld in loads.loads)


async def run(target: str, streams: int, channels: int = 1, max_new_tokens: int = 32,
              server_pid: int | None = None, timeout: float = 600.0,
              probe_interval: float = 0.25, http: str | None = None,
              model: str = "") -> BurstReport:
    """Start ``streams`` Generate calls at once over ``channels`` connections (or as many
    POST /generate to the gateway at ``http``); report."""
    check_loopback(target)
    report = BurstReport(streams, channels, max_new_tokens)
    if server_pid is not None:
        kib = rss_kib(server_pid)
        report.rss_before_mib = kib / 1024 if kib is not None else None
    ctx = mp.get_context("spawn")
    probe_stop, probe_ready = ctx.Event(), ctx.Event()
    probe_results: mp.Queue = ctx.Queue()
    prober = ctx.Process(target=_probe_process,
                         args=(target, probe_interval, probe_stop, probe_ready, probe_results))
    prober.start()
    await asyncio.to_thread(probe_ready.wait, 60)
    stop = asyncio.Event()
    side = []
    if server_pid is not None:
        side.append(asyncio.create_task(_sample_rss(server_pid, stop, report)))
    chans = [grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
             for _ in range(channels)]
    try:
        stubs = [pb_grpc.SglangSchedulerStub(ch) for ch in chans]
        start = time.monotonic()
        if http:
            results = await _http_burst(http, model, streams, max_new_tokens, timeout)
        else:
            results = await asyncio.gather(*(
                _one_stream(stubs[i % channels], i, max_new_tokens, start, timeout)
                for i in range(streams)))
        report.wall_s = time.monotonic() - start
    finally:
        stop.set()
        probe_stop.set()
        await asyncio.gather(*side)
        for ch in chans:
            await ch.close()
    probed = await asyncio.to_thread(probe_results.get, True, 60)
    prober.join(10)
    report.health_max_s = probed["health_max_s"]
    report.flush_max_s = probed["flush_max_s"]
    report.loads_max_s = probed["loads_max_s"]
    report.probe_failures = probed["probe_failures"][:10]
    counts: Counter[str] = Counter()
    details: dict[str, Counter[str]] = defaultdict(Counter)
    ttfts: list[float] = []
    for status, detail, first, tokens in results:
        counts[status] += 1
        if status not in ("OK", "200"):
            details[status][detail] += 1
        elif tokens != max_new_tokens:
            report.short_ok += 1
        if first is not None:
            ttfts.append(first)
    report.statuses = dict(counts)
    report.details = {k: dict(v.most_common(5)) for k, v in details.items()}
    report.ttft_p50_s = _percentile(ttfts, 0.50)
    report.ttft_p99_s = _percentile(ttfts, 0.99)
    await _loads_after(target, report, settle_s=30.0)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="127.0.0.1:30000")
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--server-pid", type=int, help="the server's pid, for its VmRSS")
    p.add_argument("--timeout", type=float, default=600.0, help="each call's deadline (s)")
    p.add_argument("--probe-interval", type=float, default=0.25)
    p.add_argument("--http", help="the gateway's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", default="", help="with --http: the model id the gateway serves")
    a = p.parse_args(argv)
    report = asyncio.run(run(a.target, a.streams, a.channels, a.max_new_tokens,
                             a.server_pid, a.timeout, a.probe_interval, a.http, a.model))
    print(json.dumps({**asdict(report), "clean": report.clean}, indent=1))
    return 0 if report.clean and report.pool_idle_after else 1


if __name__ == "__main__":
    sys.exit(main())
