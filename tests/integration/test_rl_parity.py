"""Four behaviours of the RL surface that SGLang's own tests rely on, through the wire on a
tied Qwen2 checkpoint with LoRA enabled (issue 34): the KV figures of GetLoads and
GetServerInfo (used = held by requests; a retract frees it), GetWeightsByName of a tied
model's LM head, release/resume misuse refused, and no pin of the last LoRA slot."""

from __future__ import annotations

import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, greedy, run_generate, start_server
from tests.integration.test_refit import Stream
from tests.lora_models import build_adapter, build_base

safetensors_torch = pytest.importorskip("safetensors.torch")

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, Path, Path]]:
    root = tmp_path_factory.mktemp("rl-parity")
    base = build_base("qwen2", root / "base")  # tie_word_embeddings = true
    adapter = build_adapter(base, "attn", root / "attn", seed=1)
    srv = start_server(root, "--model-path", str(base), "--dtype", "float32",
                       "--enable-lora", "--max-loaded-loras", "2", "--max-lora-rank", "8")
    yield srv, base, adapter
    srv.stop()


def _load(stub) -> pb.SchedulerLoad:
    resp = stub.GetLoads(pb.GetLoadsRequest(include=["all"]), timeout=10)
    (load,) = resp.loads
    assert load.num_used_tokens + load.num_evictable_tokens + load.num_free_tokens \
        == load.max_total_num_tokens, load
    assert load.token_usage == pytest.approx(load.num_used_tokens / load.max_total_num_tokens)
    return load


def _idle_load(stub, timeout: float = 30) -> pb.SchedulerLoad:
    deadline = time.time() + timeout
    while True:
        load = _load(stub)
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0:
            return load
        assert time.time() < deadline, load
        time.sleep(0.05)


def test_kv_figures_on_a_warm_idle_worker_and_across_a_retract(worker) -> None:
    srv, _, _ = worker
    stub = srv.stub()
    run_generate(stub, greedy(PROMPT, 8), timeout=60)
    load = _idle_load(stub)
    # idle with a warm cache: nothing used, the cache evictable (SGLang's figures)
    assert load.num_used_tokens == 0 and load.token_usage == 0.0
    assert load.num_evictable_tokens >= len(PROMPT)
    (state,) = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).rank_states
    assert (state.num_used_tokens, state.num_evictable_tokens, state.num_free_tokens) == (
        0, load.num_evictable_tokens, load.num_free_tokens)

    streams = [Stream(stub, greedy([i + 2] * 20, 400, stream=True)) for i in range(4)]
    deadline = time.time() + 120
    while not all(len(s.tokens) >= 3 for s in streams):  # prefilled and decoding
        assert time.time() < deadline and not any(s.error for s in streams)
        time.sleep(0.02)
    before = _load(stub)
    # the rank publishes its state at most every 50 ms: wait for one that shows the four
    # streams decoding (their decoded tokens' KV held, beyond the 4 x 20 prompt tokens)
    while before.num_running_reqs < 4 or before.num_used_tokens <= 4 * 20:
        assert time.time() < deadline, before
        time.sleep(0.02)
        before = _load(stub)
    assert before.num_used_tokens >= 4 * 20
    try:
        paused = stub.PauseGeneration(pb.PauseGenerationRequest(mode="retract"), timeout=30)
        assert paused.success and paused.num_paused_requests == 4, paused
        after = _load(stub)
        # the retracted requests hold nothing now: their decoded tokens' KV is free again,
        # their prompts stay cached (evictable)
        assert after.num_used_tokens == 0, (before, after)
        assert after.num_free_tokens > before.num_free_tokens, (before, after)
        assert after.queues.retracted >= 4
    finally:
        assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
    for s in streams:
        s.join()
        assert s.error is None and len(s.tokens) == 400
    assert _idle_load(stub).num_used_tokens == 0


