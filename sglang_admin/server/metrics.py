"""Prometheus metrics with SGLang's names (``sglang:*``) and our own (``sglang_admin:*``).

- Gauges per rank (label ``dp_rank``) are read at scrape time from the state the ranks
  already publish (the communicator's copy, as GetLoads reads it): nothing per step.
- Counters and the TTFT / inter-token / end-to-end / queue-time histograms are observed in
  the server where a request's outputs leave for the client (:meth:`Metrics.observe` wraps
  the output stream of one Generate call).
- Our own: admin calls by op and status and their latency, profile bytes written, KV events
  published, weight updates, watchdog verdicts.

Two ways to read them: the HTTP sidecar's ``/metrics`` (server/sidecar/, on --host
at --grpc-http-sidecar-port) and the GetMetrics RPC; both serve :meth:`Metrics.exposition`,
always in the classic text format 0.0.4 (prometheus_client's OpenMetrics output rewrites
the colon of every sample name, ``sglang:num_running_reqs`` arriving as
``sglang_num_running_reqs``, and dashboards read SGLang's names). With ``--enable-metrics``
off every hook returns at once and nothing is registered.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sglang_admin.config import ServerArgs
from sglang_admin.messages import RankState, ReqOutput
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import ServiceError

# Bucket bounds (seconds) in the style of SGLang's defaults; not checked against every
# SGLang version (its bounds changed over time). Dashboards' histogram_quantile() reads the
# _bucket series whatever the bounds.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035,
               0.040, 0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 150, 200,
               250, 300, 350, 500, 1000)
QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90,
                 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800,
                 2000, 2500, 3000)
ADMIN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                 30, 60, 120, 300)

# name (after "sglang:"), help, and how to read it from a RankState
RANK_GAUGES: tuple[tuple[str, str, Callable[[RankState], float]], ...] = (
    ("num_running_reqs", "The number of running requests.",
     lambda s: s.num_running_reqs),
    ("num_queue_reqs", "The number of requests in the waiting queue.",
     lambda s: s.num_waiting_reqs),
    ("num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.",
     lambda s: s.num_grammar_queue_reqs),
    ("num_used_tokens", "The number of KV tokens held by requests (not the evictable cache).",
     lambda s: s.num_used_tokens),
    ("token_usage", "The token usage (used / capacity of the KV pool).",
     lambda s: s.num_used_tokens / max(s.token_capacity, 1)),
    ("gen_throughput", "The generation throughput (token/s).",
     lambda s: s.gen_throughput),
    ("cache_hit_rate", "The prefix cache hit rate.",
     lambda s: s.cache_hit_rate),
    # speculative decoding (0 while off)
    ("spec_accept_length", "The average acceptance length of speculative decoding.",
     lambda s: s.spec_accept_length),
    ("spec_accept_rate", "The average acceptance rate of speculative decoding.",
     lambda s: s.spec_accept_rate),
)

# SGLang's PD series (a worker with --disaggregation-mode prefill or decode): name (after
# "sglang:"), help, the key of the rank's PD figures (disaggregation/figures.py). Queue
# sizes of the other role are 0, as on SGLang.
PD_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("num_prefill_prealloc_queue_reqs", "The number of requests in the prefill prealloc "
     "queue (their KV held, waiting for decode's handshake).", "prefill_prealloc_queue_reqs"),
    ("num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight "
     "queue (their KV being sent).", "prefill_inflight_queue_reqs"),
    ("num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue "
     "(reserving KV, bootstrap, handshake).", "decode_prealloc_queue_reqs"),
    ("num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue "
     "(waiting for their KV).", "decode_transfer_queue_reqs"),
    ("kv_transfer_speed_gb_s", "The transfer speed of the KV cache in GB/s (the last "
     "transfer).", "kv_transfer_speed_gb_s"),
    ("kv_transfer_latency_ms", "The transfer latency of the KV cache in ms (the last "
     "transfer).", "kv_transfer_latency_ms"),
    ("kv_transfer_total_mb", "The size of the last KV transfer in MB.", "kv_transfer_total_mb"),
    ("kv_transfer_bootstrap_ms", "The bootstrap time of the last KV transfer in ms (decode: "
     "the prefill rank's lookup and the handshake; prefill: its held KV's wait for the "
     "handshake).", "kv_transfer_bootstrap_ms"),
    ("kv_transfer_alloc_ms", "The allocation waiting time of the last KV transfer in ms "
     "(decode: the wait for KV slots; 0 on prefill).", "kv_transfer_alloc_ms"),
)
PD_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("num_bootstrap_failed_reqs", "The number of bootstrap failed requests.",
     "bootstrap_failed_reqs"),
    ("num_transfer_failed_reqs", "The number of transfer failed requests.",
     "transfer_failed_reqs"),
)

StateSource = Callable[[], Iterable[tuple[int, RankState, float]]]


class RankStateCollector(Collector):
    """The per-rank gauges, read from the ranks' published state at each scrape."""

    def __init__(self, model_name: Callable[[], str], states: StateSource) -> None:
        """``model_name`` gives the label at each scrape, ``states`` the ranks' states."""
        self.model_name = model_name
        self.states = states

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["model_name", "dp_rank"]
        families = [
            (GaugeMetricFamily(f"sglang:{name}", text, labels=labels), read)
            for name, text, read in RANK_GAUGES
        ]
        age = GaugeMetricFamily(
            "sglang_admin:rank_state_age_seconds",
            "Seconds since the rank last published or confirmed its state.", labels=labels,
        )
        steps = CounterMetricFamily(
            "sglang_admin:decode_steps", "Decode forward steps run by the rank.", labels=labels,
        )
        phases = CounterMetricFamily(
            "sglang_admin:decode_step_phase_seconds",
            "Seconds of the rank's decode steps by phase (model: forward and logits; "
            "schedule, prepare, sample, postprocess, output: the serving work around it).",
            labels=[*labels, "phase"],
        )
        pd_families = [
            (GaugeMetricFamily(f"sglang:{name}", text, labels=labels), key)
            for name, text, key in PD_GAUGES
        ] + [
            (CounterMetricFamily(f"sglang:{name}", text, labels=labels), key)
            for name, text, key in PD_COUNTERS
        ]
        pd_seen = False
        model_name = self.model_name()
        for rank, state, state_age in self.states():
            values = [model_name, str(rank)]
            for family, read in families:
                family.add_metric(values, float(read(state)))
            age.add_metric(values, state_age)
            steps.add_metric(values, float(state.decode_steps))
            for phase, seconds in state.decode_phase_s.items():
                phases.add_metric([*values, phase], seconds)
            if state.pd:  # a PD rank: SGLang's PD series
                pd_seen = True
                for pd_family, key in pd_families:
                    pd_family.add_metric(values, float(state.pd.get(key, 0)))
        for family, _ in families:
            yield family
        yield age
        yield steps
        yield phases
        if pd_seen:
            for pd_family, _ in pd_families:
                yield pd_family


