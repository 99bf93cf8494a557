"""server/sidecar/ without a worker: each route's JSON -> protobuf request at the edge,
the answers and statuses, the auth rule of each route's RPC (the real AuthInterceptor),
/metrics' format, and garbage that must end in a 4xx. The routes over a real worker:
tests/integration/test_http_sidecar.py."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from sglang_admin.config import ServerArgs
from sglang_admin.messages import RankState
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import Serialized, ServiceError
from sglang_admin.server.interceptors import AuthInterceptor
from sglang_admin.server.metrics import Metrics
from sglang_admin.server.sidecar import FLUSH_TEXT, START_TEXT, STOP_TEXT, HttpSidecar
from sglang_admin.server.sidecar.profile_routes import start_profile_request


class FakeCache:
    """CacheAndProfile's three methods the sidecar calls: records what reached them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []
        self.ok = True
        self.error: Exception | None = None

    async def _answer(self, op: str, request: Any, context: Any) -> None:
        self.calls.append((op, request, context))
        if self.error is not None:
            raise self.error

    async def start_profile(self, request: pb.StartProfileRequest, context: Any) -> pb.ProfileResponse:
        await self._answer("start", request, context)
        return pb.ProfileResponse(success=self.ok, profile_id="17.5",
                                  message="Start profiling." if self.ok else "busy rank")

    async def stop_profile(self, request: pb.StopProfileRequest, context: Any) -> pb.ProfileResponse:
        await self._answer("stop", request, context)
        return pb.ProfileResponse(success=self.ok, profile_id="17.5",
                                  message="Stop profiling." if self.ok else "not running")

    async def flush(self, request: pb.FlushCacheRequest, context: Any) -> pb.FlushCacheResponse:
        await self._answer("flush", request, context)
        return pb.FlushCacheResponse(success=self.ok, message="Cache flushed successfully"
                                     if self.ok else "Cache not flushed: pending requests")


class FakeInfo:
    healthy = True

    async def health(self, request: Any, context: Any) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(healthy=self.healthy,
                                      message="OK" if self.healthy else "not ready: model loading")

    async def server_info(self, request: Any, context: Any) -> Serialized:
        found = pb.GetServerInfoResponse(sglang_version="v", active_requests=2)
        found.server_args.update({"dp_size": 2, "model_path": "m"})
        found.rank_states.add(dp_rank=0, num_running_reqs=1)
        return Serialized(found.SerializeToString())

    async def model_info(self, request: Any, context: Any) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(model_path="m", is_generation=True, weight_version="w")


def sidecar(check=None, metrics: bool = True) -> tuple[HttpSidecar, FakeCache, FakeInfo]:
    args = ServerArgs(enable_metrics=metrics)
    states = [(0, RankState(dp_rank=0), 0.0)]
    cache, info = FakeCache(), FakeInfo()
    services = SimpleNamespace(cache=cache, info=info,
                               metrics=Metrics(args, lambda: "m", lambda: states),
                               weights=None, weight_sync=None, lora=None, generation=None,
                               admin=None)
    return HttpSidecar(args, services, check), cache, info  # type: ignore[arg-type]


def call(app: HttpSidecar, method: str, path: str, **kw: Any) -> tuple[int, str, dict]:
    """One request through aiohttp's test server: (status, body text, headers)."""

    async def go() -> tuple[int, str, dict]:
        async with TestClient(TestServer(app.build_app())) as client:
            resp = await client.request(method, path, **kw)
            return resp.status, await resp.text(), dict(resp.headers)

    return asyncio.run(go())


# ---------------------------------------------------------------------- JSON -> protobuf


def test_every_body_form_becomes_the_rpc_request() -> None:
    app, cache, _ = sidecar()
    for kw in ({}, {"data": b""}, {"data": b"  \n"}, {"json": {}}):
        status, text, headers = call(app, "POST", "/start_profile", **kw)
        assert (status, text, headers["X-Profile-Id"]) == (200, START_TEXT, "17.5")
        assert cache.calls[-1][1] == pb.StartProfileRequest()
    full = {"output_dir": "run", "start_step": 3, "num_steps": 2, "activities": ["CPU"],
            "with_stack": False, "record_shapes": True, "profile_by_stage": True,
            "merge_profiles": True, "profile_prefix": "p", "profile_stages": ["decode"],
            "profile_id": "ignored", "url": "unknown fields are ignored"}
    assert call(app, "POST", "/start_profile", json=full)[0] == 200
    assert cache.calls[-1][1] == pb.StartProfileRequest(
        output_dir="run", start_step=3, num_steps=2, activities=["CPU"], with_stack=False,
        record_shapes=True, profile_by_stage=True, merge_profiles=True, profile_prefix="p",
        profile_stages=["decode"])
    assert call(app, "GET", "/start_profile")[0] == 200  # SGLang's route takes GET too


