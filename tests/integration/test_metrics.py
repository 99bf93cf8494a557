"""Metrics and a truthful health, tried as an operator would: a mixed workload's exposition
(HTTP exporter and GetMetrics) counts exactly what was done, a real Prometheus scrapes it,
a stopped rank turns the standard health check NOT_SERVING and the server exits, and a long
but progressing prefill is never flagged."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from sglang_admin.client import Client
from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, free_port, greedy, run_generate, start_server
from tests.integration.test_faults import Stream, assert_gone, rank_pids, wait_for

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# (prompt length, new tokens, stream, rank): a handful of requests on both ranks
WORKLOAD = [(5, 4, False, 0), (9, 7, True, 0), (3, 1, True, 1), (12, 6, False, 1),
            (7, 5, True, 1)]
# the watched rank's --watchdog-probe-timeout (a 4k prefill's step is longer: 1.5-4 s
# here); at 0.3 s a heartbeat thread starved by the parallel suite's load was once flagged
PROBE_S = 1.0


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def by_rank(found: dict, name: str) -> dict[str, float]:
    """The values of one metric keyed by dp_rank."""
    return {dict(labels)["dp_rank"]: value for (n, labels), value in found.items() if n == name}


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, int]]:
    """dp 2 with metrics on an explicit sidecar port; (server, metrics port)."""
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("metrics"), "--dp-size", "2",
                       "--enable-metrics", "--grpc-http-sidecar-port", str(port))
    yield srv, port
    srv.stop()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_mixed_workload_is_counted_exactly(metered: tuple[ServerProc, int], tmp_path) -> None:
    srv, port = metered
    stub = srv.stub()
    for i, (n_prompt, n_new, stream, rank) in enumerate(WORKLOAD):
        ids = [(i * 31 + j) % 250 + 1 for j in range(n_prompt)]
        tokens, complete = run_generate(
            stub, greedy(ids, n_new, stream=stream, data_parallel_rank=rank), timeout=60)
        assert len(tokens) == n_new
    flush = stub.FlushCache(pb.FlushCacheRequest(), timeout=30)
    assert flush.success

    text = scrape(port)
    found = samples(text)
    for rank in ("0", "1"):
        done = [w for w in WORKLOAD if str(w[3]) == rank]
        assert by_rank(found, "sglang:num_requests_total")[rank] == len(done)
        assert by_rank(found, "sglang:prompt_tokens_total")[rank] == sum(w[0] for w in done)
        assert by_rank(found, "sglang:generation_tokens_total")[rank] == sum(w[1] for w in done)
        for hist in ("time_to_first_token", "e2e_request_latency", "queue_time"):
            assert by_rank(found, f"sglang:{hist}_seconds_count")[rank] == len(done), hist
        # every token after the first of a request is one inter-token gap
        assert (by_rank(found, "sglang:inter_token_latency_seconds_count")[rank]
                == sum(w[1] - 1 for w in done))
    assert found[("sglang_admin:admin_calls_total",
                  (("op", "flush_cache"), ("status", "OK")))] == 1
    # the ranks' own decode-step timing: steps counted, the model's time and the serving
    # work around it by phase
    for rank in ("0", "1"):
        assert by_rank(found, "sglang_admin:decode_steps_total")[rank] > 0
        phases = {dict(labels)["phase"]: value for (n, labels), value in found.items()
                  if n == "sglang_admin:decode_step_phase_seconds_total"
                  and dict(labels)["dp_rank"] == rank}
        assert set(phases) == {"schedule", "prepare", "model", "sample", "postprocess",
                               "output"}
        assert phases["model"] > 0 and phases["sample"] > 0 and phases["schedule"] > 0
    assert found[("sglang_admin:admin_call_duration_seconds_count",
                  (("op", "flush_cache"),))] == 1

    # the gauges are the state GetLoads reports, rank by rank (the server is idle now)
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
    assert sorted(by_rank(found, "sglang:num_running_reqs")) == ["0", "1"]
    for load in loads.loads:
        rank = str(load.dp_rank)
        assert by_rank(found, "sglang:num_running_reqs")[rank] == load.num_running_reqs
        assert by_rank(found, "sglang:num_queue_reqs")[rank] == load.num_waiting_reqs
        assert by_rank(found, "sglang:num_used_tokens")[rank] == load.num_used_tokens
        assert by_rank(found, "sglang:token_usage")[rank] == pytest.approx(load.token_usage)
        assert 0 <= load.state_age_s < 5  # an idle rank confirms its state as it polls
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert [s.dp_rank for s in info.rank_states] == [0, 1]
    assert all(0 <= s.state_age_s < 5 for s in info.rank_states)  # fresh: a round trip

    # GetMetrics serves the same exposition (ages aside, which move with the clock)
    rpc = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10)
    assert rpc.content_type.startswith("text/plain")
    via_rpc = samples(rpc.text)

    def steady(found: dict) -> dict:
        return {k: v for k, v in found.items() if "state_age" not in k[0]}

    assert steady(via_rpc) == steady(found)
    # ... and so do the typed client and the CLI
    with Client(srv.target) as client:
        assert steady(samples(client.metrics().text)) == steady(found)
    cli = subprocess.run([sys.executable, "-m", "sglang_admin", "metrics", "--target", srv.target],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "sglang:num_running_reqs" in cli.stdout, cli.stderr

    promtool = shutil.which("promtool")
    if promtool is not None:
        check = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                               capture_output=True, timeout=30)
        # It parses (a parse error exits 1); its only lint is the colon that SGLang's own
        # names carry (promtool reserves colons for recording rules; dashboards need them).
        problems = [line for line in (check.stdout + check.stderr).splitlines()
                    if line and not line.endswith("metric names should not contain ':'")]
        assert check.returncode in (0, 3) and not problems, check.stdout + check.stderr


def test_get_metrics_without_the_flag_says_how_to_turn_it_on(server: ServerProc) -> None:
    with pytest.raises(grpc.RpcError) as err:
        server.stub().GetMetrics(pb.GetMetricsRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-metrics" in err.value.details()


def test_a_real_prometheus_scrapes_the_exporter(
    metered: tuple[ServerProc, int], tmp_path: Path
) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (Debian: apt-get install prometheus)")
    _, port = metered
    web = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: sglang-admin\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
    )
    with open(tmp_path / "prometheus.log", "w") as log:  # the child keeps its own copy
        prom = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{web}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    query = urllib.parse.urlencode({"query": "sglang:num_running_reqs"})
    result: list = []

    def answered() -> bool:
        assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{web}/api/v1/query?{query}", timeout=5) as resp:
                body = json.load(resp)
        except OSError:
            return False
        result[:] = body["data"]["result"]
        return len(result) == 2

    try:
        wait_for(answered, 60, "Prometheus to scrape sglang:num_running_reqs of both ranks")
    finally:
        prom.terminate()
        prom.wait(30)
    assert sorted(r["metric"]["dp_rank"] for r in result) == ["0", "1"]
    assert all(r["metric"]["job"] == "sglang-admin" for r in result)


class Watched:
    """The module's worker whose server declares a rank dead after PROBE_S of silence, with
    room for a 4k prefill: the long-prefill test reads it, then the stopped-rank test ends it
    (one boot for both). ``get()`` starts it on first use, and again if it has exited (the
    long-prefill test failed: the stopped-rank test still gets a live one)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.srv: ServerProc | None = None

    def get(self) -> ServerProc:
        if self.srv is not None and self.srv.proc.poll() is not None:
            self.srv.stop(signal.SIGKILL)
            self.srv = None
        if self.srv is None:
            self.srv = start_server(self.factory.mktemp("watched"), "--watchdog-probe-timeout",
                                    str(PROBE_S), "--max-prefill-tokens", "4096",
                                    "--context-length", "8192")
        return self.srv


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
    workers = Watched(tmp_path_factory)
    yield workers
    if workers.srv is not None:
        workers.srv.stop(signal.SIGKILL)


