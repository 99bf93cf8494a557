"""Bad input over the wire: each refusal has the right status and names the field, and
the server keeps serving after every one of them (a Generate follows each case)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ServerProc, greedy, run_generate

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NAN = float("nan")
INF = float("inf")
VOCAB = 261
CONTEXT = 8192


@pytest.fixture(scope="module")
def srv(dp2_server: ServerProc) -> ServerProc:
    """The session's --dp-size 2 worker: bad input fails its request alone."""
    return dp2_server


@pytest.fixture(scope="module")
def stub(srv: ServerProc) -> Iterator[pb_grpc.SglangSchedulerStub]:
    with srv.channel() as ch:
        yield pb_grpc.SglangSchedulerStub(ch)


def test_limits_are_the_default_models(stub: pb_grpc.SglangSchedulerStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.vocab_size, info.max_context_length) == (VOCAB, CONTEXT)


def gen(ids: list[int] | None = None, **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(sampling_params=pb.SamplingParams(**sampling))
    if ids is not None:
        r.tokenized.input_ids.extend(ids)
    return r


def gen_bias(key: str, value: float) -> pb.GenerateRequest:
    r = gen([1, 2, 3], max_new_tokens=2)
    r.sampling_params.logit_bias[key] = value
    return r


def gen_with(**fields) -> pb.GenerateRequest:
    r = gen([1, 2, 3], max_new_tokens=2)
    for k, v in fields.items():
        setattr(r, k, v)
    return r


def call_generate(request: pb.GenerateRequest) -> Callable[[pb_grpc.SglangSchedulerStub], object]:
    return lambda stub: list(stub.Generate(request, timeout=30))


def call(rpc: str, request: object) -> Callable[[pb_grpc.SglangSchedulerStub], object]:
    return lambda stub: getattr(stub, rpc)(request, timeout=30)


# (id, call, status, substring of the message)
CASES = [
    ("missing-input-ids", call_generate(pb.GenerateRequest()), INVALID, "tokenized.input_ids"),
    ("empty-input-ids", call_generate(gen([])), INVALID, "tokenized.input_ids must not be empty"),
    ("token-id-eq-vocab", call_generate(gen([5, VOCAB])), INVALID,
     f"tokenized.input_ids[1] = {VOCAB} is outside the vocabulary"),
    ("token-id-huge", call_generate(gen([2**32 - 1])), INVALID, "tokenized.input_ids[0]"),
    ("prompt-over-context", call_generate(gen([7] * CONTEXT)), INVALID,
     f"exceeds the context length {CONTEXT}"),
    ("temperature-negative", call_generate(gen([1], temperature=-1.0)), INVALID,
     "sampling_params.temperature must be >= 0"),
    ("temperature-nan", call_generate(gen([1], temperature=NAN)), INVALID,
     "sampling_params.temperature must be a finite number"),
    ("temperature-inf", call_generate(gen([1], temperature=INF)), INVALID,
     "sampling_params.temperature must be a finite number"),
    ("top-p-negative", call_generate(gen([1], top_p=-0.5)), INVALID,
     "sampling_params.top_p must be in (0, 1]"),
    ("top-p-over-one", call_generate(gen([1], top_p=1.01)), INVALID, "sampling_params.top_p"),
    ("top-p-nan", call_generate(gen([1], top_p=NAN)), INVALID, "sampling_params.top_p"),
    ("top-k-below-minus-one", call_generate(gen([1], top_k=-5)), INVALID,
     "sampling_params.top_k"),
    ("min-p-negative", call_generate(gen([1], min_p=-0.01)), INVALID,
     "sampling_params.min_p must be in [0, 1]"),
    ("min-p-over-one", call_generate(gen([1], min_p=2.0)), INVALID, "sampling_params.min_p"),
    ("frequency-penalty-range", call_generate(gen([1], frequency_penalty=2.5)), INVALID,
     "sampling_params.frequency_penalty must be in [-2, 2]"),
    ("presence-penalty-range", call_generate(gen([1], presence_penalty=-2.5)), INVALID,
     "sampling_params.presence_penalty"),
    ("presence-penalty-inf", call_generate(gen([1], presence_penalty=-INF)), INVALID,
     "sampling_params.presence_penalty must be a finite number"),
    ("repetition-penalty-range", call_generate(gen([1], repetition_penalty=3.0)), INVALID,
     "sampling_params.repetition_penalty"),
    ("repetition-penalty-nan", call_generate(gen([1], repetition_penalty=NAN)), INVALID,
     "sampling_params.repetition_penalty"),
    ("logit-bias-not-a-token-id", call_generate(gen_bias("hello", 1.0)), INVALID,
     "sampling_params.logit_bias key 'hello' is not a token id"),
    ("logit-bias-negative-key", call_generate(gen_bias("-3", 1.0)), INVALID,
     "sampling_params.logit_bias key '-3'"),
    ("logit-bias-out-of-vocab", call_generate(gen_bias("999", 1.0)), INVALID,
     "sampling_params.logit_bias key 999 is outside the vocabulary"),
    ("logit-bias-nan", call_generate(gen_bias("5", NAN)), INVALID,
     "sampling_params.logit_bias[5] must be a finite number"),
    ("logit-bias-inf", call_generate(gen_bias("5", INF)), INVALID,
     "sampling_params.logit_bias[5] must be a finite number"),
    ("stop-token-out-of-vocab", call_generate(gen([1], stop_token_ids=[VOCAB])), INVALID,
     "sampling_params.stop_token_ids"),
    ("data-parallel-rank-high", call_generate(gen_with(data_parallel_rank=2)), INVALID,
     "data_parallel_rank = 2 is out of range [0, 1]"),
    ("data-parallel-rank-negative", call_generate(gen_with(data_parallel_rank=-1)), INVALID,
     "data_parallel_rank = -1"),
    ("oversized-message",
     call_generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(original_text="x" * (3 << 20)))),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ("get-loads-unknown-section", call("GetLoads", pb.GetLoadsRequest(include=["core", "gpu"])),
     INVALID, "unknown include section(s) gpu"),
    ("get-loads-dp-rank", call("GetLoads", pb.GetLoadsRequest(dp_rank=2)), INVALID,
     "dp_rank = 2 is out of range"),
    ("flush-timeout-nan", call("FlushCache", pb.FlushCacheRequest(timeout_s=NAN)), INVALID,
     "timeout_s must be a finite number"),
    ("flush-timeout-huge", call("FlushCache", pb.FlushCacheRequest(timeout_s=3e38)), INVALID,
     "timeout_s must be at most 3600 seconds"),
    ("abort-empty-request-id", call("Abort", pb.AbortRequest()), INVALID,
     "request_id must not be empty"),
]