def test_bench_servings_body_with_nulls_and_steps_as_strings() -> None:
    # sglang/benchmark/serving.py (0.5.23) async_request_profile: nulls for what is unset,
    # and body["start_step"] = str(args.profile_start_step) (num_steps likewise)
    body = {"activities": ["CPU", "GPU"], "num_steps": None, "profile_by_stage": False,
            "profile_stages": None, "output_dir": "/p/1.5", "profile_prefix": None,
            "start_step": "5"}
    request = start_profile_request(body)
    assert request == pb.StartProfileRequest(
        activities=["CPU", "GPU"], output_dir="/p/1.5", start_step=5)
    assert not request.HasField("num_steps") and not request.HasField("profile_prefix")
    assert start_profile_request({"num_steps": "10", "start_step": 2.0}).num_steps == 10


@pytest.mark.parametrize("body, message", [
    (b"{bad", "invalid JSON in the request body: Expecting property name enclosed in double "
              "quotes (line 1, column 2)"),
    (b"\xff\xfe", "invalid JSON in the request body: not UTF-8 text"),
    (b"[1, 2]", "the request body must be a JSON object, got a list"),
    (b'"x"', "the request body must be a JSON object, got a string"),
    (b'{"num_steps": "x"}', "num_steps: expected an integer, got a string"),
    (b'{"num_steps": 1.5}', "num_steps: expected an integer, got a number"),
    (b'{"start_step": true}', "start_step: expected an integer, got a boolean"),
    (b'{"num_steps": 4294967296}', "num_steps: must be at most 2147483647"),
    (b'{"activities": "CPU"}', "activities: expected a list of strings, got a string"),
    (b'{"activities": [1]}', "activities: expected a list of strings, got a list holding "
                             "other values"),
    (b'{"with_stack": "yes"}', "with_stack: expected true or false, got a string"),
    (b'{"output_dir": 5}', "output_dir: expected a string, got a number"),
    (b'{"output_dir": "\\ud800"}', "output_dir: not valid Unicode text"),
    (b'{"profile_by_stage": {}}', "profile_by_stage: expected true or false, got an object"),
    (b"[" * 100000, "invalid JSON in the request body: too large or too deeply nested"),
    (b'{"num_steps": 1' + b"0" * 5000 + b"}",
     "invalid JSON in the request body: too large or too deeply nested"),
])
def test_a_bad_body_is_a_400_naming_the_problem(body: bytes, message: str) -> None:
    app, cache, _ = sidecar()
    status, text, _ = call(app, "POST", "/start_profile", data=body)
    assert (status, text) == (400, message + "\n")
    assert cache.calls == []  # refused at the edge


# ---------------------------------------------------------------------- answers


def test_answers_and_refusals_as_sglangs_http_server() -> None:
    app, cache, info = sidecar()
    assert call(app, "POST", "/stop_profile")[:2] == (200, STOP_TEXT)
    for method in ("GET", "POST"):
        assert call(app, method, "/flush_cache")[:2] == (200, FLUSH_TEXT)
    assert cache.calls[-1][1] == pb.FlushCacheRequest(timeout_s=0)  # one attempt, as SGLang
    cache.ok = False
    assert call(app, "POST", "/start_profile")[:2] == (400, "busy rank\n")
    assert call(app, "POST", "/stop_profile")[:2] == (400, "not running\n")
    assert call(app, "GET", "/flush_cache")[:2] == (400, "Cache not flushed: pending requests\n")
    assert call(app, "GET", "/health")[0] == 200
    info.healthy = False
    assert call(app, "GET", "/health_generate")[:2] == (503, "not ready: model loading\n")
    status, text, headers = call(app, "GET", "/get_server_info")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    found = json.loads(text)
    assert found["dp_size"] == 2 and isinstance(found["dp_size"], int)  # not 2.0
    assert found["version"] == "v" and found["internal_states"][0]["num_running_reqs"] == 1
    found = json.loads(call(app, "GET", "/model_info")[1])
    assert found["model_path"] == "m" and found["has_image_understanding"] is False
    assert call(app, "GET", "/nope")[0] == 404
    assert call(app, "DELETE", "/flush_cache")[0] == 405
    assert call(app, "POST", "/metrics")[0] == 405
    assert call(app, "POST", "/start_profile", data=b" " * (1 << 20) + b"{}")[0] == 413


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.FAILED_PRECONDITION, 400),
    (grpc.StatusCode.ALREADY_EXISTS, 400), (grpc.StatusCode.UNAUTHENTICATED, 401),
    (grpc.StatusCode.PERMISSION_DENIED, 403), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500),
])
def test_service_errors_map_to_http_statuses(code: grpc.StatusCode, status: int) -> None:
    app, cache, _ = sidecar()
    cache.error = ServiceError(code, "why")
    assert call(app, "POST", "/start_profile")[:2] == (status, "why\n")


