"""Multi-LoRA serving against peft, the LoRA RPCs' life cycle, eviction and the cache."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ROOT, Prestart, ServerProc, greedy, run_generate, start_server
from tests.lora_models import build_adapter, build_base, peft_model, reference

torch = pytest.importorskip("torch")

# (adapter or None for the base model, prompt, new tokens): one batch, mixed adapters
MIX = [
    (None, [3, 14, 15, 92, 65, 35], 12),
    ("attn", [3, 14, 15, 92, 65, 35], 12),
    ("attn", [27, 18, 28], 16),
    ("mlp", list(range(40, 140)), 10),  # last: its prefill takes the step's remaining budget
]
SERVER_ARGS = ("--dtype", "float32", "--max-prefill-tokens", "64", "--enable-lora",
               "--max-loaded-loras", "2", "--max-lora-rank", "8")


KINDS = ["qwen2", "llama"]


@pytest.fixture(scope="module")
def kinds_ahead(tmp_path_factory) -> tuple[Prestart, dict[str, dict[str, Path]]]:
    """Each kind's base, adapters and worker, the next kind's started while one's tests run."""
    files: dict[str, dict[str, Path]] = {}

    def start(kind: str) -> ServerProc:
        root = tmp_path_factory.mktemp(f"lora-{kind}")
        base = build_base(kind, root / "base")
        adapters = {name: build_adapter(base, name, root / name, seed)
                    for seed, name in enumerate(["attn", "mlp"], start=1)}
        adapters["base"] = base
        files[kind] = adapters
        return start_server(root, "--model-path", str(base), *SERVER_ARGS,
                            "--lora-paths", f"attn={adapters['attn']}", wait=False)

    return Prestart(KINDS, start), files


@pytest.fixture(scope="module", params=KINDS)
def lora_worker(request, kinds_ahead) -> Iterator[tuple[str, ServerProc, dict[str, Path]]]:
    prestart, files = kinds_ahead
    srv = prestart.take(request.param)
    yield request.param, srv, files[request.param]
    srv.stop()


def _load(stub, name: str, path: Path, lora_id: str = "", pinned: bool = False):
    return stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
        lora_name=name, lora_path=str(path), lora_id=lora_id or name, pinned=pinned), timeout=60)


def _listed(stub) -> list[str]:
    resp = stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), timeout=10)
    return [a.lora_id for a in resp.loaded_adapters]


def _reset(stub, adapters: dict[str, Path], keep: tuple[str, ...] = ()) -> None:
    """Unload every adapter but ``keep``, and load those of ``keep`` that are not loaded."""
    listed = _listed(stub)
    for lora_id in listed:
        if lora_id not in keep:
            assert stub.UnloadLoRAAdapter(
                pb.UnloadLoRAAdapterRequest(lora_id=lora_id), timeout=60).success
    for name in keep:
        if name not in listed:
            assert _load(stub, name, adapters[name]).success


def test_mixed_batch_equals_peft_token_for_token(lora_worker) -> None:
    kind, srv, adapters = lora_worker
    stub = srv.stub()
    _reset(stub, adapters, keep=("attn",))
    assert _load(stub, "mlp", adapters["mlp"]).success
    assert sorted(_listed(stub)) == ["attn", "mlp"]
    # queued while paused, then admitted together: one batch from the first step on
    assert stub.PauseGeneration(pb.PauseGenerationRequest(mode="in_place"), timeout=30).success
    with cf.ThreadPoolExecutor(len(MIX)) as pool:
        futures = [
            pool.submit(run_generate, stub,
                        greedy(p, n, return_logprob=True, lora_id=lora or ""), timeout=120)
            for lora, p, n in MIX
        ]
        for _ in range(600):
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            if info.rank_states[0].num_waiting_reqs == len(MIX):
                break
            time.sleep(0.05)
        assert info.rank_states[0].num_waiting_reqs == len(MIX)
        assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
        results = [f.result() for f in futures]
    model = peft_model(adapters["base"], {k: adapters[k] for k in ("attn", "mlp")})
    for (lora, prompt, n), (tokens, complete) in zip(MIX, results):
        ref_tokens, ref_logprobs = reference(model, lora, prompt, n)
        assert tokens == ref_tokens, (kind, lora)
        ours = list(complete.output_logprobs.token_logprobs)
        assert len(ours) == n
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4, (kind, lora)
    # the adapter really changes the output of the same prompt
    assert results[0][0] != results[1][0]


