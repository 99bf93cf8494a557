"""The sidecar's SGLang admin routes (weights, memory, trainer groups, pause, abort, LoRA,
loads) without a worker: each body becomes the RPC's request at the edge, each refusal is a
400 naming the field before any service is called, each answer has SGLang's shape and
status, and each route follows its RPC's auth rule. Over a real worker:
tests/integration/test_sidecar_sglang_ports.py."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sglang_admin.config import ServerArgs
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.interceptors import AuthInterceptor
from sglang_admin.server.sidecar import HttpSidecar
from sglang_admin.server.sidecar.body import FLAG, INTEGER, NULL, SHAPES, TEXT, TEXTS
from sglang_admin.server.sidecar.control_routes import BODIES as CONTROL_BODIES
from sglang_admin.server.sidecar.weights_routes import BODIES as WEIGHT_BODIES
from sglang_admin.server.sidecar.weights_routes import TENSOR_REFUSED

BODIES = {**WEIGHT_BODIES, **CONTROL_BODIES}


class Fake:
    """A service object: every method records (name, request) and answers from
    ``answers[name]`` (a message, a function of the request, or an exception to raise)."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        async def method(request: Any, context: Any) -> Any:
            self.calls.append((name, request))
            answer = self.answers[name]
            if isinstance(answer, Exception):
                raise answer
            return answer(request) if callable(answer) else answer

        return method


def _weights(req: pb.GetWeightsByNameRequest) -> pb.GetWeightsByNameResponse:
    values = [float(i) for i in range(12)]  # a [4, 3] parameter
    return pb.GetWeightsByNameResponse(success=True, shape=[4, 3],
                                       values=values[:req.truncate_size])


def _loads(req: pb.GetLoadsRequest) -> pb.GetLoadsResponse:
    out = pb.GetLoadsResponse(timestamp="t", version="v", dp_rank_count=2)
    for rank in (0, 1):
        load = out.loads.add(dp_rank=rank, num_running_reqs=rank + 1, num_waiting_reqs=2,
                             num_used_tokens=10, num_waiting_uncached_tokens=5,
                             max_total_num_tokens=100, token_usage=0.1)
        if "all" in req.include or "queues" in req.include:
            load.queues.waiting = 2
    return out


def services() -> SimpleNamespace:
    ok = pb.AdminResponse(success=True, message="done")
    updated = pb.UpdateWeightsResponse(success=True, message="Succeeded to update model weights.",
                                       num_paused_requests=3)
    return SimpleNamespace(
        cache=Fake(), metrics=SimpleNamespace(enabled=False),
        info=Fake(model_info=pb.GetModelInfoResponse(weight_version="v7"), loads=_loads),
        weights=Fake(update_from_disk=updated, update_version=ok, get_by_name=_weights,
                     release_memory=ok, resume_memory=ok),
        weight_sync=Fake(init_group=ok, update_from_distributed=updated, destroy_group=ok),
        generation=Fake(pause=pb.PauseGenerationResponse(success=True, num_paused_requests=2),
                        resume=ok, abort=pb.AbortResponse(success=True)),
        admin=SimpleNamespace(check_admin_key=lambda metadata: None),
        lora=Fake(load=pb.LoadLoRAAdapterResponse(success=True, message="loaded"),
                  unload=pb.UnloadLoRAAdapterResponse(success=True, message="unloaded"),
                  list=pb.ListLoadedLoRAAdaptersResponse(loaded_adapters=[
                      pb.LoadedLoRAAdapter(lora_id="a", lora_name="a", lora_path="/p/a")])),
    )


def sidecar(check: Any = None, admin_check: Any = None) -> tuple[HttpSidecar, SimpleNamespace]:
    found = services()
    if admin_check is not None:
        found.admin.check_admin_key = admin_check
    return HttpSidecar(ServerArgs(), found, check), found  # type: ignore[arg-type]


def calls(app: HttpSidecar, requests: list[tuple[str, str, dict]]) -> list[tuple[int, Any]]:
    """Requests through aiohttp's test server: (status, JSON body or text) each."""

    async def go() -> list[tuple[int, Any]]:
        out = []
        async with TestClient(TestServer(app.build_app())) as client:
            for method, path, kw in requests:
                resp = await client.request(method, path, **kw)
                body = await resp.text()
                try:
                    out.append((resp.status, json.loads(body)))
                except ValueError:
                    out.append((resp.status, body))
        return out

    return asyncio.run(go())


