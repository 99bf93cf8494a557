"""The HTTP sidecar (issue 46) as a user drives it with real HTTP clients, on two workers
started on consecutive ports at their default sidecar ports (--port + 1): worker A on P
(``--dp-size 2``, metrics, no keys: P + 1), worker B on P + 2 (``--api-key`` and
``--admin-api-key``: P + 3). Profiles with every body form and SGLang's bench_serving
requests write traces holding forward steps; flush answers as the RPC; auth, bad input,
a fuzz; both workers keep serving."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.sidecar import FLUSH_TEXT, START_TEXT, STOP_TEXT
from tests.conftest import ServerProc, free_port, greedy, run_generate, start_server, wait_started
from tests.integration.test_faults import Stream

ALREADY_RUNNING = "Profiling is already in progress. Call /stop_profile first."
NOT_RUNNING = "Profiling is not in progress. Call /start_profile first."
TIMEOUT = 120


@dataclass
class Pair:
    a: ServerProc  # dp 2, metrics, no keys
    b: ServerProc  # --api-key k --admin-api-key adm
    prof_a: Path
    prof_b: Path


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def consecutive_free_ports(n: int) -> int:
    """A port P with P .. P + n - 1 free now."""
    for _ in range(200):
        p = free_port()
        if p + n <= 65536 and all(_free(p + i) for i in range(n)):
            return p
    raise RuntimeError("no run of free ports")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("sidecar")
    prof_a, prof_b = tmp / "prof_a", tmp / "prof_b"
    prof_a.mkdir()
    prof_b.mkdir()
    p = consecutive_free_ports(4)
    a = start_server(tmp, "--dp-size", "2", "--enable-metrics", "--log-requests",
                     "--profile-dir", str(prof_a), port=p, default_sidecar=True, wait=False)
    b = start_server(tmp, "--api-key", "k", "--admin-api-key", "adm", "--profile-dir",
                     str(prof_b), port=p + 2, default_sidecar=True, wait=False)
    try:
        wait_started(a)
        wait_started(b)
        yield Pair(a, b, prof_a, prof_b)
    finally:
        a.stop()
        b.stop()


def http(method: str, url: str, data: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = TIMEOUT) -> tuple[int, str, Any]:
    """(status, body text, headers) of one request through urllib."""
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers


def events(path: Path) -> list[str]:
    """The forward-step events of a gzipped Chrome trace."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return [e["name"] for e in data["traceEvents"] if e.get("name", "").startswith("forward_")]


def generate_on_both_ranks(srv: ServerProc, first: int, n: int = 3) -> None:
    stub = srv.stub()
    for rank in (0, 1):
        prompt = [first + 10 * rank + i for i in range(6)]
        tokens, _ = run_generate(stub, greedy(prompt, n, data_parallel_rank=rank), timeout=60)
        assert len(tokens) == n


def wait_idle(srv: ServerProc, timeout: float = 60) -> None:
    """Until no rank reports a running profiler."""
    stub = srv.stub()
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        if all(s.profiler_state == "idle" for s in info.rank_states):
            return
        time.sleep(0.2)
    raise AssertionError("profilers still running")


def assert_traces(directory: Path, stem: str, steps: int | None = None) -> None:
    """One trace per rank of worker A, each holding our prefill and decode steps (or
    exactly ``steps`` forward steps)."""
    files = sorted(directory.glob(f"{stem}-TP-0-DP-*.trace.json.gz"))
    assert [f.name for f in files] == [f"{stem}-TP-0-DP-{r}.trace.json.gz" for r in (0, 1)]
    for path in files:
        names = events(path)
        if steps is not None:
            assert len(names) == steps, names
        else:
            assert any(n.startswith("forward_extend_bs") for n in names), names
            assert any(n.startswith("forward_decode_bs") for n in names), names


# ---------------------------------------------------------------------- ports


