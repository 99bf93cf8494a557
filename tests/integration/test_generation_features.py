"""Issue 10 over gRPC (generated stubs) on one worker: n > 1, stop strings, prefill only
(max_new_tokens = 0), stream_interval, prompt and token-id logprobs, hidden states, and
the refusals of bad values."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from tokenizers import Tokenizer

from sglang_admin.model.default_model import ensure_default_model
from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, greedy, run_generate

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world"


def request(ids: list[int], **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids),
                              sampling_params=pb.SamplingParams(**sampling))


def answers(stub, req: pb.GenerateRequest) -> tuple[list[pb.GenerateStreamChunk],
                                                   list[pb.GenerateComplete]]:
    chunks: list[pb.GenerateStreamChunk] = []
    completes: list[pb.GenerateComplete] = []
    for resp in stub.Generate(req, timeout=120):
        if resp.HasField("chunk"):
            chunks.append(resp.chunk)
        else:
            completes.append(resp.complete)
    return chunks, completes


def test_n4_gives_four_completes_identical_when_greedy(server: ServerProc) -> None:
    stub = server.stub()
    _, sampled = answers(stub, request(PROMPT, n=4, temperature=1.0, max_new_tokens=12,
                                       ignore_eos=True))
    assert sorted(c.index for c in sampled) == [0, 1, 2, 3]
    assert all(len(c.output_ids) == 12 and c.completion_tokens == 12 for c in sampled)
    assert len({tuple(c.output_ids) for c in sampled}) > 1  # four independent samples
    _, greedy4 = answers(stub, request(PROMPT, n=4, temperature=0.0, max_new_tokens=12,
                                       ignore_eos=True))
    assert sorted(c.index for c in greedy4) == [0, 1, 2, 3]
    assert len({tuple(c.output_ids) for c in greedy4}) == 1
    solo, _ = run_generate(stub, greedy(PROMPT, 12), timeout=60)
    assert list(greedy4[0].output_ids) == solo
    # the forks reused the prompt's KV prefilled by sample 0
    assert sorted(c.cached_tokens for c in greedy4)[1:] == [len(PROMPT) - 1] * 3


def test_n2_streaming_chunks_and_completes_carry_their_index(server: ServerProc) -> None:
    chunks, completes = answers(server.stub(), pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
        sampling_params=pb.SamplingParams(n=2, max_new_tokens=6, ignore_eos=True)))
    assert sorted(c.index for c in completes) == [0, 1]
    per_index: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks:
        per_index[c.index].extend(c.token_ids)
    assert per_index[0] == per_index[1] and len(per_index[0]) == 6


def test_abort_ends_all_n_and_kv_returns_to_idle(server: ServerProc) -> None:
    stub = server.stub()
    got: list[pb.GenerateResponse] = []
    req = pb.GenerateRequest(
        request_id="n3-abort", tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
        sampling_params=pb.SamplingParams(n=3, max_new_tokens=4000, ignore_eos=True))
    thread = threading.Thread(target=lambda: got.extend(stub.Generate(req, timeout=120)))
    thread.start()
    deadline = time.time() + 60
    while time.time() < deadline and sum(r.HasField("chunk") for r in got) < 6:
        time.sleep(0.05)
    assert stub.Abort(pb.AbortRequest(request_id="n3-abort"), timeout=10).success
    thread.join(60)
    completes = [r.complete for r in got if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    assert all(c.finish_reason == "abort" for c in completes)
    flushed = stub.FlushCache(pb.FlushCacheRequest(timeout_s=30), timeout=60)
    assert flushed.success, flushed.message
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert all(s.num_used_tokens == 0 and s.num_running_reqs == 0 for s in info.rank_states)


def test_client_cancel_ends_all_n(server: ServerProc) -> None:
    stub = server.stub()
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
        sampling_params=pb.SamplingParams(n=3, max_new_tokens=4000, ignore_eos=True))
    call = stub.Generate(req, timeout=120)
    indices: set[int] = set()
    for resp in call:
        indices.add(resp.chunk.index)
        if len(indices) == 3:
            break
    call.cancel()
    deadline = time.time() + 60
    running = -1
    while time.time() < deadline:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        running = sum(s.num_running_reqs + s.num_waiting_reqs for s in info.rank_states)
        if running == 0:
            break
        time.sleep(0.1)
    assert running == 0  # all three samples ended on the rank


def test_stop_string_ends_the_output_at_the_first_match(server: ServerProc) -> None:
    stub = server.stub()
    tok = Tokenizer.from_file(f"{ensure_default_model()}/tokenizer.json")
    # the output is made of 'a' and 'b' only (both pushed by +100 logit bias)
    base = request(PROMPT, max_new_tokens=40, ignore_eos=True)
    base.sampling_params.logit_bias["97"] = 100.0
    base.sampling_params.logit_bias["98"] = 100.0
    free, _ = run_generate(stub, base, timeout=60)
    text = tok.decode(free)
    stop = next(s for s in ("ab", "ba", "aa", "bb") if s in text)
    cut = next(k for k in range(1, len(free) + 1) if stop in tok.decode(free[:k]))
    kept = pb.GenerateRequest()
    kept.CopyFrom(base)
    kept.sampling_params.stop.append(stop)
    kept.sampling_params.no_stop_trim = True
    ids, complete = run_generate(stub, kept, timeout=60)
    assert complete.finish_reason == "stop" and complete.matched_stop_str == stop
    assert ids == free[:cut] and complete.completion_tokens == cut
    trimmed = pb.GenerateRequest()
    trimmed.CopyFrom(kept)
    trimmed.sampling_params.no_stop_trim = False
    ids, complete = run_generate(stub, trimmed, timeout=60)
    assert complete.matched_stop_str == stop and complete.completion_tokens == cut
    assert stop not in tok.decode(ids) and ids == free[: len(ids)]
    assert stop in tok.decode(free[: len(ids) + 2])  # only the match's tokens were dropped


def test_max_new_tokens_zero_is_prefill_only(server: ServerProc) -> None:
    ids, complete = run_generate(server.stub(), request(PROMPT, max_new_tokens=0), timeout=60)
    assert ids == [] and complete.finish_reason == "length"
    assert complete.completion_tokens == 0 and complete.prompt_tokens == len(PROMPT)


def test_stream_interval_sends_a_chunk_every_n_tokens(server: ServerProc) -> None:
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
                             sampling_params=pb.SamplingParams(
                                 max_new_tokens=10, ignore_eos=True, stream_interval=3))
    chunks, (complete,) = answers(server.stub(), req)
    assert [len(c.token_ids) for c in chunks] == [3, 3, 3, 1]
    assert list(complete.output_ids) == list(chunks[-1].token_ids)


def test_prompt_logprobs_agree_with_token_id_logprobs_of_shorter_prompts(
        server: ServerProc) -> None:
    stub = server.stub()
    req = greedy(PROMPT, 2, return_logprob=True, logprob_start_len=3, top_logprobs_num=2)
    _, complete = run_generate(stub, req, timeout=60)
    lp = complete.input_logprobs
    assert list(lp.token_ids) == PROMPT[3:]
    assert len(lp.token_logprobs) == len(PROMPT) - 3 and len(lp.top_logprobs) == len(PROMPT) - 3
    assert all(len(row.values) == 2 for row in lp.top_logprobs)
    for pos in (3, 7, len(PROMPT) - 1):
        short = greedy(PROMPT[:pos], 1, return_logprob=True)
        short.token_ids_logprob.extend([PROMPT[pos], 5])
        _, c = run_generate(stub, short, timeout=60)
        (row,) = c.output_logprobs.token_ids_logprobs
        assert list(row.token_ids) == [PROMPT[pos], 5]
        assert abs(row.values[0] - lp.token_logprobs[pos - 3].value) < 1e-3


def test_hidden_states_one_per_output_token(server: ServerProc) -> None:
    stub = server.stub()
    _, complete = run_generate(stub, greedy(PROMPT, 4, return_hidden_states=True), timeout=60)
    states = complete.all_hidden_states
    assert len(states) == 4
    assert [s.position for s in states] == [len(PROMPT) + i for i in range(4)]
    assert all(len(s.values) == len(states[0].values) > 0 for s in states)
    assert len({tuple(s.values) for s in states}) == 4


@pytest.mark.parametrize("mutate, needle", [
    (lambda r: setattr(r.sampling_params, "n", 100000), "sampling_params.n"),
    (lambda r: setattr(r.sampling_params, "stream_interval", -1),
     "sampling_params.stream_interval"),
    (lambda r: (setattr(r, "return_logprob", True), r.token_ids_logprob.append(10**6)),
     "token_ids_logprob"),
    (lambda r: r.sampling_params.stop.append(""), "sampling_params.stop[0] is empty"),
])
def test_bad_values_are_invalid_argument_and_the_server_keeps_serving(
        server: ServerProc, mutate, needle: str) -> None:
    stub = server.stub()
    req = greedy(PROMPT, 2)
    mutate(req)
    with pytest.raises(grpc.RpcError) as err:
        run_generate(stub, req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    assert len(run_generate(stub, greedy(PROMPT, 2), timeout=60)[0]) == 2