def test_same_prompt_under_two_adapters_shares_no_cache(lora_worker) -> None:
    _, srv, adapters = lora_worker
    stub = srv.stub()
    _reset(stub, adapters, keep=("attn",))
    assert _load(stub, "mlp", adapters["mlp"]).success
    prompt = list(range(200, 260))
    cached = {}
    for run, lora in enumerate(["attn", "mlp", "", "attn"]):
        _, complete = run_generate(stub, greedy(prompt, 2, lora_id=lora), timeout=60)
        cached[(run, lora)] = complete.cached_tokens
    assert cached[(0, "attn")] == 0
    assert cached[(1, "mlp")] == 0  # the same tokens, cached under "attn" only
    assert cached[(2, "")] == 0  # nor the base model
    assert cached[(3, "attn")] == len(prompt) - 1  # while "attn" reuses its own


@pytest.mark.parametrize("lora_worker", ["qwen2"], indirect=True)  # once is enough
def test_load_list_generate_unload_while_in_use(lora_worker) -> None:
    kind, srv, adapters = lora_worker
    stub = srv.stub()
    _reset(stub, adapters)
    resp = _load(stub, "mine", adapters["mlp"], lora_id="id-1")
    assert resp.success and list(resp.loaded_lora_ids) == ["id-1"]
    assert [r.success for r in resp.rank_results] == [True]
    listed = stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), timeout=10)
    assert [(a.lora_id, a.lora_name, a.lora_path, a.pinned) for a in listed.loaded_adapters] \
        == [("id-1", "mine", str(adapters["mlp"]), False)]
    loads = stub.GetLoads(pb.GetLoadsRequest(include=["lora"]), timeout=10)
    assert (loads.loads[0].lora.slots_used, loads.loads[0].lora.slots_total) == (1, 2)

    # a request that uses the adapter is running (held by an in_place pause)
    stream = stub.Generate(greedy([5, 6, 7], 40, lora_id="id-1", stream=True), timeout=120)
    first = next(stream)
    assert first.HasField("chunk")
    assert stub.PauseGeneration(pb.PauseGenerationRequest(mode="in_place"), timeout=30).success
    with cf.ThreadPoolExecutor(1) as pool:
        unload = pool.submit(stub.UnloadLoRAAdapter,
                             pb.UnloadLoRAAdapterRequest(lora_id="id-1"), timeout=120)
        refused = None
        for _ in range(200):  # until the unload reached the rank: new users are refused
            try:
                run_generate(stub, greedy([1, 2], 1, lora_id="id-1"), timeout=30)
            except grpc.RpcError as err:
                refused = err
                if "being unloaded" in err.details():
                    break
        assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "being unloaded" in refused.details()
        assert not unload.done()  # its user cannot finish while paused
        assert _listed(stub) == ["id-1"]
        assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
        result = unload.result()
    assert result.success and list(result.loaded_lora_ids) == []
    responses = [first, *stream]
    complete = responses[-1].complete
    assert complete.finish_reason == "length" and complete.completion_tokens == 40
    assert _listed(stub) == []
    with pytest.raises(grpc.RpcError) as err:
        run_generate(stub, greedy([1, 2], 1, lora_id="id-1"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not loaded" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_id="id-1"), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("lora_worker", ["qwen2"], indirect=True)  # once is enough
def test_eviction_is_lru_and_spares_pinned(lora_worker) -> None:
    kind, srv, adapters = lora_worker
    stub = srv.stub()
    _reset(stub, adapters)
    path = adapters["attn"]
    assert _load(stub, "a", path).success and _load(stub, "b", path).success
    run_generate(stub, greedy([9, 9], 1, lora_id="a"), timeout=60)  # "b" is now the LRU
    resp = _load(stub, "c", path)
    assert resp.success and "evicted b" in resp.message
    assert sorted(resp.loaded_lora_ids) == ["a", "c"]

    assert stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="a"), timeout=30).success
    assert _load(stub, "p", path, pinned=True).success
    run_generate(stub, greedy([9, 9], 1, lora_id="c"), timeout=60)  # "p" is now the LRU
    resp = _load(stub, "d", path)
    assert resp.success and "evicted c" in resp.message  # the pinned one stays
    assert sorted(resp.loaded_lora_ids) == ["d", "p"]

    assert stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_id="d"), timeout=30).success
    with pytest.raises(grpc.RpcError) as err:  # pinning both slots would starve the rest
        _load(stub, "q", path, pinned=True)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "not allowed to pin all slots" in err.value.details()
    assert sorted(_listed(stub)) == ["p"]
    _reset(stub, adapters)