def test_two_workers_on_consecutive_ports_serve_their_sidecars(pair: Pair) -> None:
    assert pair.b.port == pair.a.port + 2
    assert (pair.a.sidecar_port, pair.b.sidecar_port) == (pair.a.port + 1, pair.b.port + 1)
    for srv in (pair.a, pair.b):
        assert http("GET", f"{srv.http_url}/health")[0] == 200
        assert f"HTTP sidecar on http://127.0.0.1:{srv.sidecar_port}" in srv.log()
    assert http("GET", f"{pair.a.http_url}/health_generate")[0] == 200


def test_a_sidecar_port_in_use_stops_the_start_with_one_line(tmp_path: Path) -> None:
    grpc_port = consecutive_free_ports(2)
    with socket.socket() as taken:  # what a neighbour holds: this worker's port + 1
        taken.bind(("127.0.0.1", grpc_port + 1))
        taken.listen()
        with pytest.raises(RuntimeError) as err:
            start_server(tmp_path, port=grpc_port, default_sidecar=True)
        message = str(err.value)
        assert f"cannot serve the HTTP sidecar on 127.0.0.1:{grpc_port + 1} (Address already " \
            "in use); choose another --grpc-http-sidecar-port, or --disable-http-sidecar" \
            in message
        # the way out it names: no sidecar, the gRPC port serves
        srv = start_server(tmp_path, "--disable-http-sidecar", port=grpc_port)
        try:
            assert srv.sidecar_port is None
            assert srv.stub().HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
            assert "HTTP sidecar" not in srv.log()
        finally:
            srv.stop()


# ---------------------------------------------------------------------- metrics and info


