"""The serving path end to end: a real server subprocess driven through the stubs."""

from __future__ import annotations

import concurrent.futures as cf
import random
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, greedy, run_generate, start_server


def kv_in_use(stub) -> int:
    """KV tokens held by requests (num_used_tokens: cached-but-evictable ones excluded),
    summed over ranks."""
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return sum(s.num_used_tokens for s in info.rank_states)


def test_health_reflection_names_and_model_info(server: ServerProc) -> None:
    stub = server.stub()
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    with server.channel() as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "sglang.grpc.scheduler.SglangScheduler"):
            resp = h.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.max_context_length >= 4096
    assert info.vocab_size > 256
    assert info.eos_token_ids
    assert info.architectures
    assert info.tokenizer_path and info.model_path
    assert info.max_req_input_len == info.max_context_length - 1
    assert info.served_model_name


def test_stream_greedy_matches_non_stream_and_chunks_are_incremental(server: ServerProc) -> None:
    stub = server.stub()
    prompt = [10, 20, 30, 40, 50, 60]
    tokens_ns, complete_ns = run_generate(stub, greedy(prompt, 12), timeout=60)
    assert len(tokens_ns) == 12 and complete_ns.finish_reason == "length"
    chunks = list(stub.Generate(greedy(prompt, 12, stream=True), timeout=60))
    streamed = [t for c in chunks if c.HasField("chunk") for t in c.chunk.token_ids]
    assert streamed == tokens_ns
    counts = [c.chunk.completion_tokens for c in chunks if c.HasField("chunk")]
    assert counts == sorted(counts) and counts[-1] == 12
    assert chunks[-1].HasField("complete")
    assert chunks[-1].complete.completion_tokens == 12
    assert chunks[-1].complete.prompt_tokens == len(prompt)


def test_greedy_equals_transformers_on_default_model(server: ServerProc) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    info = server.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        info.model_path, torch_dtype=torch.float32
    )
    prompt = [5, 17, 99, 3, 250, 64, 7]
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
            pad_token_id=0,
        )[0, len(prompt):].tolist()
    tokens, _ = run_generate(server.stub(), greedy(prompt, 16), timeout=60)
    assert tokens == ref


def test_sixteen_concurrent_requests_equal_their_solo_results(server: ServerProc) -> None:
    stub = server.stub()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randrange(3, 200))] for _ in range(16)]
    lengths = [rng.randrange(4, 40) for _ in range(16)]
    solo = [run_generate(stub, greedy(p, n), timeout=120)[0] for p, n in zip(prompts, lengths)]
    # Flush so the batched run recomputes rather than reusing the solo runs' cache.
    stub.FlushCache(pb.FlushCacheRequest(timeout_s=10), timeout=30)
    with cf.ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(run_generate, stub, greedy(p, n, stream=i % 2 == 0), timeout=120)
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        batched = [f.result()[0] for f in futures]
    assert batched == solo


def test_cancelled_stream_frees_its_kv(server: ServerProc) -> None:
    stub = server.stub()
    call = stub.Generate(greedy([i % 250 + 1 for i in range(300)], 2000, stream=True), timeout=120)
    got = 0
    for resp in call:
        got += len(resp.chunk.token_ids)
        if got >= 5:
            call.cancel()
            break
    deadline = time.time() + 10
    while time.time() < deadline and kv_in_use(stub) != 0:
        time.sleep(0.1)
    assert kv_in_use(stub) == 0
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert all(s.num_running_reqs == 0 and s.num_waiting_reqs == 0 for s in info.rank_states)


def test_abort_rpc_ends_the_stream_with_abort(server: ServerProc) -> None:
    stub = server.stub()
    rid = "abort-me-1"
    out: dict = {}

    def consume() -> None:
        out["tokens"], out["complete"] = run_generate(
            stub, greedy([1, 2, 3], 3000, request_id=rid, stream=True), timeout=120
        )

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline:
        if stub.Abort(pb.AbortRequest(request_id=rid), timeout=5).success:
            break
        time.sleep(0.05)
    t.join(60)
    assert out["complete"].finish_reason == "abort"
    assert len(out["tokens"]) < 3000
    assert not stub.Abort(pb.AbortRequest(request_id=rid), timeout=5).success