def call(app: HttpSidecar, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    return calls(app, [(method, path, kw)])[0]


# ---------------------------------------------------------------------- body -> RPC request


@pytest.mark.parametrize("path, body, service, op, expected", [
    ("/update_weights_from_disk",
     {"model_path": "/m", "load_format": "auto", "abort_all_requests": True,
      "weight_version": "v2", "is_async": False, "torch_empty_cache": True, "keep_pause": False,
      "recapture_cuda_graph": False, "token_step": 0, "flush_cache": False, "manifest": None,
      "rid": "r"},
     "weights", "update_from_disk",
     pb.UpdateWeightsFromDiskRequest(model_path="/m", load_format="auto",
                                     abort_all_requests=True, weight_version="v2",
                                     flush_cache=False, torch_empty_cache=True)),
    ("/update_weights_from_disk", {"model_path": "/m"}, "weights", "update_from_disk",
     pb.UpdateWeightsFromDiskRequest(model_path="/m", flush_cache=True)),
    ("/update_weight_version", {"new_version": "x"}, "weights", "update_version",
     pb.UpdateWeightVersionRequest(new_version="x", abort_all_requests=True)),
    ("/update_weight_version", {"new_version": "x", "abort_all_requests": False}, "weights",
     "update_version", pb.UpdateWeightVersionRequest(new_version="x", abort_all_requests=False)),
    ("/release_memory_occupation", {}, "weights", "release_memory",
     pb.ReleaseMemoryOccupationRequest()),
    ("/resume_memory_occupation", {"tags": ["weights"]}, "weights", "resume_memory",
     pb.ResumeMemoryOccupationRequest(tags=["weights"])),
    ("/init_weights_update_group",
     {"master_address": "h", "master_port": 29500, "rank_offset": 1, "world_size": 2},
     "weight_sync", "init_group",
     pb.InitWeightsUpdateGroupRequest(master_address="h", master_port=29500, rank_offset=1,
                                      world_size=2, group_name="weight_update_group",
                                      backend="nccl")),
    ("/update_weights_from_distributed",
     {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "group_name": "g",
      "flush_cache": False, "weight_version": "v3", "load_format": "flattened_bucket"},
     "weight_sync", "update_from_distributed",
     pb.UpdateWeightsFromDistributedRequest(
         names=["w"], dtypes=["bfloat16"], shapes=[pb.TensorShape(dims=[2, 3])], group_name="g",
         flush_cache=False, weight_version="v3", load_format="flattened_bucket")),
    ("/destroy_weights_update_group", {}, "weight_sync", "destroy_group",
     pb.DestroyWeightsUpdateGroupRequest(group_name="weight_update_group")),
    ("/pause_generation", {}, "generation", "pause", pb.PauseGenerationRequest(mode="abort")),
    ("/pause_generation", {"mode": "retract"}, "generation", "pause",
     pb.PauseGenerationRequest(mode="retract")),
    ("/continue_generation", {}, "generation", "resume", pb.ContinueGenerationRequest()),
    ("/continue_generation", {"torch_empty_cache": True}, "generation", "resume",
     pb.ContinueGenerationRequest(torch_empty_cache=True)),
    ("/abort_request", {"rid": "r1"}, "generation", "abort", pb.AbortRequest(request_id="r1")),
    ("/abort_request", {"abort_all": True, "abort_message": "why"}, "generation", "abort",
     pb.AbortRequest(abort_all=True, reason="why")),
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/p/a"}, "lora", "load",
     pb.LoadLoRAAdapterRequest(lora_name="a", lora_path="/p/a", lora_id="a")),
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/p", "pinned": True, "lora_id": "i"},
     "lora", "load", pb.LoadLoRAAdapterRequest(lora_name="a", lora_path="/p", pinned=True,
                                               lora_id="i")),
    ("/unload_lora_adapter", {"lora_name": "a"}, "lora", "unload",
     pb.UnloadLoRAAdapterRequest(lora_name="a")),
])
def test_sglangs_body_becomes_the_rpc_request(path: str, body: dict, service: str, op: str,
                                              expected: Any) -> None:
    app, found = sidecar()
    status, answer = call(app, "POST", path, json=body)
    assert status == 200, answer
    name, request = getattr(found, service).calls[0]
    assert (name, request) == (op, expected)
    if expected.DESCRIPTOR.fields_by_name.get("flush_cache") is not None:
        assert request.HasField("flush_cache")  # SGLang's default (true) is sent, not unset