def test_metrics_are_the_get_metrics_exposition(pair: Pair) -> None:
    status, text, headers = http("GET", f"{pair.a.http_url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    names = {f.name for f in text_string_to_metric_families(text)}
    rpc = pair.a.stub().GetMetrics(pb.GetMetricsRequest(), timeout=10).text
    assert names == {f.name for f in text_string_to_metric_families(rpc)}
    assert "sglang:num_running_reqs" in names
    # B: no --enable-metrics (404 once its --api-key is given, the rule of GetMetrics)
    assert http("GET", f"{pair.b.http_url}/metrics")[0] == 401
    status, text, _ = http("GET", f"{pair.b.http_url}/metrics",
                           headers={"Authorization": "Bearer k"})
    assert status == 404 and "--enable-metrics" in text


def test_server_and_model_info_are_the_rpcs_answers(pair: Pair) -> None:
    status, text, _ = http("GET", f"{pair.a.http_url}/get_server_info")
    assert status == 200
    found = json.loads(text)
    assert found["dp_size"] == 2 and len(found["internal_states"]) == 2
    assert found["server_type"] == "grpc" and found["version"]
    status, text, _ = http("GET", f"{pair.a.http_url}/get_model_info")
    model = pair.a.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert status == 200 and json.loads(text)["model_path"] == model.model_path


# ---------------------------------------------------------------------- profiles


@pytest.mark.parametrize("form", ["no body", "{}", "full"])
def test_each_body_form_writes_traces_of_our_forward_steps(pair: Pair, form: str) -> None:
    url = pair.a.http_url
    if form == "full":
        body = {"output_dir": "full", "start_step": 1, "num_steps": 2, "activities": ["CPU"],
                "with_stack": False, "record_shapes": False, "profile_by_stage": False,
                "merge_profiles": False, "profile_prefix": "http", "profile_stages": None}
        data = json.dumps(body).encode()
    else:
        data = None if form == "no body" else b"{}"
    status, text, headers = http("POST", f"{url}/start_profile", data,
                                 {"Content-Type": "application/json"} if data else None)
    assert (status, text) == (200, START_TEXT)
    profile_id = headers["X-Profile-Id"]
    generate_on_both_ranks(pair.a, 40 + len(form))
    if form == "full":  # num_steps: each rank stops by itself after 2 forward steps
        wait_idle(pair.a)
        assert_traces(pair.prof_a / "full", f"http-{profile_id}", steps=2)
        return
    status, text, headers = http("POST", f"{url}/stop_profile")
    assert (status, text, headers["X-Profile-Id"]) == (200, STOP_TEXT, profile_id)
    assert_traces(pair.prof_a, profile_id)


def test_already_running_and_not_running_are_400s_with_sglangs_messages(pair: Pair) -> None:
    url = pair.a.http_url
    assert http("POST", f"{url}/stop_profile")[:2] == (400, NOT_RUNNING + "\n")
    assert http("POST", f"{url}/start_profile", b"{}")[0] == 200
    try:
        assert http("POST", f"{url}/start_profile", b"{}")[:2] == (400, ALREADY_RUNNING + "\n")
    finally:
        assert http("POST", f"{url}/stop_profile")[:2] == (200, STOP_TEXT)


def test_an_output_dir_outside_the_root_is_refused_as_the_rpc_refuses_it(pair: Pair) -> None:
    status, text, _ = http("POST", f"{pair.a.http_url}/start_profile",
                           json.dumps({"output_dir": "/etc"}).encode())
    with pytest.raises(grpc.RpcError) as err:
        pair.a.stub().StartProfile(pb.StartProfileRequest(output_dir="/etc"), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (status, text) == (403, err.value.details() + "\n")
    assert not os.path.exists(pair.prof_a / "etc")


def test_bench_servings_profile_requests_write_a_trace(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requests SGLang's ``bench_serving --profile`` sends, as its source sends them
    (``python -m sglang.bench_serving`` itself imports much of SGLang and its GPU stack:
    it does not install here). sglang 0.5.23, sglang/benchmark/serving.py::

        async def async_request_profile(api_url: str) -> RequestFuncOutput:
            async with _create_bench_client_session() as session:
                ...
                    if api_url.endswith("/start_profile"):
                        num_steps = getattr(args, "profile_num_steps", None)
                        profile_by_stage = getattr(args, "profile_by_stage", None)
                        ...
                        output_dir = getattr(args, "profile_output_dir", None)
                        if output_dir is None:
                            output_dir = os.getenv("SGLANG_TORCH_PROFILER_DIR", "/tmp")
                        output_dir = Path(os.path.abspath(os.path.normpath(output_dir))) / str(
                            time.time()
                        )
                        output_dir.mkdir(exist_ok=True, parents=True)
                        output_dir = str(output_dir)

                        body = {
                            "activities": getattr(args, "profile_activities", []),
                            "num_steps": num_steps,
                            "profile_by_stage": profile_by_stage,
                            "profile_stages": getattr(args, "profile_stages", None),
                            "output_dir": output_dir,
                            "profile_prefix": getattr(args, "profile_prefix", None),
                        }
                    else:
                        # stop_profile doesn't need any parameters
                        body = {}
                    ...
                    async with session.post(url=api_url, json=body) as response:
                        if response.status == 200:
                            output.success = True

    with ``--profile-activities`` defaulting to ["CPU", "GPU"] and ``--profile-by-stage``
    to False; ``benchmark()`` posts ``base_url + "/start_profile"``, runs the requests, then
    posts ``base_url + "/stop_profile"``. Older releases (the seed's time) posted both with
    no body: ``async with session.post(url=api_url) as response``.
    """
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(pair.prof_a))
    base_url = pair.a.http_url

    async def post(api_url: str, body: dict | None) -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
            kw = {} if body is None else {"json": body}
            async with s.post(url=api_url, **kw) as response:
                return response.status, await response.text()

    # today's bench_serving
    output_dir = Path(os.path.abspath(os.path.normpath(
        os.getenv("SGLANG_TORCH_PROFILER_DIR", "/tmp")))) / str(time.time())
    output_dir.mkdir(exist_ok=True, parents=True)
    body = {"activities": ["CPU", "GPU"], "num_steps": None, "profile_by_stage": False,
            "profile_stages": None, "output_dir": str(output_dir), "profile_prefix": None}
    assert asyncio.run(post(base_url + "/start_profile", body)) == (200, START_TEXT)
    generate_on_both_ranks(pair.a, 120)
    assert asyncio.run(post(base_url + "/stop_profile", {})) == (200, STOP_TEXT)
    (trace,) = {p.name.split("-TP-")[0] for p in output_dir.glob("*.trace.json.gz")}
    assert_traces(output_dir, trace)

    # the seed's bench_serving: no body at all
    before = set(pair.prof_a.glob("*.trace.json.gz"))
    assert asyncio.run(post(base_url + "/start_profile", None)) == (200, START_TEXT)
    generate_on_both_ranks(pair.a, 140)
    assert asyncio.run(post(base_url + "/stop_profile", None)) == (200, STOP_TEXT)
    (trace,) = {p.name.split("-TP-")[0] for p in set(pair.prof_a.glob("*.trace.json.gz")) - before}
    assert_traces(pair.prof_a, trace)

    # --profile-start-step 1 --profile-steps 2: body["start_step"] = str(...), likewise
    # num_steps; no stop_profile (it stops by itself)
    body.update(output_dir=str(output_dir / "steps"), start_step="1", num_steps="2")
    (output_dir / "steps").mkdir()
    assert asyncio.run(post(base_url + "/start_profile", body)) == (200, START_TEXT)
    generate_on_both_ranks(pair.a, 160)
    wait_idle(pair.a)
    (trace,) = {p.name.split("-TP-")[0] for p in (output_dir / "steps").glob("*.trace.json.gz")}
    assert_traces(output_dir / "steps", trace, steps=2)


BENCH_PYTHONPATH = os.environ.get("SGLANG_BENCH_PYTHONPATH", "")


@pytest.mark.skipif(not BENCH_PYTHONPATH, reason=(
    "SGLang's bench_serving needs sglang and much of its stack: set SGLANG_BENCH_PYTHONPATH "
    "to a PYTHONPATH where `import sglang.benchmark.serving` works (docs/operations.md)"))
def test_sglangs_own_bench_serving_profiles_through_the_sidecar(pair: Pair, tmp_path: Path) -> None:
    """SGLang's ``python -m sglang.bench_serving --profile`` as a user runs it in PD style:
    inference through the SMG router, the profiler on the worker's sidecar
    (``--pd-separated --profile-prefill-url``); its traces land in the worker's root."""
    pytest.importorskip("smg")
    model = pair.a.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_path
    port = free_port()
    with open(tmp_path / "router.log", "w") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "smg.launch_router", "--worker-urls",
             f"grpc://127.0.0.1:{pair.a.port}", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
             "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    out = pair.prof_a / "bench"
    out.mkdir()
    try:
        deadline = time.time() + 60
        while not (_up(port) and model in http("GET", f"http://127.0.0.1:{port}/v1/models",
                                               timeout=5)[1]):
            assert time.time() < deadline and router.poll() is None, "router not ready"
            time.sleep(0.5)
        done = subprocess.run(
            [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
             "--base-url", f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", model,
             "--extra-request-body", json.dumps({"model": model}),  # the router needs it
             "--dataset-name", "random-ids", "--num-prompts", "8", "--random-input-len", "16",
             "--random-output-len", "4", "--profile", "--profile-activities", "CPU",
             "--pd-separated", "--profile-prefill-url", pair.a.http_url],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": BENCH_PYTHONPATH, "HF_HUB_OFFLINE": "1",
                 "SGLANG_TORCH_PROFILER_DIR": str(out)},
        )
    finally:
        router.kill()
        router.wait(10)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Profiler started for Prefill-0 worker" in done.stdout
    assert "Profiler stopped for Prefill-0 worker" in done.stdout
    files = sorted(out.glob("*/*.trace.json.gz"))
    assert len(files) == 2  # one per rank of worker A
    assert sum(len(events(f)) for f in files) >= 2


def _up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------- flush


def test_flush_idle_is_200_and_with_a_request_running_the_rpcs_answer_as_400(
    pair: Pair,
) -> None:
    url = pair.a.http_url
    for method in ("GET", "POST"):
        assert http(method, f"{url}/flush_cache")[:2] == (200, FLUSH_TEXT)
    # the caller's trace continues into the op: its id on the worker's log line
    trace_id = os.urandom(16).hex()
    parent = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
    assert http("POST", f"{url}/flush_cache", headers=parent)[0] == 200
    assert any("servicer: flush_cache rid=" in line and f"trace_id={trace_id}" in line
               for line in pair.a.log().splitlines())
    stub = pair.a.stub()
    call = Stream(stub, greedy([5, 6, 7], 8000, stream=True, data_parallel_rank=0))
    call.start()
    try:
        assert call.first.wait(60)
        status, text, _ = http("POST", f"{url}/flush_cache")
        rpc = stub.FlushCache(pb.FlushCacheRequest(), timeout=30)
        assert not rpc.success
        assert (status, text) == (400, rpc.message + "\n")
        assert "Cache not flushed because there are pending requests" in text
    finally:
        stub.Abort(pb.AbortRequest(abort_all=True), timeout=10)
        call.join(60)


# ---------------------------------------------------------------------- auth and bad input


def test_admin_and_api_keys_guard_the_routes(pair: Pair) -> None:
    url = pair.b.http_url
    for method, path in (("POST", "/flush_cache"), ("GET", "/flush_cache"),
                         ("POST", "/start_profile"), ("POST", "/stop_profile")):
        status, text, headers = http(method, f"{url}{path}")
        assert status == 401 and "admin API key" in text and headers["WWW-Authenticate"]
        api = http(method, f"{url}{path}", headers={"Authorization": "Bearer k"})
        assert api[0] == 401 and "accepts only the admin API key" in api[1]
    admin = {"Authorization": "Bearer adm"}
    assert http("POST", f"{url}/flush_cache", headers=admin)[:2] == (200, FLUSH_TEXT)
    assert http("POST", f"{url}/start_profile", headers=admin)[:2] == (200, START_TEXT)
    assert http("POST", f"{url}/stop_profile", headers=admin)[:2] == (200, STOP_TEXT)
    assert http("GET", f"{url}/get_server_info")[0] == 401
    assert http("GET", f"{url}/get_server_info", headers={"Authorization": "Bearer k"})[0] == 200
    assert http("GET", f"{url}/health")[0] == 200  # open, as grpc.health.v1


# SGLang's admin routes over admin RPCs, each with a body the service refuses (or that
# changes nothing), so that the admin key is seen to reach the service (not a 401)
ADMIN_ROUTE_BODIES = [
    ("/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"}),
    ("/update_weight_version", {"new_version": ""}),
    ("/get_weights_by_name", {"name": "no.such.weight"}),
    ("/release_memory_occupation", {"tags": ["gpu"]}),
    ("/resume_memory_occupation", {"tags": ["gpu"]}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                    "rank_offset": 0, "world_size": 2}),
    ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"],
                                          "shapes": [[1]], "group_name": "nope"}),
    ("/destroy_weights_update_group", {"group_name": "nope"}),
    ("/update_weights_from_tensor", {}),
    ("/pause_generation", {"mode": "bogus"}),
    ("/continue_generation", {}),
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent"}),
    ("/unload_lora_adapter", {"lora_name": "a"}),
]