@dataclass
class _RequestClock:
    """One Generate call's timing, from the moment it was sent to its rank, and the
    metrics of its (model, rank) label set, looked up once per call."""

    start: float
    generation_tokens: Any
    ttft: Any
    itl: Any
    queue_time: Any
    last_token: float = 0.0
    first_seen: bool = False


class Metrics:
    """The server's metrics; every hook is a no-op unless ``--enable-metrics``."""

    def __init__(self, args: ServerArgs, model_name: Callable[[], str],
                 states: StateSource) -> None:
        self.enabled = args.enable_metrics
        self.args = args
        self.registry = CollectorRegistry(auto_describe=True)
        self._model_name = model_name
        self._fixed_name: str | None = None
        self._admin_counters: dict[tuple[str, str], Any] = {}
        self._admin_latencies: dict[str, Any] = {}
        if not self.enabled:
            return
        disable_created_metrics()  # no *_created series: SGLang's exposition has none
        self.registry.register(RankStateCollector(lambda: self.model_name, states))
        rank_labels = ["model_name", "dp_rank"]
        reg = self.registry

        def counter(metric: str, text: str, labels: list[str]) -> Counter:
            return Counter(metric, text, labels, registry=reg)

        def histogram(metric: str, text: str, buckets: tuple[float, ...],
                      labels: list[str]) -> Histogram:
            return Histogram(metric, text, labels, registry=reg, buckets=buckets)

        self.prompt_tokens = counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", rank_labels)
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", rank_labels)
        self.cached_tokens = counter(
            "sglang:cached_tokens", "Number of prompt tokens served from the prefix cache.",
            rank_labels)
        self.num_requests = counter(
            "sglang:num_requests", "Number of requests processed.", rank_labels)
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS, rank_labels)
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS, rank_labels)
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds", E2E_BUCKETS, rank_labels)
        self.queue_time = histogram(
            "sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
            QUEUE_BUCKETS, rank_labels)
        self.admin_calls = counter(
            "sglang_admin:admin_calls", "Admin operations by op and outcome (OK, FAILED: "
            "some rank reported a failure, or the gRPC status code).", ["op", "status"])
        self.admin_latency = histogram(
            "sglang_admin:admin_call_duration_seconds",
            "Time an admin operation took, fan-out to every rank included.",
            ADMIN_BUCKETS, ["op"])
        self.profile_bytes = counter(
            "sglang_admin:profile_bytes_written", "Bytes of profiler trace files written.", [])
        self.kv_events = counter(
            "sglang_admin:kv_events", "KV cache events published to SubscribeKvEvents.",
            ["dp_rank"])
        self.weight_updates = counter(
            "sglang_admin:weight_updates", "Weight updates (UpdateWeightsFromDisk) by outcome.",
            ["status"])
        self.stuck_ranks = counter(
            "sglang_admin:watchdog_stuck_ranks", "Ranks the watchdog found stuck.",
            ["dp_rank"])

    @property
    def model_name(self) -> str:
        """The ``model_name`` label: --served-model-name, or the path of the model the ranks
        first loaded (fixed for the server's life, as a dashboard's selector must be)."""
        if self._fixed_name is None:
            name = self._model_name()
            if name == "unknown":
                return name
            self._fixed_name = name
        return self._fixed_name

    # ------------------------------------------------------------------ reading

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text exposition format."""
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_PLAIN_0_0_4

    def get_metrics(self, request: pb.GetMetricsRequest) -> pb.GetMetricsResponse:
        """The GetMetrics RPC: the exposition the HTTP sidecar's /metrics serves, as text."""
        if not self.enabled:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "metrics are off: start the server with --enable-metrics",
            )
        return pb.GetMetricsResponse(
            text=self.exposition().decode(), content_type=self.content_type
        )

    # ------------------------------------------------------------------ generation

    def observe(
        self, outputs: AsyncGenerator[ReqOutput, None], rank: int
    ) -> AsyncGenerator[ReqOutput, None]:
        """The outputs of one Generate call, observed as they leave for the client."""
        if not self.enabled:
            return outputs
        return self._observed(outputs, str(rank))

    async def _observed(self, outputs: AsyncGenerator[ReqOutput, None],
                        rank: str) -> AsyncGenerator[ReqOutput, None]:
        labels = (self.model_name, rank)
        clock = _RequestClock(
            time.perf_counter(), self.generation_tokens.labels(*labels),
            self.ttft.labels(*labels), self.itl.labels(*labels),
            self.queue_time.labels(*labels),
        )
        try:
            async for out in outputs:
                self._on_output(clock, out, labels)
                slot = [out]  # nothing of the output kept here while the call writes it
                del out
                yield slot.pop()
        finally:
            # closed with this wrapper, not later by the collector: a call that ends early
            # aborts its request on the rank at once, as without metrics
            await outputs.aclose()

    def _on_output(self, clock: _RequestClock, out: ReqOutput, labels: tuple[str, str]) -> None:
        now = time.perf_counter()
        n = len(out.new_token_ids)
        if n:
            clock.generation_tokens.inc(n)
            # Every token after a request's first is one inter-token gap; tokens that leave
            # together share the time since the previous ones (those with the first: none).
            if not clock.first_seen:
                clock.first_seen = True
                clock.ttft.observe(now - clock.start)
                clock.queue_time.observe(out.queue_time_s)
                gaps, gap = n - 1, 0.0
            else:
                gaps, gap = n, (now - clock.last_token) / n
            for _ in range(gaps):
                clock.itl.observe(gap)
            clock.last_token = now
        if out.finish_reason is not None and not out.error:
            self.num_requests.labels(*labels).inc()
            self.prompt_tokens.labels(*labels).inc(out.prompt_tokens)
            self.cached_tokens.labels(*labels).inc(out.cached_tokens)
            self.e2e.labels(*labels).observe(now - clock.start)

    # ------------------------------------------------------------------ admin

    def admin_call(self, op: str) -> AdminTimer | _NoAdminTimer:
        """Time an admin op: ``with metrics.admin_call(op) as outcome:`` ... ``outcome(ok)``
        (True: every rank succeeded). An exception's gRPC code is its status."""
        return AdminTimer(self, op) if self.enabled else _NO_ADMIN_TIMER

    def _admin_done(self, op: str, status: str, seconds: float) -> None:
        counter = self._admin_counters.get((op, status))
        if counter is None:
            counter = self._admin_counters[(op, status)] = self.admin_calls.labels(op, status)
        latency = self._admin_latencies.get(op)
        if latency is None:
            latency = self._admin_latencies[op] = self.admin_latency.labels(op)
        counter.inc()
        latency.observe(seconds)

    def profile_files(self, paths: Iterable[str]) -> None:
        """Count the bytes of the trace files a profile wrote."""
        if not self.enabled:
            return
        total = 0
        for path in paths:
            try:
                total += os.path.getsize(path)
            except OSError:
                continue
        self.profile_bytes.inc(total)

    def kv_events_published(self, dp_rank: int, count: int) -> None:
        if self.enabled and count:
            self.kv_events.labels(str(dp_rank)).inc(count)

    def weight_update(self, ok: bool) -> None:
        if self.enabled:
            self.weight_updates.labels("OK" if ok else "FAILED").inc()

    def rank_stuck(self, dp_rank: int) -> None:
        if self.enabled:
            self.stuck_ranks.labels(str(dp_rank)).inc()


