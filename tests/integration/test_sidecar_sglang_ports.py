"""SGLang's own HTTP-mode tests of its admin routes, ported to start our worker and point
at its HTTP sidecar (generation goes over gRPC: the sidecar serves no /generate).

One worker for the module: checkpoint A (a tiny random Qwen2), ``--enable-lora``; a
checkpoint B of the same shapes and two PEFT adapters beside it. Every test leaves the
worker as it found it (on A, not paused, nothing released, no adapter loaded).

Ported, and what differs from the original (each difference also in docs/operations.md):

- test/srt/test_update_weights_from_disk.py (``test_update_weights``,
  ``test_update_weights_unexist_model``): as written; the decodes run over gRPC and are
  compared token for token instead of as text (greedy, no detokenizer here).
- test/srt/test_weight_version.py: as written for /get_model_info, /get_weight_version,
  /update_weight_version and /update_weights_from_disk with ``weight_version``. Not
  ported: the start flag ``--weight-version`` (this server has none: the version starts
  as GetModelInfo says and is set by these routes) and the version in /generate's
  ``meta_info`` and the OpenAI ``metadata`` (no inference routes on the sidecar;
  GenerateComplete carries no weight_version).
- test/srt/test_release_memory_occupation.py: its server-mode flow (release, resume, the
  same greedy output after) and SGLang's tags. Its GPU-memory readings are
  torch.cuda.mem_get_info; here the released bytes come from the RPC (docs/rpc.md), and a
  request sent while released waits for the resume, which this port checks instead.
  SGLang answers a release with ``null``; this server with ``{"success", "message"}``.
- pause/continue (SGLang's RL tests call /pause_generation ``{"mode": "in_place"}`` and
  /continue_generation ``{}`` around a refit): in_place keeps the requests and they end as
  an unpaused run; the default mode ("abort") aborts what is in flight and a request sent
  while paused waits for /continue_generation.
- test/srt/test_abort.py ``TestAbortAll``: 8 streams of up to 400 tokens (the tiny model's
  context is 512) instead of 32 of 16000; each ends with finish_reason "abort". Plus
  /abort_request by ``rid``. ``TestAbort`` (a memory-leak check of SGLang's own pools) and
  ``TestAbortAllWithRetraction`` (SGLang's test-only retraction environment variables) are
  not ported.
- test/srt/lora/test_lora_update.py (its HTTP mode): load, load again ("already loaded",
  400), generate under the adapter, unload; ``loaded_adapters`` as SGLang returns it
  (name -> path). The adapter is selected by GenerateRequest.lora_id (the route makes the
  name the id) instead of /generate's ``lora_path``.
- test/srt/test_update_weights_from_distributed.py's server mode, on gloo (CPU) instead
  of NCCL, with one trainer rank in this process pushing checkpoint B; the worker then
  decodes as transformers on B, token for token.
- test/srt/test_get_weights_by_name.py's server mode: the first rows of a parameter equal
  the checkpoint's.
Also: /get_load and /v1/loads, /update_weights_from_tensor refused, the trainer-group
routes' refusals, and a bounded fuzz of every new route after which the worker serves the
same greedy output.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    ServerProc,
    free_port,
    greedy,
    run_generate,
    start_server,
    wait_started,
)
from tests.integration.test_faults import Stream
from tests.unit.test_sidecar_routes import BODIES, mutated

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
import torch.distributed as dist  # noqa: E402

from tests.integration.sglang_trainer import init_custom_process_group  # noqa: E402
from tests.integration.test_refit import build_qwen2, hf_greedy  # noqa: E402
from tests.lora_models import build_adapter, build_base  # noqa: E402

PROMPT = [5, 9, 33, 70, 12, 8]
TIMEOUT = 120
LONG = 400  # tokens: still running when the next HTTP call lands (the context is 512)


@dataclass
class World:
    srv: ServerProc
    a: Path
    b: Path
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("ports")
    a = build_base("qwen2", root / "a")
    srv = start_server(root, "--model-path", str(a), "--dtype", "float32", "--enable-lora",
                       "--max-loaded-loras", "2", "--max-lora-rank", "8", "--log-requests",
                       wait=False)
    try:  # B and the adapters are built while the worker boots
        b = build_qwen2(root / "b", seed=7)
        adapters = {name: build_adapter(a, name, root / name, seed)
                    for seed, name in enumerate(["attn", "mlp"], start=1)}
        wait_started(srv)
        yield World(srv, a, b, adapters)
    finally:
        srv.stop()


def http(srv: ServerProc, method: str, path: str, body: Any = None,
         data: bytes | None = None) -> tuple[int, Any]:
    """(status, JSON body or text) of one request to the worker's sidecar."""
    if body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(srv.http_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def decode(srv: ServerProc, n: int = 16, **kw: Any) -> list[int]:
    tokens, _ = run_generate(srv.stub(), greedy(PROMPT, n, **kw), timeout=TIMEOUT)
    return tokens


def model_path(srv: ServerProc) -> str:
    status, info = http(srv, "GET", "/get_model_info")
    assert status == 200, info
    return info["model_path"]


def streams(srv: ServerProc, n: int, tokens: int, **kw: Any) -> list[Stream]:
    """``n`` streaming greedy requests in threads, each past its first token."""
    stub = srv.stub()
    out = [Stream(stub, greedy([7 + i, 40, 41, 42], tokens, stream=True, **kw))
           for i in range(n)]
    for s in out:
        s.start()
    for s in out:
        assert s.first.wait(TIMEOUT)
    return out


# ---------------------------------------------------------------------- update weights from disk


def test_update_weights(world: World) -> None:
    srv = world.srv
    origin_model_path = model_path(srv)
    assert origin_model_path == str(world.a)
    origin = decode(srv)
    status, ret = http(srv, "POST", "/update_weights_from_disk", {"model_path": str(world.b)})
    assert status == 200 and ret["success"], ret
    assert ret["num_paused_requests"] == 0
    assert model_path(srv) == str(world.b) != origin_model_path
    assert decode(srv) != origin
    status, ret = http(srv, "POST", "/update_weights_from_disk",
                       {"model_path": origin_model_path})
    assert status == 200 and ret["success"], ret
    assert model_path(srv) == origin_model_path
    assert decode(srv) == origin


def test_update_weights_unexist_model(world: World) -> None:
    srv = world.srv
    origin_model_path = model_path(srv)
    origin = decode(srv)
    status, ret = http(srv, "POST", "/update_weights_from_disk",
                       {"model_path": origin_model_path + "wrong"})
    assert status == 400 and ret["success"] is False and ret["message"], ret
    assert model_path(srv) == origin_model_path
    assert decode(srv) == origin


# ---------------------------------------------------------------------- weight version


def test_weight_version(world: World) -> None:
    srv = world.srv
    status, info = http(srv, "GET", "/get_model_info")
    assert status == 200 and "weight_version" in info
    assert http(srv, "GET", "/get_weight_version") == (
        200, {"weight_version": info["weight_version"]})
    status, data = http(srv, "POST", "/update_weight_version",
                        {"new_version": "updated_version_2.0", "abort_all_requests": False})
    assert status == 200 and data["success"] and data["new_version"] == "updated_version_2.0"
    assert http(srv, "GET", "/get_weight_version")[1]["weight_version"] == "updated_version_2.0"
    status, data = http(srv, "POST", "/update_weight_version",
                        {"new_version": "final_version_3.0", "abort_all_requests": True})
    assert status == 200 and data["success"] and data["new_version"] == "final_version_3.0"
    assert http(srv, "GET", "/get_weight_version")[1]["weight_version"] == "final_version_3.0"
    assert http(srv, "GET", "/get_model_info")[1]["weight_version"] == "final_version_3.0"
    # test_update_weight_version_with_weight_updates
    status, data = http(srv, "POST", "/update_weights_from_disk", {
        "model_path": model_path(srv), "load_format": "auto", "abort_all_requests": False,
        "weight_version": "disk_update_v2.0.0"})
    assert status == 200, data
    assert http(srv, "GET", "/get_weight_version")[1]["weight_version"] == "disk_update_v2.0.0"


# ---------------------------------------------------------------------- memory


def test_release_and_resume_memory_occupation(world: World) -> None:
    srv = world.srv
    origin = decode(srv)
    status, ret = http(srv, "POST", "/release_memory_occupation", {})
    assert status == 200 and ret["success"], ret
    waiting = Stream(srv.stub(), greedy(PROMPT, 16))
    waiting.start()
    time.sleep(1.0)
    assert waiting.is_alive()  # it waits while the memory is released
    status, ret = http(srv, "POST", "/resume_memory_occupation", {})
    assert status == 200 and ret["success"], ret
    waiting.join(TIMEOUT)
    assert waiting.complete is not None and list(waiting.complete.output_ids) == origin
    # SGLang's tags, one at a time; a second release of a tag is refused and changes nothing
    assert http(srv, "GET", "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    status, ret = http(srv, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 400 and ret["success"] is False and "already released" in ret["message"]
    assert http(srv, "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    status, ret = http(srv, "POST", "/release_memory_occupation", {"tags": ["gpu"]})
    assert status == 400 and "unknown memory tag" in ret["message"]
    assert decode(srv) == origin


# ---------------------------------------------------------------------- pause / continue


def test_pause_in_place_and_continue(world: World) -> None:
    srv = world.srv
    stub = srv.stub()
    reference = [run_generate(stub, greedy([7 + i, 40, 41, 42], LONG), timeout=TIMEOUT)[0]
                 for i in range(3)]
    running = streams(srv, 3, LONG)
    status, ret = http(srv, "POST", "/pause_generation", {"mode": "in_place"})
    assert status == 200 and ret["message"] == "Generation paused successfully." \
        and ret["status"] == "ok", ret
    time.sleep(0.5)
    assert all(s.is_alive() for s in running)  # held, not ended
    status, ret = http(srv, "POST", "/continue_generation", {})
    assert (status, ret["message"], ret["status"]) == (
        200, "Generation continued successfully.", "ok")
    for s, expected in zip(running, reference, strict=True):
        s.join(TIMEOUT)
        assert s.complete is not None and s.complete.finish_reason == "length"
        assert s.tokens == expected  # paused in place, continued: as an unpaused run


def test_pause_abort_and_a_request_waits_for_continue(world: World) -> None:
    srv = world.srv
    origin = decode(srv)
    running = streams(srv, 2, LONG)
    status, ret = http(srv, "POST", "/pause_generation")  # no body: mode abort
    assert status == 200 and ret["num_paused_requests"] >= 1, ret
    for s in running:
        s.join(TIMEOUT)
        assert s.complete is not None and s.complete.finish_reason == "abort"
    waiting = Stream(srv.stub(), greedy(PROMPT, 16))
    waiting.start()
    time.sleep(1.0)
    assert waiting.is_alive()
    assert http(srv, "POST", "/continue_generation")[0] == 200
    waiting.join(TIMEOUT)
    assert waiting.complete is not None and list(waiting.complete.output_ids) == origin


# ---------------------------------------------------------------------- abort


def test_abort_all(world: World) -> None:
    srv = world.srv
    running = streams(srv, 8, LONG)
    status, ret = http(srv, "POST", "/abort_request", {"abort_all": True})
    assert status == 200 and ret["success"], ret
    for s in running:
        s.join(TIMEOUT)
        assert s.complete is not None and s.complete.finish_reason == "abort"


def test_abort_one_request_by_rid(world: World) -> None:
    srv = world.srv
    one = streams(srv, 1, LONG, request_id="port-abort-1")[0]
    other = streams(srv, 1, 40)[0]
    status, ret = http(srv, "POST", "/abort_request", {"rid": "port-abort-1"})
    assert (status, ret["success"]) == (200, True), ret
    one.join(TIMEOUT)
    other.join(TIMEOUT)
    assert one.complete is not None and one.complete.finish_reason == "abort"
    assert other.complete is not None and other.complete.finish_reason == "length"
    status, ret = http(srv, "POST", "/abort_request", {"rid": "port-abort-1"})
    assert status == 200 and ret["success"] is False and "not in flight" in ret["message"]


# ---------------------------------------------------------------------- LoRA


def test_lora_load_generate_unload(world: World) -> None:
    srv = world.srv
    base = decode(srv)
    status, ret = http(srv, "POST", "/load_lora_adapter",
                       {"lora_name": "attn", "lora_path": str(world.adapters["attn"])})
    assert status == 200 and ret["success"], ret
    assert ret["loaded_adapters"] == {"attn": str(world.adapters["attn"])}
    status, ret = http(srv, "POST", "/load_lora_adapter",
                       {"lora_name": "attn", "lora_path": str(world.adapters["attn"])})
    assert status == 400 and "already loaded" in json.dumps(ret)
    assert decode(srv, lora_id="attn") != base
    status, ret = http(srv, "POST", "/load_lora_adapter", {
        "lora_name": "mlp", "lora_path": str(world.adapters["mlp"]), "pinned": False})
    assert status == 200 and set(ret["loaded_adapters"]) == {"attn", "mlp"}
    status, ret = http(srv, "POST", "/unload_lora_adapter", {"lora_name": "attn"})
    assert status == 200 and set(ret["loaded_adapters"]) == {"mlp"}
    status, ret = http(srv, "POST", "/unload_lora_adapter", {"lora_name": "mlp"})
    assert status == 200 and ret["loaded_adapters"] == {}
    status, ret = http(srv, "POST", "/unload_lora_adapter", {"lora_name": "mlp"})
    assert status == 400 and ret["success"] is False
    status, ret = http(srv, "POST", "/load_lora_adapter",
                       {"lora_name": "x", "lora_path": str(world.b)})
    assert status == 400 and ret["success"] is False and ret["error_message"]
    assert decode(srv) == base


# ---------------------------------------------------------------------- weights, loads


def test_get_weights_by_name(world: World) -> None:
    tensors = safetensors_torch.load_file(world.a / "model.safetensors")
    for name, truncate in (("model.embed_tokens.weight", 3), ("model.norm.weight", 100),
                           ("model.layers.0.self_attn.q_proj.weight", 2)):
        status, got = http(world.srv, "POST", "/get_weights_by_name",
                           {"name": name, "truncate_size": truncate})
        assert status == 200, got
        expected = tensors[name][:truncate]
        assert torch.allclose(torch.tensor(got, dtype=torch.float32), expected), name
    status, got = http(world.srv, "GET", "/get_weights_by_name", {"name": "no.such.weight"})
    assert status == 400 and got["success"] is False and got["message"]


def test_get_load_and_v1_loads(world: World) -> None:
    srv = world.srv
    running = streams(srv, 2, LONG)
    try:
        deadline = time.time() + 30  # the ranks publish their state every few steps
        while True:
            status, loads = http(srv, "GET", "/get_load")
            assert status == 200 and len(loads) == 1 and loads[0]["dp_rank"] == 0
            if loads[0]["num_reqs"] >= 1 or time.time() > deadline:
                break
            time.sleep(0.05)
        assert loads[0]["num_reqs"] >= 1 and loads[0]["num_tokens"] > 0, loads
        status, found = http(srv, "GET", "/v1/loads")
        assert status == 200 and found["version"] and found["timestamp"]
        one = found["loads"][0]
        assert one["num_running_reqs"] >= 1 and {"memory", "queues"} <= set(one)
        status, found = http(srv, "GET", "/v1/loads?include=core&dp_rank=0")
        assert status == 200 and "memory" not in found["loads"][0]
        status, text = http(srv, "GET", "/v1/loads?format=prometheus")
        assert status == 200 and 'sglang_num_running_reqs{dp_rank="0"}' in text
    finally:
        http(srv, "POST", "/abort_request", {"abort_all": True})
        for s in running:
            s.join(TIMEOUT)
    status, found = http(srv, "GET", "/v1/loads?include=gpu")
    assert status == 400 and "unknown include section" in found["message"]
    status, found = http(srv, "GET", "/v1/loads?dp_rank=3")
    assert status == 400 and "out of range" in found["message"]


# ---------------------------------------------------------------------- trainer routes, tensors


def test_update_weights_from_distributed(world: World) -> None:
    """SGLang's test_update_weights_from_distributed.py in server mode, on gloo: the trainer
    (here, this process with SGLang's init_custom_process_group) joins as rank 0 while
    /init_weights_update_group runs, broadcasts every parameter of checkpoint B while
    /update_weights_from_distributed runs; the worker then decodes as transformers on B."""
    srv = world.srv
    origin = decode(srv)
    model_b = transformers.AutoModelForCausalLM.from_pretrained(world.b, dtype=torch.float32)
    expected = hf_greedy(model_b.eval(), PROMPT, 16)
    port, answers = free_port(), {}

    def post(key: str, path: str, body: dict) -> threading.Thread:
        t = threading.Thread(target=lambda: answers.__setitem__(key, http(srv, "POST", path, body)))
        t.start()
        return t

    joining = post("init", "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "port-group", "backend": "gloo"})
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                   timeout=timedelta(seconds=TIMEOUT), world_size=2, rank=0,
                                   group_name="port-group")
    try:
        joining.join(TIMEOUT)
        status, ret = answers["init"]
        assert status == 200 and ret["success"], ret
        params = list(model_b.named_parameters())
        pushing = post("update", "/update_weights_from_distributed", {
            "names": [n for n, _ in params],
            "dtypes": [str(p.dtype).removeprefix("torch.") for _, p in params],
            "shapes": [list(p.shape) for _, p in params], "group_name": "port-group",
            "weight_version": "dist-1"})
        for _, p in params:
            dist.broadcast(p.data, src=0, group=pg)
        pushing.join(TIMEOUT)
        status, ret = answers["update"]
        assert status == 200 and ret["success"], ret
        assert decode(srv) == expected != origin
        assert http(srv, "GET", "/get_weight_version")[1]["weight_version"] == "dist-1"
        status, ret = http(srv, "POST", "/destroy_weights_update_group",
                           {"group_name": "port-group"})
        assert status == 200 and ret["success"], ret
    finally:
        dist.destroy_process_group(pg)
    status, ret = http(srv, "POST", "/update_weights_from_disk", {"model_path": str(world.a)})
    assert status == 200 and ret["success"], ret
    assert decode(srv) == origin


def test_trainer_group_routes_refuse_what_the_rpc_refuses(world: World) -> None:
    srv = world.srv
    status, ret = http(srv, "POST", "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 0, "world_size": 2,
        "backend": "gloo"})
    assert status == 400 and ret["success"] is False and "rank_offset" in ret["message"]
    status, ret = http(srv, "POST", "/destroy_weights_update_group", {"group_name": "nope"})
    assert status == 400 and ret["success"] is False and ret["message"]
    status, ret = http(srv, "POST", "/update_weights_from_distributed", {
        "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
        "group_name": "nope"})
    assert status == 400 and ret["success"] is False and ret["message"]


def test_update_weights_from_tensor_is_refused_with_the_way_to_the_rpc(world: World) -> None:
    # what SGLang's client sends: MultiprocessingSerializer's pickled handles, base64'd
    body = {"serialized_named_tensors": ["gASVAAAAAAAAAAB9lC4="], "load_format": None,
            "flush_cache": True}
    status, ret = http(world.srv, "POST", "/update_weights_from_tensor", body)
    assert status == 400 and ret["success"] is False
    assert "pickled" in ret["message"] and "UpdateWeightsFromTensor RPC" in ret["message"]


# ---------------------------------------------------------------------- fuzz


def test_fuzzed_bodies_are_400s_and_the_worker_keeps_serving(world: World) -> None:
    srv = world.srv
    origin = decode(srv)
    rng = random.Random(1251)
    seen = []
    for _ in range(5):
        for path, fields in BODIES.items():
            status, ret = http(srv, "POST", path, data=mutated(fields, rng))
            seen.append((path, status))
            assert status == 400 and isinstance(ret, dict) and ret["success"] is False \
                and ret["message"], (path, status, ret)
    assert len(seen) == 5 * len(BODIES)
    assert http(srv, "GET", "/health")[0] == 200
    assert model_path(srv) == str(world.a)
    assert decode(srv) == origin