def test_a_long_prefill_is_never_flagged(watched: Watched) -> None:
    """A 4k-token prefill is one step of seconds here; with a probe timeout far shorter
    than the step, the rank's heartbeat keeps it alive and its state age shows the step."""
    srv = watched.get()
    stub = srv.stub()
    ages: list[float] = []
    done = threading.Event()

    def poll_ages() -> None:
        while not done.is_set():
            ages.append(stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0].state_age_s)
            time.sleep(0.05)

    poller = threading.Thread(target=poll_ages, daemon=True)
    poller.start()
    ids = [(i * 7) % 250 + 1 for i in range(4096)]
    tokens, _ = run_generate(stub, greedy(ids, 2), timeout=120)
    done.set()
    poller.join(30)
    assert len(tokens) == 2
    assert srv.proc.poll() is None
    health = health_pb2_grpc.HealthStub(srv.channel()).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "stopped answering" not in srv.log()
    if max(ages) <= PROBE_S:
        pytest.skip(f"the 4k prefill step took under the {PROBE_S} s probe timeout here: {ages}")


def test_a_stopped_rank_turns_health_not_serving_and_the_server_exits(
        watched: Watched) -> None:
    """Runs after the long-prefill test: it ends their worker."""
    probe = PROBE_S
    srv = watched.get()
    stopped_pid = 0
    try:
        children = srv.children()
        (rank_pid,) = rank_pids(srv)
        stub = srv.stub()
        statuses: list[int] = []
        health_ch = srv.channel()
        watch = health_pb2_grpc.HealthStub(health_ch).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60)

        def watcher() -> None:
            try:
                for resp in watch:
                    statuses.append(resp.status)
            except grpc.RpcError:
                pass

        threading.Thread(target=watcher, daemon=True).start()
        call = Stream(stub, greedy([1, 2, 3], 8000, stream=True))
        call.start()
        call.first.wait(30)
        os.kill(rank_pid, signal.SIGSTOP)
        stopped_pid = rank_pid
        # NOT_SERVING within the probe timeout (plus the watchdog's and the test's polling)
        wait_for(lambda: NOT_SERVING in statuses, probe + 3, "grpc.health.v1 NOT_SERVING")
        call.join(30)
        assert call.code == grpc.StatusCode.UNAVAILABLE, (call.code, call.details)
        assert "scheduler rank 0" in call.details and "heartbeat" in call.details
        code = srv.proc.wait(30)
        assert code != 0
        assert_gone(children)  # the stopped rank was killed, and the resource tracker ended
        stopped_pid = 0
        health_ch.close()
        assert "rank 0 failed: stopped answering" in srv.log()
    finally:
        if stopped_pid:
            os.kill(stopped_pid, signal.SIGKILL)
        srv.stop(signal.SIGKILL)


