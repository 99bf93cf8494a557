"""tools/bench_served.py's client against a live worker: every token of the workload comes
back, with all streams at once or a few at a time, and the rank's decode-step phases are
read from GetMetrics."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ServerProc
from tools import bench_served
from tools.workloads import Workload


@pytest.fixture(scope="module")
def metrics_server(dp2_server: ServerProc) -> ServerProc:
    """The session's dp 2 worker (--enable-metrics): the tests read deltas of its figures."""
    return dp2_server


@pytest.mark.parametrize("concurrency", [0, 2])
def test_the_client_receives_every_token(metrics_server: ServerProc, concurrency: int) -> None:
    work = Workload("small", [[1, 2, 3, 4] * (i + 1) for i in range(6)], [3, 5, 1, 8, 2, 6])
    out = asyncio.run(bench_served._drive(metrics_server.target, work, concurrency))
    assert out["tokens"] == work.output_tokens
    assert out["seconds"] > 0


def idle(target: str) -> bool:
    """No request running or waiting on any rank (an earlier test's stream that its client
    dropped may still decode until its abort reaches the rank)."""
    with grpc.insecure_channel(target) as ch:
        loads = pb_grpc.SglangSchedulerStub(ch).GetLoads(pb.GetLoadsRequest(), timeout=30)
    return all(load.num_total_reqs == 0 for load in loads.loads)


def settled(target: str, at_least_steps: float = 0.0) -> dict[str, float]:
    """The decode phases once the ranks are idle and published their state after their last
    step: two reads 0.3 s apart agree and at least ``at_least_steps`` steps are counted (a
    loaded rank may publish a step's figures later than 0.3 s, and an earlier module's
    dropped stream may decode on until its abort arrives: 60 s at most)."""
    deadline = time.monotonic() + 60
    last = bench_served._step_timing(target)
    while True:
        time.sleep(0.3)
        now = bench_served._step_timing(target)
        if (now == last and now.get("steps", 0.0) >= at_least_steps and idle(target)) \
                or time.monotonic() > deadline:
            return now
        last = now


def test_the_rank_reports_its_decode_phases(metrics_server: ServerProc) -> None:
    """Each phase of the workload's decode steps is measured (more than nothing), and
    together they fit in the time the workload took (seconds, counted once): at most that
    time on each of the worker's two ranks."""
    work = Workload("small", [[5, 6, 7]] * 4, [6] * 4)
    before = settled(metrics_server.target)
    started = time.perf_counter()
    asyncio.run(bench_served._drive(metrics_server.target, work))
    elapsed = time.perf_counter() - started
    after = settled(metrics_server.target, before.get("steps", 0.0) + 5)
    assert set(after) == {"steps", "schedule", "prepare", "model", "sample", "postprocess",
                          "output"}
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    # 4 streams of 6 tokens on 2 ranks: the first token of each comes from its prefill, the
    # other 5 from decode steps (shared by the streams a rank runs together; 20 if none is)
    assert 5 <= delta.pop("steps") <= 20
    assert all(v > 0 for v in delta.values()), delta
    assert sum(delta.values()) < 2 * elapsed, (delta, elapsed)
