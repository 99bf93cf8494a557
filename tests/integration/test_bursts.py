"""A burst of Generate streams started at once: every call is served or refused with
RESOURCE_EXHAUSTED and a message, none dropped as CANCELLED (issue 36).

Before, grpc core dropped the calls it held for the application past its pending-request
backlog (1000 to 3000 calls) and they reached the client as CANCELLED "CANCELLED", unseen by
the server. Now every call reaches the servicer and admission (server/admission.py) refuses
what is past --max-inflight-generate at once, while health, loads and admin ops answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from sglang_admin.client.client import CHANNEL_OPTIONS, OWN_CONNECTION
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ServerProc, greedy, start_server
from tools import burst

LIMIT = 64  # --max-inflight-generate of the module's worker
BURST = LIMIT + 32
TOKENS = 16


@pytest.fixture(scope="module")
def burst_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One dp 2 worker with --max-inflight-generate LIMIT for both bursts (each leaves it
    idle: nothing in flight, no pause on); it stops cleanly at the end."""
    srv = start_server(tmp_path_factory.mktemp("bursts"), "--dp-size", "2",
                       "--max-inflight-generate", str(LIMIT), "--log-requests")
    try:
        yield srv
    finally:
        assert srv.stop() == 0


async def _stream(stub: pb_grpc.SglangSchedulerStub, seed: int) -> tuple[str, str, int]:
    tokens = 0
    try:
        async for resp in stub.Generate(greedy([seed % 200 + 1, 5, 6, 7], TOKENS, stream=True),
                                        timeout=120):
            if resp.HasField("chunk"):
                tokens += len(resp.chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or "", tokens
    return "OK", "", tokens


async def _held_burst(target: str) -> None:
    async with grpc.aio.insecure_channel(target, options=[*CHANNEL_OPTIONS, OWN_CONNECTION]) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        # A pause holds what is admitted, so exactly LIMIT calls stay in flight.
        paused = await stub.PauseGeneration(pb.PauseGenerationRequest(mode="in_place"),
                                            timeout=30)
        assert paused.success, paused.message
        calls = [asyncio.ensure_future(_stream(stub, i)) for i in range(BURST)]
        deadline = time.monotonic() + 60
        while sum(c.done() for c in calls) < BURST - LIMIT:
            assert time.monotonic() < deadline, "the refused calls did not end"
            await asyncio.sleep(0.05)
        refused = [c.result() for c in calls if c.done()]
        assert len(refused) == BURST - LIMIT
        for status, details, tokens in refused:
            assert status == "RESOURCE_EXHAUSTED", (status, details)
            assert f"{LIMIT} Generate calls in flight, the limit is {LIMIT}" in details, details
            assert "--max-inflight-generate" in details and tokens == 0
        # The worker keeps answering everything but Generate while it is full.
        t0 = time.monotonic()
        health = await stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
        loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
        flush = await stub.FlushCache(pb.FlushCacheRequest(timeout_s=0), timeout=5)
        assert time.monotonic() - t0 < 5
        assert health.healthy
        while sum(ld.num_running_reqs + ld.num_waiting_reqs for ld in loads.loads) < LIMIT:
            assert time.monotonic() < deadline, loads  # the ranks publish their loads often
            await asyncio.sleep(0.2)
            loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
        assert sum(ld.num_running_reqs + ld.num_waiting_reqs for ld in loads.loads) == LIMIT
        # GetLoads with no include answers every section: the paused queue holds them all
        assert sum(ld.queues.paused for ld in loads.loads) == LIMIT
        assert all(ld.HasField("memory") and ld.memory.graph_gb == 0 for ld in loads.loads)
        assert flush.message  # answered (held calls are queued: they hold no KV)
        one_more = await _stream(stub, 99)
        assert one_more[0] == "RESOURCE_EXHAUSTED", one_more
        assert (await stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30)).success
        served = await asyncio.gather(*calls)
        assert sorted(s for s, _, _ in served).count("OK") == LIMIT
        assert all(t == TOKENS for s, _, t in served if s == "OK")
        # Their places are free again, and the KV pool is back to idle.
        assert (await _stream(stub, 100))[0] == "OK"
        assert (await stub.FlushCache(pb.FlushCacheRequest(timeout_s=10), timeout=30)).success
        loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
        assert all(ld.num_used_tokens == 0 and ld.num_running_reqs == 0 for ld in loads.loads)
        assert all(ld.queues.paused == 0 for ld in loads.loads)  # no longer paused


def test_burst_past_the_limit_is_refused_with_a_message(burst_server: ServerProc) -> None:
    asyncio.run(_held_burst(burst_server.target))
    log = burst_server.log()
    assert "refused" in log and "RESOURCE_EXHAUSTED" in log


@pytest.mark.long
def test_burst_past_grpc_core_backlog_is_never_cancelled(burst_server: ServerProc) -> None:
    """3500 calls at once (grpc core's default backlog drops everything past 3000)."""
    report = asyncio.run(burst.run(burst_server.target, streams=3500, channels=1,
                                   max_new_tokens=2, timeout=120, probe_interval=0.5))
    assert set(report.statuses) <= {"OK", "RESOURCE_EXHAUSTED"}, report.statuses
    assert report.statuses.get("OK", 0) >= LIMIT and report.short_ok == 0
    assert report.clean and report.pool_idle_after, report
    assert not report.probe_failures, report.probe_failures