def test_sglangs_admin_routes_follow_their_rpcs_auth_rule(pair: Pair) -> None:
    url = pair.b.http_url
    api, admin = {"Authorization": "Bearer k"}, {"Authorization": "Bearer adm"}
    for path, body in ADMIN_ROUTE_BODIES:
        data = json.dumps(body).encode()
        assert http("POST", f"{url}{path}", data)[0] == 401, path
        assert http("POST", f"{url}{path}", data, api)[0] == 401, path
        status, text, _ = http("POST", f"{url}{path}", data, admin)
        assert status in (200, 400) and "success" in json.loads(text), (path, status, text)
    for path in ("/get_weight_version", "/get_load", "/v1/loads"):  # GetModelInfo, GetLoads
        assert http("GET", f"{url}{path}")[0] == 401, path
        assert http("GET", f"{url}{path}", headers=api)[0] == 200, path
    one = json.dumps({"rid": "not-running"}).encode()
    everything = json.dumps({"abort_all": True}).encode()
    assert http("POST", f"{url}/abort_request", one)[0] == 401  # Abort: the API key
    assert http("POST", f"{url}/abort_request", one, api)[0] == 200
    assert http("POST", f"{url}/abort_request", everything, api)[0] == 401  # an admin op
    assert http("POST", f"{url}/abort_request", everything, admin)[0] == 200
    generate_on_both_ranks(pair.a, 60)  # worker A, keyless, unaffected
    tokens, _ = run_generate(pair.b.stub(), greedy([3, 4, 5], 3), timeout=60,
                             metadata=(("authorization", "Bearer k"),))
    assert len(tokens) == 3