def test_concurrent_aborts_of_one_request_succeed_once(server: ServerProc) -> None:
    """Eight Abort RPCs for one live request at once: the claim happens exactly once."""
    stub = server.stub()
    rid = "abort-many-1"
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(done=run_generate(
        stub, greedy([4, 5, 6], 3000, request_id=rid, stream=True), timeout=120)))
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline and not any_in_flight(stub):
        time.sleep(0.05)
    barrier = threading.Barrier(8)

    def abort() -> bool:
        barrier.wait()
        return stub.Abort(pb.AbortRequest(request_id=rid), timeout=10).success

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: abort(), range(8)))
    t.join(60)
    assert sorted(results) == [False] * 7 + [True]
    assert out["done"][1].finish_reason == "abort"


def any_in_flight(stub) -> bool:
    """Whether the server has a Generate call in flight (this module runs one at a time)."""
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return info.active_requests > 0


def test_expired_deadline_gives_deadline_exceeded_and_frees_kv(server: ServerProc) -> None:
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as err:
        run_generate(stub, greedy(list(range(1, 100)), 4000, stream=True), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.time() + 10
    while time.time() < deadline and kv_in_use(stub) != 0:
        time.sleep(0.1)
    assert kv_in_use(stub) == 0


def test_logprobs_are_returned(server: ServerProc) -> None:
    stub = server.stub()
    req = greedy([1, 2, 3, 4], 5, return_logprob=True, top_logprobs_num=3)
    tokens, complete = run_generate(stub, req, timeout=60)
    lp = complete.output_logprobs
    assert list(lp.token_ids) == tokens
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert len(lp.top_logprobs) == 5
    for row, tok, val in zip(lp.top_logprobs, tokens, lp.token_logprobs):
        assert row.token_ids[0] == tok  # greedy picks the most likely token
        assert abs(row.values[0] - val) < 1e-5


def test_unsupported_features_are_refused_by_name(server: ServerProc) -> None:
    stub = server.stub()
    cases = {
        # constraints that do not compile: the compiler's message names the kind
        "regex": pb.SamplingParams(regex="a(", max_new_tokens=2),
        "json_schema": pb.SamplingParams(json_schema='{"type": "objec"}', max_new_tokens=2),
    }
    for needle, sp in cases.items():
        req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2]), sampling_params=sp)
        with pytest.raises(grpc.RpcError) as err:
            run_generate(stub, req, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # a generation model (docs/embed.md)
        stub.Embed(pb.EmbedRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--is-embedding" in err.value.details()
    # Still serving.
    assert len(run_generate(stub, greedy([1, 2], 3), timeout=30)[0]) == 3


def test_two_servers_side_by_side_and_sigterm_leaves_no_process(tmp_path, server: ServerProc) -> None:
    other = start_server(tmp_path, "--dp-size", "2")
    try:
        children = other.children()
        assert len(children) >= 2
        a = run_generate(server.stub(), greedy([9, 8, 7], 6), timeout=60)[0]
        b = run_generate(other.stub(), greedy([9, 8, 7], 6), timeout=60)[0]
        assert a == b  # same default model, same greedy tokens
    finally:
        code = other.stop(signal.SIGTERM)
    assert code == 0, other.log()[-3000:]
    assert_gone(children)
    # both ranks took the fast exit (scheduler/rank/lifetime.py): an idle stop in ~0.2 s, not 3-6 s
    assert other.log().count("skipping the interpreter's teardown") == 2, other.log()[-3000:]


def assert_gone(pids: list[int], timeout: float = 10) -> None:
    """Every pid has exited (a zombie waiting for init to reap it counts as exited)."""
    deadline = time.time() + timeout
    alive = pids
    while alive and time.time() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
