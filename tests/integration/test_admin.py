"""Admin ops across two data-parallel ranks: flush semantics, aggregation, server state."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, greedy, run_generate


@pytest.fixture(scope="module")
def dp2(dp2_server: ServerProc) -> ServerProc:
    """The session's dp 2 worker (--log-requests). A rank is stopped for a few seconds
    below to miss an admin call's deadline; its --watchdog-probe-timeout of 120 (the
    watchdog ends the server after that much silence, see test_metrics.py) gives the rank
    room to come back to a live server."""
    assert "--log-requests" in dp2_server.extra_args
    assert dp2_server.extra_args[dp2_server.extra_args.index("--watchdog-probe-timeout") + 1] \
        == "120"
    return dp2_server


def rank_pids(srv: ServerProc) -> dict[int, int]:
    info = srv.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return {s.dp_rank: s.pid for s in info.rank_states}


def wait_idle(stub, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        if all(s.num_running_reqs == 0 and s.num_waiting_reqs == 0 for s in info.rank_states):
            return
        time.sleep(0.05)
    raise TimeoutError("server did not go idle")


def test_generate_pins_ranks_and_refuses_out_of_range(dp2: ServerProc) -> None:
    stub = dp2.stub()
    for rank in (0, 1):
        tokens, _ = run_generate(stub, greedy([5, 6, 7], 4, data_parallel_rank=rank), timeout=60)
        assert len(tokens) == 4
    with pytest.raises(grpc.RpcError) as err:
        run_generate(stub, greedy([5, 6, 7], 4, data_parallel_rank=2), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "data_parallel_rank" in err.value.details()


def test_flush_idle_reports_tokens_freed_per_rank(dp2: ServerProc) -> None:
    stub = dp2.stub()
    for rank in (0, 1):
        run_generate(stub, greedy(list(range(1, 40)), 5, data_parallel_rank=rank), timeout=60)
    resp = stub.FlushCache(pb.FlushCacheRequest(), timeout=30)
    assert resp.success, resp.message
    assert resp.message == "Cache flushed successfully"
    assert [r.dp_rank for r in resp.rank_results] == [0, 1]
    assert all(r.success and r.tokens_freed > 0 for r in resp.rank_results)
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert all(s.num_used_tokens == 0 for s in info.rank_states)
    # The next identical prompt finds nothing cached.
    _, complete = run_generate(
        stub, greedy(list(range(1, 40)), 5, data_parallel_rank=0), timeout=60
    )
    assert complete.cached_tokens == 0
    _, again = run_generate(stub, greedy(list(range(1, 40)), 5, data_parallel_rank=0), timeout=60)
    assert again.cached_tokens >= 38


def _long_stream(stub, rank: int, n: int, results: list, rid: str) -> None:
    tokens, complete = run_generate(
        stub, greedy([rank + 3] * 20, n, data_parallel_rank=rank, stream=True, request_id=rid),
        timeout=120,
    )
    results.append((rid, tokens, complete))


def test_flush_busy_without_timeout_fails_with_counts(dp2: ServerProc) -> None:
    stub = dp2.stub()
    results: list = []
    t = threading.Thread(target=_long_stream, args=(stub, 1, 400, results, "busy-1"))
    t.start()
    try:
        deadline = time.time() + 20
        while time.time() < deadline:
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            if info.rank_states[1].num_running_reqs:
                break
        resp = stub.FlushCache(pb.FlushCacheRequest(timeout_s=0), timeout=30)
        assert not resp.success
        assert "rank 1" in resp.message
        assert "#running-req: 1" in resp.message
        by_rank = {r.dp_rank: r for r in resp.rank_results}
        assert by_rank[0].success and not by_rank[1].success
        assert "Cache not flushed because there are pending requests" in by_rank[1].message
    finally:
        stub.Abort(pb.AbortRequest(request_id="busy-1"), timeout=5)
        t.join(60)
    wait_idle(stub)


def test_flush_with_timeout_waits_for_streams_which_finish_intact(dp2: ServerProc) -> None:
    stub = dp2.stub()
    expected = {
        rank: run_generate(stub, greedy([rank + 3] * 20, 60, data_parallel_rank=rank), timeout=120)[0]
        for rank in (0, 1)
    }
    results: list = []
    threads = [
        threading.Thread(target=_long_stream, args=(stub, rank, 60, results, f"intact-{rank}"))
        for rank in (0, 1)
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)
    resp = stub.FlushCache(pb.FlushCacheRequest(timeout_s=60), timeout=120)
    # A request that arrives while the flush waits is queued, then runs after the flush.
    late = run_generate(stub, greedy([9, 9, 9], 3), timeout=60)
    for t in threads:
        t.join(120)
    assert resp.success, resp.message
    assert len(late[0]) == 3
    for rid, tokens, complete in results:
        rank = int(rid.split("-")[1])
        assert tokens == expected[rank], rid
        assert complete.finish_reason == "length"


def test_double_pending_flush_is_refused(dp2: ServerProc) -> None:
    stub = dp2.stub()
    results: list = []
    t = threading.Thread(target=_long_stream, args=(stub, 0, 4000, results, "double-0"))
    t.start()
    time.sleep(0.3)
    with cf.ThreadPoolExecutor(2) as pool:
        first = pool.submit(stub.FlushCache, pb.FlushCacheRequest(timeout_s=60), timeout=120)
        time.sleep(0.3)
        second = stub.FlushCache(pb.FlushCacheRequest(timeout_s=60), timeout=120)
        assert not second.success
        assert "rank 0: Another flush_cache is already in progress." in second.message
        # Ending the stream lets the first flush go through.
        stub.Abort(pb.AbortRequest(request_id="double-0"), timeout=5)
        assert first.result().success
    t.join(120)


def test_flush_times_out_waiting_for_idle(dp2: ServerProc) -> None:
    stub = dp2.stub()
    results: list = []
    t = threading.Thread(target=_long_stream, args=(stub, 0, 3000, results, "slow-0"))
    t.start()
    try:
        time.sleep(0.3)
        resp = stub.FlushCache(pb.FlushCacheRequest(timeout_s=0.5), timeout=60)
        assert not resp.success
        assert "Timed out waiting for idle state." in resp.message
    finally:
        stub.Abort(pb.AbortRequest(request_id="slow-0"), timeout=5)
        t.join(60)
    wait_idle(stub)


def test_server_info_and_loads_show_both_ranks(dp2: ServerProc) -> None:
    stub = dp2.stub()
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.server_type == "grpc"
    assert [s.dp_rank for s in info.rank_states] == [0, 1]
    assert all(s.token_capacity > 0 and s.pid > 0 for s in info.rank_states)
    assert len({s.pid for s in info.rank_states}) == 2
    args = info.server_args
    for key in (
        "model_path", "served_model_name", "tokenizer_path", "tp_size", "dp_size", "pp_size",
        "context_length", "max_total_tokens", "max_running_requests", "load_balance_method",
        "disaggregation_mode", "is_embedding", "vocab_size", "weight_version",
    ):
        assert key in args, key
    assert args["dp_size"] == 2
    assert info.max_total_num_tokens > 0 and info.uptime_seconds > 0
    loads = stub.GetLoads(pb.GetLoadsRequest(include=["all"]), timeout=10)
    assert loads.dp_rank_count == 2 and [x.dp_rank for x in loads.loads] == [0, 1]
    assert loads.loads[0].HasField("memory") and loads.loads[0].memory.token_capacity > 0
    # as SGLang: no speculative or lora section while those features are off
    assert not loads.loads[0].HasField("speculative") and not loads.loads[0].HasField("lora")
    one = stub.GetLoads(pb.GetLoadsRequest(dp_rank=1), timeout=10)
    assert [x.dp_rank for x in one.loads] == [1]
    with pytest.raises(grpc.RpcError) as err:
        stub.GetLoads(pb.GetLoadsRequest(include=["bogus"]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bogus" in err.value.details()


def test_concurrent_server_info_calls_all_answer(dp2: ServerProc) -> None:
    stub = dp2.stub()
    with cf.ThreadPoolExecutor(32) as pool:
        futures = [
            pool.submit(stub.GetServerInfo, pb.GetServerInfoRequest(), timeout=30)
            for _ in range(100)
        ]
        infos = [f.result() for f in futures]
    assert all(len(i.rank_states) == 2 for i in infos)


def test_a_rank_that_does_not_answer_is_named(dp2: ServerProc) -> None:
    stub = dp2.stub()
    pid = rank_pids(dp2)[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.FlushCache(pb.FlushCacheRequest(timeout_s=0), timeout=2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "rank 1" in err.value.details()
        health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
        assert not health.healthy and "rank 1" in health.message
    finally:
        os.kill(pid, signal.SIGCONT)
    # The late replies of the timed-out calls are dropped, not taken by the next call.
    time.sleep(0.5)
    resp = stub.FlushCache(pb.FlushCacheRequest(timeout_s=5), timeout=30)
    assert resp.success and len(resp.rank_results) == 2
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
    assert "dropping late reply from rank 1" in dp2.log()


def test_torch_empty_cache_reaches_every_rank(dp2: ServerProc, tmp_path_factory) -> None:
    """ContinueGeneration's and UpdateWeightsFromDisk's torch_empty_cache is carried to each
    rank, which hands its cached memory back (and says so in the log); unset, it is not."""
    stub = dp2.stub()
    line = "cached memory handed back (torch_empty_cache)"

    def said() -> int:
        return dp2.log().count(line)

    before = said()
    assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
    assert stub.ContinueGeneration(
        pb.ContinueGenerationRequest(torch_empty_cache=False), timeout=30).success
    time.sleep(0.5)
    assert said() == before
    assert stub.ContinueGeneration(
        pb.ContinueGenerationRequest(torch_empty_cache=True), timeout=30).success
    deadline = time.time() + 10
    while said() < before + 2 and time.time() < deadline:
        time.sleep(0.1)
    assert said() == before + 2  # once per rank
    for rank in (0, 1):
        assert f"rank {rank}: {line}" in dp2.log()
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    resp = stub.UpdateWeightsFromDisk(pb.UpdateWeightsFromDiskRequest(
        model_path=info.model_path, torch_empty_cache=True), timeout=120)
    assert resp.success, resp.message
    deadline = time.time() + 10
    while said() < before + 4 and time.time() < deadline:
        time.sleep(0.1)
    assert said() == before + 4