class AdminTimer:
    """The context of :meth:`Metrics.admin_call` (a plain class: a generator-based context
    manager cost several times more per call)."""

    __slots__ = ("metrics", "op", "status", "start")

    def __init__(self, metrics: Metrics | None, op: str) -> None:
        self.metrics, self.op, self.status, self.start = metrics, op, "OK", 0.0

    def __enter__(self) -> Callable[[bool], None]:
        self.start = time.perf_counter()
        return self.outcome

    def outcome(self, ok: bool) -> None:
        """What the ranks answered: True when every one succeeded."""
        self.status = "OK" if ok else "FAILED"

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        if self.metrics is None:
            return
        if exc is not None:
            code = getattr(exc, "code", None)
            self.status = code.name if isinstance(code, grpc.StatusCode) else exc_type.__name__
        self.metrics._admin_done(self.op, self.status, time.perf_counter() - self.start)


class _NoAdminTimer:
    """:meth:`Metrics.admin_call` with metrics off: one shared context that records nothing."""

    __slots__ = ()

    def __enter__(self) -> Callable[[bool], None]:
        return _ignore_outcome

    def __exit__(self, *exc: object) -> None:
        return None


def _ignore_outcome(ok: bool) -> None:
    return None


_NO_ADMIN_TIMER = _NoAdminTimer()