@pytest.mark.parametrize("data, message", [
    (b"{bad", "invalid JSON in the request body: Expecting property name enclosed in double "
              "quotes (line 1, column 2)"),
    (b'{"num_steps": "many"}', "num_steps: expected an integer, got a string"),
    (b'{"activities": "CPU"}', "activities: expected a list of strings, got a string"),
    (b'{"with_stack": 1}', "with_stack: expected true or false, got a number"),
    (b'{"activities": ["TPU"]}', "unknown profiler activity 'TPU'; valid: CPU, GPU (or CUDA), "
                                 "MEM"),
    (b'{"num_steps": -1}', "num_steps must be >= 0, got -1"),
])
def test_bad_input_is_a_400_naming_the_problem(pair: Pair, data: bytes, message: str) -> None:
    assert http("POST", f"{pair.a.http_url}/start_profile", data)[:2] == (400, message + "\n")


def test_unknown_routes_and_methods(pair: Pair) -> None:
    url = pair.a.http_url
    assert http("GET", f"{url}/generate")[0] == 404
    assert http("POST", f"{url}/v1/chat/completions", b"{}")[0] == 404
    assert http("DELETE", f"{url}/flush_cache")[0] == 405
    assert http("PUT", f"{url}/start_profile", b"{}")[0] == 405
    assert http("POST", f"{url}/metrics")[0] == 405