def test_answers_have_sglangs_shapes() -> None:
    app, _ = sidecar()
    assert call(app, "POST", "/update_weights_from_disk", json={"model_path": "/m"}) == (200, {
        "success": True, "message": "Succeeded to update model weights.",
        "num_paused_requests": 3})
    assert call(app, "POST", "/update_weight_version", json={"new_version": "x"}) == (200, {
        "success": True, "message": "Weight version updated to x", "new_version": "x"})
    assert call(app, "GET", "/get_weight_version") == (200, {"weight_version": "v7"})
    assert call(app, "POST", "/pause_generation")[1] == {
        "message": "Generation paused successfully.", "status": "ok", "success": True,
        "num_paused_requests": 2}
    assert call(app, "POST", "/continue_generation")[1]["message"] == \
        "Generation continued successfully."
    assert call(app, "POST", "/abort_request", json={"rid": "r"}) == (200, {
        "success": True, "message": ""})
    status, answer = call(app, "POST", "/load_lora_adapter",
                          json={"lora_name": "a", "lora_path": "/p/a"})
    assert (status, answer["loaded_adapters"], answer["error_message"]) == (
        200, {"a": "/p/a"}, None)
    # the parameter's first rows along dim 0, nested as SGLang's tolist() of weight[:n]
    assert call(app, "POST", "/get_weights_by_name", json={"name": "w", "truncate_size": 2}) \
        == (200, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    assert call(app, "GET", "/get_weights_by_name", json={"name": "w"})[1] == [
        [float(3 * r + c) for c in range(3)] for r in range(4)]
    status, answer = call(app, "GET", "/get_load")
    assert status == 200 and [(x["dp_rank"], x["num_reqs"], x["num_tokens"],
                               x["num_pending_tokens"]) for x in answer] == [
        (0, 3, 15, 5), (1, 4, 15, 5)]


def test_v1_loads_query() -> None:
    app, found = sidecar()
    status, answer = call(app, "GET", "/v1/loads")
    assert status == 200 and answer["version"] == "v" and len(answer["loads"]) == 2
    assert found.info.calls[-1][1] == pb.GetLoadsRequest(include=["all"])  # SGLang's default
    assert answer["loads"][1]["queues"]["waiting"] == 2
    call(app, "GET", "/v1/loads?include=core,%20memory&dp_rank=1")
    assert found.info.calls[-1][1] == pb.GetLoadsRequest(include=["core", "memory"], dp_rank=1)
    status, text = call(app, "GET", "/v1/loads?format=prometheus&include=core")
    assert status == 200 and 'sglang_num_running_reqs{dp_rank="1"} 2' in text
    for query, message in (("?dp_rank=x", "dp_rank: expected an integer"),
                           ("?format=xml", "format: expected json or prometheus"),
                           ("?includ=core", "unknown query parameter(s) 'includ'")):
        status, answer = call(app, "GET", "/v1/loads" + query)
        assert status == 400 and message in answer["message"] and not answer["success"]


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("path, body, message", [
    ("/update_weights_from_disk", {}, "model_path: required field missing"),
    ("/update_weights_from_disk", {"model_path": "/m", "modelpath": 1},
     "unknown field(s) 'modelpath'; this route takes: model_path, load_format"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path: expected a string, got a number"),
    ("/update_weights_from_disk", {"model_path": "/m", "is_async": True},
     "is_async: only false is supported here"),
    ("/update_weights_from_disk", {"model_path": "/m", "keep_pause": True},
     "keep_pause: only false is supported here: call /pause_generation"),
    ("/update_weights_from_disk", {"model_path": "/m", "token_step": 3},
     "token_step: only 0 is supported here"),
    ("/update_weights_from_disk", {"model_path": "/m", "manifest": {}},
     "manifest: only null is accepted here"),
    ("/update_weights_from_disk", {"model_path": "/m", "flush_cache": "yes"},
     "flush_cache: expected true or false, got a string"),
    ("/update_weight_version", {"new_version": None}, "new_version: required field missing"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": "p", "rank_offset": 1,
                                    "world_size": 2}, "master_port: expected an integer"),
    ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["f"], "shapes": [[1, True]]},
     "shapes[0]: expected a list of integers, got a list holding other values"),
    ("/update_weights_from_distributed", {"names": "w", "dtypes": [], "shapes": []},
     "names: expected a list of strings, got a string"),
    ("/release_memory_occupation", {"tags": "kv_cache"}, "tags: expected a list of strings"),
    ("/pause_generation", {"mode": 1}, "mode: expected a string, got a number"),
    ("/abort_request", {"rid": ["a"]}, "rid: expected a string, got a list"),
    ("/abort_request", {"finished_reason": {"type": "x"}}, "finished_reason: only null"),
    ("/load_lora_adapter", {"lora_name": "a"}, "lora_path: required field missing"),
    ("/unload_lora_adapter", {"lora_name": "a", "x": 1}, "unknown field(s) 'x'"),
    ("/get_weights_by_name", {"name": "w", "truncate_size": -1}, "truncate_size: must be at least 0"),
])
def test_a_bad_body_is_a_400_naming_the_field(path: str, body: dict, message: str) -> None:
    app, found = sidecar()
    status, answer = call(app, "POST", path, json=body)
    assert status == 400 and answer["success"] is False and message in answer["message"], answer
    assert not any(getattr(found, s).calls for s in ("weights", "weight_sync", "generation", "lora"))


