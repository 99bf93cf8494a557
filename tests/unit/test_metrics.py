"""server/metrics.py and server/watchdog.py without a server: what one request's outputs
count, admin outcomes, the watchdog's verdicts (the HTTP /metrics route's auth and format:
tests/unit/test_http_sidecar.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang_admin.config import ServerArgs
from sglang_admin.messages import Heartbeat, RankState, ReqOutput
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.metrics import Metrics
from sglang_admin.server.watchdog import stuck_reason


def make_metrics(enabled: bool = True, states: list | None = None) -> Metrics:
    return Metrics(ServerArgs(enable_metrics=enabled), lambda: "m", lambda: states or [])


def values(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def out(tokens: int, finish: str | None = None, prompt: int = 4, cached: int = 0,
        queue: float = 0.0) -> ReqOutput:
    return ReqOutput("r", list(range(tokens)), prompt, tokens, cached, finish_reason=finish,
                     queue_time_s=queue)


async def outputs(items: list[ReqOutput]) -> AsyncGenerator[ReqOutput, None]:
    for item in items:
        yield item


def consume(metrics: Metrics, items: list[ReqOutput], rank: int = 0) -> list[ReqOutput]:
    async def run() -> list[ReqOutput]:
        return [o async for o in metrics.observe(outputs(items), rank)]

    return asyncio.run(run())


RANK0 = (("dp_rank", "0"), ("model_name", "m"))


def test_one_request_counts_its_tokens_ttft_gaps_and_finish() -> None:
    metrics = make_metrics()
    # 2 tokens together at first, then 1, then 3 with the finish
    items = [out(2), out(1), out(3, "length", prompt=9, cached=5, queue=0.25)]
    items[0].queue_time_s = 0.25
    assert consume(metrics, items) == items  # passed through unchanged
    found = values(metrics)
    assert found[("sglang:generation_tokens_total", RANK0)] == 6
    assert found[("sglang:prompt_tokens_total", RANK0)] == 9
    assert found[("sglang:cached_tokens_total", RANK0)] == 5
    assert found[("sglang:num_requests_total", RANK0)] == 1
    assert found[("sglang:time_to_first_token_seconds_count", RANK0)] == 1
    assert found[("sglang:inter_token_latency_seconds_count", RANK0)] == 5  # 6 tokens - 1
    assert found[("sglang:e2e_request_latency_seconds_count", RANK0)] == 1
    assert found[("sglang:queue_time_seconds_count", RANK0)] == 1
    assert found[("sglang:queue_time_seconds_sum", RANK0)] == pytest.approx(0.25)


def test_a_refused_request_is_not_counted_as_processed() -> None:
    metrics = make_metrics()
    refused = ReqOutput("r", [], 0, 0, 0, finish_reason="abort", error="no room",
                        error_code="RESOURCE_EXHAUSTED")
    consume(metrics, [refused], rank=1)
    found = values(metrics)
    rank1 = (("dp_rank", "1"), ("model_name", "m"))
    for name in ("sglang:num_requests_total", "sglang:time_to_first_token_seconds_count",
                 "sglang:generation_tokens_total", "sglang:e2e_request_latency_seconds_count"):
        assert found.get((name, rank1), 0) == 0, name


def test_gauges_come_from_the_published_rank_states() -> None:
    states = [(0, RankState(dp_rank=0, num_running_reqs=3, num_waiting_reqs=2,
                            token_capacity=100, num_used_tokens=25), 0.5),
              (1, RankState(dp_rank=1, num_running_reqs=1), 2.0)]
    found = values(make_metrics(states=states))
    rank1 = (("dp_rank", "1"), ("model_name", "m"))
    assert found[("sglang:num_running_reqs", RANK0)] == 3
    assert found[("sglang:num_queue_reqs", RANK0)] == 2
    assert found[("sglang:token_usage", RANK0)] == 0.25
    assert found[("sglang:num_running_reqs", rank1)] == 1
    assert found[("sglang_admin:rank_state_age_seconds", rank1)] == 2.0


def test_decode_step_phases_are_counters_per_rank_and_phase() -> None:
    state = RankState(dp_rank=0, decode_steps=40,
                      decode_phase_s={"model": 2.0, "schedule": 0.1, "output": 0.05})
    found = values(make_metrics(states=[(0, state, 0.0)]))
    assert found[("sglang_admin:decode_steps_total", RANK0)] == 40
    model = (("dp_rank", "0"), ("model_name", "m"), ("phase", "model"))
    assert found[("sglang_admin:decode_step_phase_seconds_total", model)] == 2.0
    output = (("dp_rank", "0"), ("model_name", "m"), ("phase", "output"))
    assert found[("sglang_admin:decode_step_phase_seconds_total", output)] == 0.05


def test_grammar_queue_gauge_comes_from_the_rank_state() -> None:
    states = [(0, RankState(dp_rank=0, num_grammar_queue_reqs=4), 0.1)]
    found = values(make_metrics(states=states))
    assert found[("sglang:num_grammar_queue_reqs", RANK0)] == 4


def test_pd_series_only_on_a_pd_rank() -> None:
    """SGLang's PD series come from a PD rank's figures (disaggregation/figures.py); a plain
    rank has none of them."""
    pd = {"mode": "decode", "decode_prealloc_queue_reqs": 2, "decode_transfer_queue_reqs": 1,
          "kv_transfer_speed_gb_s": 1.5, "kv_transfer_latency_ms": 3.0,
          "kv_transfer_total_mb": 4.5, "kv_transfer_bootstrap_ms": 6.0,
          "kv_transfer_alloc_ms": 0.5, "bootstrap_failed_reqs": 3, "transfer_failed_reqs": 7}
    found = values(make_metrics(states=[(0, RankState(dp_rank=0, pd=pd), 0.0)]))
    want = {"sglang:num_decode_prealloc_queue_reqs": 2, "sglang:num_decode_transfer_queue_reqs": 1,
            "sglang:num_prefill_prealloc_queue_reqs": 0, "sglang:num_prefill_inflight_queue_reqs": 0,
            "sglang:kv_transfer_speed_gb_s": 1.5, "sglang:kv_transfer_latency_ms": 3.0,
            "sglang:kv_transfer_total_mb": 4.5, "sglang:kv_transfer_bootstrap_ms": 6.0,
            "sglang:kv_transfer_alloc_ms": 0.5, "sglang:num_bootstrap_failed_reqs_total": 3,
            "sglang:num_transfer_failed_reqs_total": 7}
    for name, value in want.items():
        assert found[(name, RANK0)] == value, name
    plain = values(make_metrics(states=[(0, RankState(dp_rank=0), 0.0)]))
    assert not [key for key in plain if "transfer" in key[0] or "bootstrap" in key[0]]


def test_pd_failures_are_counted_by_the_words_the_router_sorts_by() -> None:
    from sglang_admin.disaggregation.figures import FailureCounts

    counts = FailureCounts()
    for error in ("bootstrap failed: cannot reach", "bootstrap timed out: no decode handshake",
                  "kv transfer failed: checksum mismatch", "kv transfer timed out: no KV",
                  "deadline exceeded while waiting for the KV", "grammar compile failed"):
        counts.count(error)
    assert (counts.bootstrap, counts.transfer) == (2, 2)


def test_admin_outcomes_are_ok_failed_or_the_status_code() -> None:
    metrics = make_metrics()
    with metrics.admin_call("flush_cache") as outcome:
        outcome(True)
    with metrics.admin_call("flush_cache") as outcome:
        outcome(False)
    with pytest.raises(ServiceError), metrics.admin_call("flush_cache"):
        raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "rank 0 did not answer")
    found = values(metrics)
    for status in ("OK", "FAILED", "DEADLINE_EXCEEDED"):
        assert found[("sglang_admin:admin_calls_total",
                      (("op", "flush_cache"), ("status", status)))] == 1
    assert found[("sglang_admin:admin_call_duration_seconds_count",
                  (("op", "flush_cache"),))] == 3


def test_profile_bytes_are_the_sizes_of_the_files_written(tmp_path) -> None:
    metrics = make_metrics()
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "b").write_bytes(b"x" * 7)
    metrics.profile_files([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "gone")])
    assert values(metrics)[("sglang_admin:profile_bytes_written_total", ())] == 17


def test_off_metrics_pass_outputs_through_and_get_metrics_says_how_to_turn_them_on() -> None:
    metrics = make_metrics(enabled=False)
    stream = outputs([out(1, "stop")])
    assert metrics.observe(stream, 0) is stream
    with metrics.admin_call("flush_cache") as outcome:
        outcome(True)
    assert metrics.exposition() == b""
    with pytest.raises(ServiceError) as err:
        metrics.get_metrics(pb.GetMetricsRequest())
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-metrics" in err.value.message


ARGS = ServerArgs(watchdog_timeout_s=300.0, watchdog_probe_timeout_s=5.0)


def test_a_rank_that_beats_is_alive_even_in_a_long_step() -> None:
    beat = Heartbeat(0, step_started=1000.0, forward_steps=3, state_confirmed=1000.0)
    assert stuck_reason(ARGS, beat, heard_ago=0.5, now=1000.0 + 299) is None
    assert stuck_reason(ARGS, Heartbeat(0, 0.0, 3, 0.0), heard_ago=4.9, now=5000.0) is None


def test_silence_past_the_probe_timeout_is_stuck() -> None:
    why = stuck_reason(ARGS, None, heard_ago=5.5, now=0.0)
    assert why is not None and "no heartbeat" in why and "--watchdog-probe-timeout" in why


def test_one_step_past_the_watchdog_timeout_is_stuck() -> None:
    beat = Heartbeat(0, step_started=1000.0, forward_steps=3, state_confirmed=1000.0)
    why = stuck_reason(ARGS, beat, heard_ago=0.2, now=1000.0 + 301)
    assert why is not None and "--watchdog-timeout" in why


def test_zero_turns_a_check_off() -> None:
    off = ServerArgs(watchdog_timeout_s=0.0, watchdog_probe_timeout_s=0.0)
    beat = Heartbeat(0, step_started=1.0, forward_steps=0, state_confirmed=1.0)
    assert stuck_reason(off, beat, heard_ago=1e6, now=1e6) is None


def test_a_call_that_ends_early_closes_the_rank_stream_at_once() -> None:
    closed: list[bool] = []

    async def rank_stream() -> AsyncGenerator[ReqOutput, None]:
        try:
            yield out(1)
            yield out(1)
        finally:
            closed.append(True)  # where the communicator sends the rank its AbortReq

    async def run() -> None:
        observed = make_metrics().observe(rank_stream(), 0)
        async for _ in observed:
            break  # the client went away after the first chunk
        await observed.aclose()
        assert closed == [True]

    asyncio.run(run())