def test_the_exporter_and_get_metrics_honour_the_api_key(tmp_path: Path) -> None:
    port = free_port()  # --metrics-port: the sidecar's port under its old name
    srv = start_server(tmp_path, "--enable-metrics", "--metrics-port", str(port),
                       "--api-key", "k1")
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=10)
        assert err.value.code == 401
        assert "authorization" in err.value.read().decode()
        wrong = urllib.request.Request(url, headers={"Authorization": "Bearer nope"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(wrong, timeout=10)
        assert err.value.code == 401
        right = urllib.request.Request(url, headers={"Authorization": "Bearer k1"})
        with urllib.request.urlopen(right, timeout=10) as resp:
            assert "sglang:num_running_reqs" in resp.read().decode()
        stub = srv.stub()
        with pytest.raises(grpc.RpcError) as rpc_err:
            stub.GetMetrics(pb.GetMetricsRequest(), timeout=10)
        assert rpc_err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        text = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10,
                               metadata=[("authorization", "Bearer k1")]).text
        assert "sglang:num_running_reqs" in text
        # --api-key alone guards the sidecar's admin routes too (SGLang #38089)
        flush = f"http://127.0.0.1:{port}/flush_cache"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(flush, method="POST"), timeout=10)
        assert err.value.code == 401
        keyed = urllib.request.Request(flush, method="POST",
                                       headers={"Authorization": "Bearer k1"})
        with urllib.request.urlopen(keyed, timeout=30) as resp:
            assert resp.status == 200 and resp.read().decode().startswith("Cache flushed.")
    finally:
        srv.stop()