def test_garbage_gets_4xx_and_the_workers_keep_serving(pair: Pair) -> None:
    """A bounded fuzz over the wire: random bodies and headers on every route, and raw
    bytes that are not HTTP; no 5xx, and both workers serve afterwards."""
    rng = random.Random(4646)
    statuses: list[tuple[str, int]] = []
    paths = ["/start_profile", "/stop_profile", "/flush_cache", "/metrics", "/health",
             "/get_server_info", "/nope"]
    for i in range(120):
        srv = pair.a if i % 2 else pair.b
        path = rng.choice(paths)
        if path == "/start_profile" and i % 4 != 1:
            path = "/stop_profile"  # a profile started here would run on; few get through
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(80)))
        if i % 3 == 0:
            body = json.dumps({rng.choice(["num_steps", "activities", "output_dir", "x"]):
                               rng.choice([None, 1, "a", [], {}, True, -5, "../x"])}).encode()
        auth = rng.choice(["Bearer adm", "Bearer k", "Bearer", "Basic x", "Bearer \u00e9", ""])
        headers = {"Authorization": auth.encode("utf-8").decode("latin-1"),
                   "traceparent": rng.choice(["00-garbage", "", "00-" + "f" * 32 + "-x-01"])}
        status = http(rng.choice(["GET", "POST"]), f"{srv.http_url}{path}", body, headers)[0]
        statuses.append((path, status))
    for raw in (b"\x00\xff garbage\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n",
                b"POST /flush_cache HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
                b"POST /start_profile HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 70000 + b"\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", pair.a.sidecar_port), timeout=10) as s:
            s.sendall(raw)
            answer = s.recv(100)
        assert answer == b"" or answer.startswith(b"HTTP/1.") and b" 4" in answer[:13], answer
    assert all(status < 500 for _, status in statuses), statuses
    # nothing left running, and both workers serve
    for srv in (pair.a, pair.b):
        http("POST", f"{srv.http_url}/stop_profile", headers={"Authorization": "Bearer adm"})
        assert http("GET", f"{srv.http_url}/health")[0] == 200
    stub = pair.a.stub()
    tokens, _ = run_generate(stub, greedy([1, 2, 3], 3), timeout=60)
    assert len(tokens) == 3
    tokens, _ = run_generate(pair.b.stub(), greedy([1, 2, 3], 3), timeout=60,
                             metadata=[("authorization", "Bearer k")])
    assert len(tokens) == 3