def test_a_pickled_tensor_body_is_refused_unread() -> None:
    app, found = sidecar()
    status, answer = call(app, "POST", "/update_weights_from_tensor",
                          data=b"\x80\x04\x95 pickled bytes")
    assert (status, answer) == (400, {"success": False, "message": TENSOR_REFUSED})
    assert "UpdateWeightsFromTensor" in TENSOR_REFUSED and "never unpickles" in TENSOR_REFUSED
    assert not found.weight_sync.calls


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.NOT_FOUND, 400),
    (grpc.StatusCode.ALREADY_EXISTS, 400), (grpc.StatusCode.RESOURCE_EXHAUSTED, 400),
    (grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 400),
])
def test_service_refusals_are_sglangs_json_failures(code: grpc.StatusCode, status: int) -> None:
    app, found = sidecar()
    found.weight_sync.answers["destroy_group"] = ServiceError(code, "no such group")
    found.lora.answers["load"] = ServiceError(code, "an adapter named 'a' is already loaded")
    assert call(app, "POST", "/destroy_weights_update_group") == (status, {
        "success": False, "message": "no such group"})
    answer = call(app, "POST", "/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p"})
    assert answer[0] == status and "already loaded" in answer[1]["error_message"]


def test_unsuccessful_answers_are_400() -> None:
    app, found = sidecar()
    found.weights.answers["update_from_disk"] = pb.UpdateWeightsResponse(
        success=False, message="rank 0: no checkpoint at /x")
    assert call(app, "POST", "/update_weights_from_disk", json={"model_path": "/x"}) == (400, {
        "success": False, "message": "rank 0: no checkpoint at /x", "num_paused_requests": 0})
    found.weights.answers["release_memory"] = pb.AdminResponse(success=False, message="busy")
    assert call(app, "POST", "/release_memory_occupation") == (400, {
        "success": False, "message": "busy"})
    found.generation.answers["pause"] = pb.PauseGenerationResponse(success=False, message="m")
    assert call(app, "POST", "/pause_generation")[0] == 400
    found.generation.answers["abort"] = pb.AbortResponse(success=False, message="not in flight")
    assert call(app, "POST", "/abort_request", json={"rid": "r"}) == (200, {
        "success": False, "message": "not in flight"})  # SGLang answers 200 for any rid


def test_a_bug_is_a_500_that_tells_nothing() -> None:
    app, found = sidecar()
    found.weights.answers["resume_memory"] = RuntimeError("/secret")
    status, answer = call(app, "POST", "/resume_memory_occupation")
    assert status == 500 and "secret" not in json.dumps(answer) and not answer["success"]