def test_a_bug_is_a_500_that_tells_nothing() -> None:
    app, cache, _ = sidecar()
    cache.error = RuntimeError("/secret/path leaked")
    status, text, _ = call(app, "POST", "/flush_cache")
    assert status == 500 and "secret" not in text and "RuntimeError" not in text


def test_the_trace_context_travels_as_call_metadata() -> None:
    app, cache, _ = sidecar()
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    call(app, "POST", "/flush_cache", headers={"traceparent": parent, "tracestate": "a=b"})
    context = cache.calls[-1][2]
    assert context.invocation_metadata() == (("traceparent", parent), ("tracestate", "a=b"))
    assert context.time_remaining() is None


# ---------------------------------------------------------------------- auth and metrics


@pytest.mark.parametrize("keys", ["api", "admin", "both"])
def test_each_route_follows_its_rpcs_auth_rule(keys: str) -> None:
    auth = AuthInterceptor("k" if keys in ("api", "both") else None,
                           "adm" if keys in ("admin", "both") else None)
    app, cache, _ = sidecar(auth.check)
    admin_key = "adm" if keys != "api" else "k"  # with only --api-key it opens admin routes
    for method, path in (("POST", "/start_profile"), ("POST", "/stop_profile"),
                         ("GET", "/flush_cache"), ("POST", "/flush_cache")):
        status, text, headers = call(app, method, path)
        assert status == 401 and "Authorization: Bearer" in text.replace("authorization",
                                                                           "Authorization")
        assert headers["WWW-Authenticate"].startswith("Bearer")
        wrong = "k" if keys == "both" else "nope"  # the API key does not open admin routes
        assert call(app, method, path, headers={"Authorization": f"Bearer {wrong}"})[0] == 401
        ok = call(app, method, path, headers={"Authorization": f"Bearer {admin_key}"})
        assert ok[0] == 200, ok
    # /metrics and the info routes: the API key when set; health: always open
    for path in ("/metrics", "/get_server_info", "/get_model_info"):
        status = call(app, "GET", path)[0]
        assert status == (401 if keys != "admin" else 200), path
        if keys != "admin":
            assert call(app, "GET", path, headers={"Authorization": "Bearer k"})[0] == 200
    assert call(app, "GET", "/health")[0] == 200


def test_metrics_keep_sglang_names_in_the_text_format() -> None:
    app, _, _ = sidecar()
    status, text, headers = call(
        app, "GET", "/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert 'sglang:num_running_reqs{dp_rank="0"' in text  # OpenMetrics asked, colon kept
    assert list(text_string_to_metric_families(text))
    off, _, _ = sidecar(metrics=False)
    status, text, _ = call(off, "GET", "/metrics")
    assert status == 404 and "--enable-metrics" in text


def test_garbage_bodies_and_headers_end_in_a_4xx() -> None:
    """A bounded fuzz: random bytes, random JSON-ish objects and odd headers on every
    route; every answer is a 2xx (a route that ignores its body) or a 4xx, never a 5xx."""
    app, _, _ = sidecar(AuthInterceptor(None, "adm").check)
    rng = random.Random(46)
    values = [None, True, 0, -1, 2**40, 1.5, "x", "", [], ["CPU"], [1], {}, {"a": 1}, "\u00e9"]
    fields = ["output_dir", "start_step", "num_steps", "activities", "with_stack",
              "record_shapes", "profile_by_stage", "merge_profiles", "profile_prefix",
              "profile_stages", "profile_id"]

    async def go() -> list[tuple[str, int]]:
        seen = []
        async with TestClient(TestServer(app.build_app())) as client:
            for i in range(300):
                path = rng.choice(["/start_profile", "/stop_profile", "/flush_cache",
                                   "/metrics", "/health", "/get_server_info", "/x"])
                headers = {"Authorization": rng.choice(
                    ["Bearer adm", "Bearer", "Basic adm", "bearer adm", "Bearer \u00e9", ""])}
                if i % 3 == 0:
                    data: Any = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
                else:
                    data = json.dumps({rng.choice(fields): rng.choice(values)
                                       for _ in range(rng.randrange(4))}).encode()
                resp = await client.request(rng.choice(["GET", "POST", "PUT"]), path,
                                            data=data, headers=headers)
                await resp.read()
                seen.append((path, resp.status))
        return seen

    seen = asyncio.run(go())
    assert all(status < 500 for _, status in seen), [s for s in seen if s[1] >= 500]
    assert {s for _, s in seen} >= {200, 400, 401, 404, 405}