@pytest.mark.parametrize("make_call, code, needle", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_the_server_still_serves(
    stub: pb_grpc.SglangSchedulerStub, make_call, code: grpc.StatusCode, needle: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        make_call(stub)
    assert err.value.code() == code, err.value.details()
    assert needle in err.value.details(), err.value.details()
    tokens, complete = run_generate(stub, greedy([3, 1, 4, 1, 5], 2), timeout=30)
    assert len(tokens) == 2 and complete.finish_reason == "length"


def test_full_context_prompt_fits_the_receive_limit(stub: pb_grpc.SglangSchedulerStub) -> None:
    # The largest prompt the context allows, one token of room left: accepted.
    tokens, complete = run_generate(stub, greedy([VOCAB - 1] * (CONTEXT - 1), 1), timeout=120)
    assert len(tokens) == 1 and complete.prompt_tokens == CONTEXT - 1


def test_max_new_tokens_above_the_room_is_capped(stub: pb_grpc.SglangSchedulerStub) -> None:
    """As SGLang's scheduler: a max_new_tokens past the context is capped to the room the
    prompt leaves (the answer ends there with "length"), not refused."""
    tokens, complete = run_generate(stub, greedy([VOCAB - 1] * (CONTEXT - 3), CONTEXT),
                                    timeout=120)
    assert len(tokens) == 3 and complete.finish_reason == "length"


def test_duplicate_in_flight_request_id(stub: pb_grpc.SglangSchedulerStub) -> None:
    rid = "dup-request-1"
    first = stub.Generate(greedy([9, 9, 9], 4000, request_id=rid, stream=True), timeout=120)
    next(iter(first))  # in flight now
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(greedy([1, 2], 2, request_id=rid), timeout=30))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert f"request_id {rid!r} is already in flight" in err.value.details()
        # The first request is untouched by the refusal: it still streams.
        got = next(iter(first))
        assert got.HasField("chunk") and got.chunk.token_ids
    finally:
        first.cancel()
    # Once the first one is gone, the id is free again.
    deadline = time.time() + 10
    while stub.Abort(pb.AbortRequest(request_id=rid), timeout=5).success:
        assert time.time() < deadline
        time.sleep(0.05)
    tokens, _ = run_generate(stub, greedy([1, 2], 2, request_id=rid), timeout=30)
    assert len(tokens) == 2


def test_concurrent_duplicates_only_one_runs(stub: pb_grpc.SglangSchedulerStub) -> None:
    rid = "dup-request-race"
    results: list[object] = []

    def one() -> None:
        try:
            results.append(run_generate(stub, greedy([4, 4], 50, request_id=rid), timeout=60)[0])
        except grpc.RpcError as exc:
            results.append(exc.code())

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ok = [r for r in results if isinstance(r, list)]
    assert ok and all(len(r) == 50 for r in ok)
    assert all(r == grpc.StatusCode.ALREADY_EXISTS for r in results if not isinstance(r, list))


SERVICE = "/sglang.grpc.scheduler.SglangScheduler/"
# Bodies that are not protobuf: a field-1 string whose length runs past the end, a varint
# that never ends, a tag with wire type 7 (no such type).
MALFORMED_BODIES = [b"\x0a\xff\x01abc", b"\x08" + b"\xff" * 11, b"\x0f\x00"]
RAW_RPCS = [  # (method, server-streaming)
    ("Generate", True),
    ("DownloadProfile", True),
    ("GetTokenizer", True),
    ("GetLoads", False),
    ("FlushCache", False),
    ("GetServerInfo", False),
    ("Abort", False),
    ("StartProfile", False),
]


@pytest.mark.parametrize(("method", "streaming"), RAW_RPCS, ids=[m for m, _ in RAW_RPCS])
def test_malformed_body_is_invalid_argument(
    srv: ServerProc, stub: pb_grpc.SglangSchedulerStub, method: str, streaming: bool
) -> None:
    """Raw bytes that do not decode: INVALID_ARGUMENT naming the method, never UNKNOWN."""
    with srv.channel() as ch:
        for body in MALFORMED_BODIES:
            if streaming:
                rpc = ch.unary_stream(SERVICE + method)
                make = lambda rpc=rpc, body=body: list(rpc(body, timeout=30))  # noqa: E731
            else:
                rpc = ch.unary_unary(SERVICE + method)
                make = lambda rpc=rpc, body=body: rpc(body, timeout=30)  # noqa: E731
            with pytest.raises(grpc.RpcError) as err:
                make()
            assert err.value.code() == INVALID, (body, err.value.details())
            assert f"malformed {method} request: {len(body)} bytes" in err.value.details()
    tokens, complete = run_generate(stub, greedy([3, 1, 4, 1, 5], 2), timeout=30)
    assert len(tokens) == 2 and complete.finish_reason == "length"


def test_malformed_health_check_is_invalid_argument(srv: ServerProc) -> None:
    with srv.channel() as ch:
        rpc = ch.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.RpcError) as err:
            rpc(MALFORMED_BODIES[0], timeout=10)
        assert err.value.code() == INVALID
        assert "malformed Check request" in err.value.details()