# ---------------------------------------------------------------------- auth


ADMIN_ROUTES = [*BODIES, "/update_weights_from_tensor"]
API_ROUTES = [("GET", "/get_weight_version"), ("GET", "/get_load"), ("GET", "/v1/loads"),
              ("POST", "/abort_request")]


def test_each_new_route_follows_its_rpcs_auth_rule() -> None:
    auth = AuthInterceptor("k", "adm")
    app, _ = sidecar(auth.check, auth.check_admin)
    admin = [p for p in ADMIN_ROUTES if p != "/abort_request"]
    none, api, adm = ({}, {"headers": {"Authorization": "Bearer k"}},
                      {"headers": {"Authorization": "Bearer adm"}})
    got = calls(app, [("POST", p, kw) for p in admin for kw in (none, api, adm)])
    for i, path in enumerate(admin):
        assert got[3 * i][0] == 401 and got[3 * i + 1][0] == 401, path  # the API key: no
        assert got[3 * i + 2][0] != 401, path
    got = calls(app, [(m, p, kw) for m, p in API_ROUTES for kw in (none, api)])
    for i, (_, path) in enumerate(API_ROUTES):
        assert (got[2 * i][0], got[2 * i + 1][0]) == (401, 200), path
    # the admin key opens /abort_request too; abort_all is an admin op inside the Abort RPC
    # (the service asks for the admin key)
    assert call(app, "POST", "/abort_request", json={"rid": "r"}, **adm)[0] == 200
    assert call(app, "POST", "/abort_request", json={"rid": "r"},
                headers={"Authorization": "Bearer x"})[0] == 401
    app, found = sidecar(auth.check, auth.check_admin)
    found.generation.answers["abort"] = ServiceError(grpc.StatusCode.UNAUTHENTICATED, "admin")
    assert call(app, "POST", "/abort_request", json={"abort_all": True}, **api)[0] == 401


# ---------------------------------------------------------------------- fuzz


WRONG = {
    TEXT: [1, 1.5, True, [], {}, ["x"]],
    INTEGER: [True, 1.5, "x", "1e3", [], {}, 2**31, -(2**31) - 1],
    FLAG: [0, 1, "true", "", [], {}],
    TEXTS: ["x", 1, [1], [None], {}, [["x"]]],
    SHAPES: ["x", [1], [["a"]], [[-1]], [[True]], {}],
    NULL: [1, "x", [], {}, False],
}
VALID = {TEXT: "x", INTEGER: 1, FLAG: False, TEXTS: ["x"], SHAPES: [[1]], NULL: None}


def mutated(fields: tuple, rng: random.Random) -> bytes:
    """A body of ``fields`` that must be refused: a wrong type, an unknown field, a missing
    required one, broken JSON or not an object."""
    body: dict[str, Any] = {f.name: VALID[f.kind] for f in fields if f.required}
    kind = rng.randrange(5)
    if kind == 0:
        f = rng.choice(fields)
        body[f.name] = rng.choice(WRONG[f.kind])
    elif kind == 1:
        body[rng.choice(["x", "modelpath", "Rid", "lora", "", "\u00e9"])] = 1
    elif kind == 2 and any(f.required for f in fields):
        del body[rng.choice([f.name for f in fields if f.required])]
    elif kind == 3:
        return json.dumps(body).encode()[:-1] or b"{"
    else:
        return rng.choice([b"[]", b"1", b'"x"', b"null", b"\xff", b"[" * 5000])
    return json.dumps(body).encode()


def test_fuzzed_bodies_are_400s_that_reach_no_service() -> None:
    app, found = sidecar()
    rng = random.Random(51)
    requests = [("POST", path, {"data": mutated(fields, rng)})
                for _ in range(12) for path, fields in BODIES.items()]
    got = calls(app, requests)
    bad = [(r[1], r[2], g) for r, g in zip(requests, got, strict=True)
           if g[0] != 400 or not isinstance(g[1], dict) or g[1].get("success") is not False
           or not g[1].get("message")]
    assert not bad, bad[:5]
    assert not any(getattr(found, s).calls for s in ("weights", "weight_sync", "generation", "lora"))