def test_weights_by_name_answers_the_tied_lm_head_with_the_embedding(worker) -> None:
    srv, base, _ = worker
    stub = srv.stub()
    head = stub.GetWeightsByName(pb.GetWeightsByNameRequest(name="lm_head.weight",
                                                            truncate_size=6), timeout=30)
    assert head.success, head.message
    embed = stub.GetWeightsByName(pb.GetWeightsByNameRequest(
        name="model.embed_tokens.weight", truncate_size=6), timeout=30)
    tensors = safetensors_torch.load_file(str(base / "model.safetensors"))
    expected = tensors["model.embed_tokens.weight"].reshape(-1)[:6].tolist()
    assert list(head.shape) == list(embed.shape) == list(tensors["model.embed_tokens.weight"].shape)
    assert list(head.values) == list(embed.values) == pytest.approx(expected)
    missing = stub.GetWeightsByName(pb.GetWeightsByNameRequest(name="lm_head.bias"), timeout=30)
    assert not missing.success and "no parameter named 'lm_head.bias'" in missing.message


def _release(stub, *tags: str) -> pb.AdminResponse:
    return stub.ReleaseMemoryOccupation(pb.ReleaseMemoryOccupationRequest(tags=tags), timeout=60)


def _resume(stub, *tags: str) -> pb.AdminResponse:
    return stub.ResumeMemoryOccupation(pb.ResumeMemoryOccupationRequest(tags=tags), timeout=60)


def test_release_and_resume_misuse_is_refused_and_changes_nothing(worker) -> None:
    srv, _, _ = worker
    stub = srv.stub()
    expected, _ = run_generate(stub, greedy(PROMPT, 6), timeout=60)

    nothing = _resume(stub, "kv_cache")
    assert not nothing.success
    assert "kv_cache is not currently released" in nothing.message
    assert [(r.dp_rank, r.success) for r in nothing.rank_results] == [(0, False)]

    assert _release(stub, "kv_cache").success
    try:
        twice = _release(stub, "kv_cache")
        assert not twice.success and "kv_cache is already released" in twice.message
        other = _resume(stub, "weights")
        assert not other.success and "weights is not currently released" in other.message
    finally:
        resumed = _resume(stub, "kv_cache")
    assert resumed.success, resumed.message
    assert run_generate(stub, greedy(PROMPT, 6), timeout=60)[0] == expected


def test_pinning_the_last_lora_slot_is_refused(worker) -> None:
    srv, _, adapter = worker
    stub = srv.stub()

    def load(lora_id: str, pinned: bool) -> pb.LoadLoRAAdapterResponse:
        return stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
            lora_id=lora_id, lora_name=lora_id, lora_path=str(adapter), pinned=pinned),
            timeout=60)

    assert load("p", pinned=True).success  # one of two slots pinned: fine
    try:
        with pytest.raises(grpc.RpcError) as err:
            load("q", pinned=True)  # would pin both
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "It is not allowed to pin all slots" in err.value.details()
        assert "starvation" in err.value.details()
        assert load("u1", pinned=False).success
        assert load("u2", pinned=False).success  # unpinned ones take turns in the free slot
        listed = stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), timeout=10)
        assert sorted(a.lora_id for a in listed.loaded_adapters) == ["p", "u2"]
    finally:
        for lora_id in ("p", "u2"):
            stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_id=lora_id), timeout=60)


def test_pushed_tensors_resolve_the_tied_lm_head_as_every_path_does(worker) -> None:
    """UpdateWeightsFromTensor names resolve as GetWeightsByName's: the tied LM head is the
    embedding, so its shape is checked against it, and its copy is dropped (as SGLang's
    load_weights drops it) so the embedding is written once, under its own name."""
    srv, _, _ = worker
    stub = srv.stub()
    vocab, hidden = 320, 64
    read = pb.GetWeightsByNameRequest(name="lm_head.weight", truncate_size=4)
    before = stub.GetWeightsByName(read, timeout=30)
    shm = shared_memory.SharedMemory(create=True, size=vocab * hidden * 4)
    try:
        def push(shape: list[int]) -> pb.UpdateWeightsResponse:
            tensor = pb.SharedTensor(name="lm_head.weight", dtype="float32", shape=shape,
                                     offset=0)
            return stub.UpdateWeightsFromTensor(pb.UpdateWeightsFromTensorRequest(
                shm_name=shm.name, tensors=[tensor]), timeout=60)

        with pytest.raises(grpc.RpcError) as err:
            push([vocab, hidden - 1])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the model's is [{vocab}, {hidden}]" in err.value.details()
        resp = push([vocab, hidden])  # zeros: dropped, the embedding stays
        assert resp.success, resp.message
    finally:
        shm.close()
        shm.unlink()
    after = stub.GetWeightsByName(read, timeout=30)
    assert list(after.values) == list(before.values) and any(before.values)