def _broken(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("lora_worker", ["llama"], indirect=True)  # once is enough
def test_load_refuses_what_does_not_fit_the_base_model(lora_worker, tmp_path) -> None:
    kind, srv, adapters = lora_worker
    stub = srv.stub()
    _reset(stub, adapters)
    from safetensors.torch import load_file, save_file

    shape = tmp_path / "shape"
    shutil.copytree(adapters["attn"], shape)
    tensors = load_file(shape / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = tensors[key][:, :32].contiguous()
    save_file(tensors, shape / "adapter_model.safetensors")
    (tmp_path / "empty").mkdir()
    cases = [
        (_broken(adapters["attn"], tmp_path / "rank", r=16), "r=16 exceeds --max-lora-rank 8"),
        (_broken(adapters["attn"], tmp_path / "target", target_modules=["q_proj", "lm_head"]),
         "unknown target module(s) lm_head"),
        (shape, "shape mismatch"),
        (tmp_path / "empty", "missing file: adapter_config.json"),
        (tmp_path / "nowhere", "is not a directory"),
    ]
    for path, needle in cases:
        with pytest.raises(grpc.RpcError) as err:
            _load(stub, "bad", path)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
        assert needle in err.value.details(), err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
            lora_name="x", lora_path=str(adapters["attn"])), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_id" in err.value.details()
    assert _listed(stub) == []  # nothing half-loaded; the worker still serves
    tokens, _ = run_generate(stub, greedy([1, 2, 3], 3), timeout=60)
    assert len(tokens) == 3


@pytest.mark.parametrize("lora_worker", ["llama"], indirect=True)  # once is enough
def test_client_and_cli(lora_worker) -> None:
    kind, srv, adapters = lora_worker
    from sglang_admin.client import Client

    _reset(srv.stub(), adapters)
    with Client(srv.target) as client:
        resp = client.load_lora_adapter("m", str(adapters["mlp"]), lora_id="m-1", pinned=True)
        assert resp.success and list(resp.loaded_lora_ids) == ["m-1"]
        result = client.generate_tokens([4, 5, 6], 5, lora_id="m-1")
        assert len(result.tokens) == 5
        assert [a.pinned for a in client.list_lora_adapters().loaded_adapters] == [True]
        assert client.unload_lora_adapter(lora_id="m-1").success

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "sglang_admin", "lora", *argv, "--target", srv.target],
            capture_output=True, text=True, timeout=120, cwd=ROOT)

    done = cli("load", "cli", str(adapters["attn"]), "--id", "cli-1")
    assert done.returncode == 0, done.stderr
    assert "loaded LoRA adapter 'cli' as 'cli-1'" in done.stdout
    done = cli("list", "--json")
    assert done.returncode == 0 and '"lora_id": "cli-1"' in done.stdout, done.stdout
    done = cli("unload", "--name", "cli")
    assert done.returncode == 0 and "unloaded" in done.stdout, done.stdout
    done = cli("unload", "--name", "cli")
    assert done.returncode != 0 and "NOT_FOUND" in done.stdout + done.stderr


def test_lora_rpcs_without_enable_lora(server: ServerProc) -> None:
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as err:
        stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-lora" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        run_generate(stub, greedy([1, 2], 1, lora_id="x"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_id" in err.value.details()


def test_dp2_loads_on_every_rank_behind_the_admin_key(tmp_path: Path) -> None:
    from sglang_admin.model.default_model import ensure_default_model
    from sglang_admin.server.interceptors import ADMIN_METHODS, SERVICE

    assert {f"/{SERVICE}/LoadLoRAAdapter", f"/{SERVICE}/UnloadLoRAAdapter"} <= ADMIN_METHODS
    adapter = build_adapter(Path(ensure_default_model()), "attn", tmp_path / "x", seed=7)
    srv = start_server(tmp_path, "--dp-size", "2", "--enable-lora", "--max-lora-rank", "8",
                       "--admin-api-key", "k-123")
    try:
        stub = srv.stub()
        with pytest.raises(grpc.RpcError) as err:
            _load(stub, "x", adapter)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        key = [("authorization", "Bearer k-123")]
        resp = stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
            lora_name="x", lora_path=str(adapter), lora_id="x"), timeout=60, metadata=key)
        assert resp.success and [(r.dp_rank, r.success) for r in resp.rank_results] \
            == [(0, True), (1, True)]
        loads = stub.GetLoads(pb.GetLoadsRequest(include=["lora"]), timeout=10)
        assert [(x.lora.slots_used, x.lora.slots_total) for x in loads.loads] == [(1, 8)] * 2
        prompt = [5, 6, 7, 8]
        outs = [run_generate(stub, greedy(prompt, 6, lora_id="x", data_parallel_rank=r),
                             timeout=60)[0] for r in (0, 1)]
        base, _ = run_generate(stub, greedy(prompt, 6), timeout=60)
        assert outs[0] == outs[1] != base
        resp = stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="x"), timeout=60,
                                      metadata=key)
        assert resp.success and len(resp.rank_results) == 2 and not resp.loaded_lora_ids
    finally:
        srv.stop()
