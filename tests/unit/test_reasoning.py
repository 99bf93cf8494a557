"""--reasoning-parser: the think span's end token, reasoning tokens counted as SGLang's
scheduler counts them, a constraint held back until the span ends, and the start-up
checks of --reasoning-parser and --preferred-sampling-params."""

from __future__ import annotations

import pytest

from sglang_admin.messages import GenerateReq, ReqOutput, SamplingParams
from sglang_admin.scheduler.reasoning import (
    ThinkingGate,
    check_preferred_sampling_params,
    check_reasoning_parser,
    count_reasoning,
    think_end_id,
)
from sglang_admin.server.generate_codec import SampleStreams

END = 9


def out(tokens: list[int], done: int, finish: str | None = None, **kw) -> ReqOutput:
    return ReqOutput("r", tokens, 3, done, 0, finish_reason=finish, **kw)


def test_count_stops_at_the_end_token_and_includes_it() -> None:
    assert count_reasoning([1, 2, END, 4], END) == (3, True)
    assert count_reasoning([1, 2], END) == (2, False)


@pytest.mark.parametrize("stream", [True, False])
def test_the_answer_counts_the_think_span_across_outputs(stream: bool) -> None:
    answer = SampleStreams("r", GenerateReq("r", [1, 2, 3], SamplingParams(), stream=stream),
                           1, think_end_id=END)
    sent = []
    for o in [out([5, 6], 2), out([7, END, 8], 5), out([END, 4], 7, "length")]:
        sent += answer.feed(o)
    chunks = [m.chunk.reasoning_tokens for m in sent if m.HasField("chunk")]
    assert chunks == ([2, 4, 4] if stream else [])
    (complete,) = [m.complete for m in sent if m.HasField("complete")]
    assert complete.reasoning_tokens == 4


def test_without_require_reasoning_nothing_is_counted() -> None:
    answer = SampleStreams("r", GenerateReq("r", [1], SamplingParams()), 1)
    (msg,) = answer.feed(out([1, END, 2], 3, "stop"))
    assert msg.complete.reasoning_tokens == 0


def test_prompt_logprobs_ride_the_first_chunk_and_the_complete() -> None:
    req = GenerateReq("r", [1, 2, 3], SamplingParams(), stream=True, return_logprob=True,
                      logprob_start_len=1)
    answer = SampleStreams("r", req, 1)
    first = answer.feed(out([5], 1, logprobs=[-0.5], input_logprobs=[-1.0, -2.0]))
    later = answer.feed(out([6], 2, "length", logprobs=[-0.25]))
    assert [v.value for v in first[0].chunk.input_logprobs.token_logprobs] == [-1.0, -2.0]
    assert list(first[0].chunk.input_logprobs.token_ids) == [2, 3]
    assert not later[0].chunk.HasField("input_logprobs")
    assert list(later[-1].complete.input_logprobs.token_ids) == [2, 3]


class Grammar:
    """A grammar that allows only token 1, then is complete."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def fill_next_token_bitmask(self, bitmask: list, row: int) -> None:
        bitmask[row] = "masked"

    def accept(self, token: int) -> bool:
        self.seen.append(token)
        return token == 1

    @property
    def finished(self) -> bool:
        return self.seen == [1]

    def fork(self) -> Grammar:
        twin = Grammar()
        twin.seen = list(self.seen)
        return twin


def test_the_gate_lets_the_think_span_through_then_the_grammar_decides() -> None:
    gate = ThinkingGate(Grammar(), END)
    mask = ["all"]
    gate.fill_next_token_bitmask(mask, 0)
    assert mask == ["all"] and not gate.finished
    assert gate.accept(7) and gate.accept(END)  # anything while thinking, the end too
    assert gate.inner.seen == []
    twin = gate.fork()
    gate.fill_next_token_bitmask(mask, 0)
    assert mask == ["masked"]
    assert not gate.accept(2)  # the grammar's rule now
    assert twin.accept(1) and twin.finished


def test_start_up_checks() -> None:
    assert check_reasoning_parser(None) is None and check_reasoning_parser("qwen3") is None
    assert "--reasoning-parser 'nope'" in check_reasoning_parser("nope")
    assert check_preferred_sampling_params('{"temperature": 0.5, "top_k": 20}') is None
    assert "not JSON" in check_preferred_sampling_params("{")
    assert "JSON object" in check_preferred_sampling_params("[1]")
    assert "unknown key(s) bogus" in check_preferred_sampling_params('{"bogus": 1}')


def test_the_end_token_comes_from_the_tokenizer() -> None:
    from sglang_admin.model.default_model import ensure_default_model

    directory = ensure_default_model()
    assert think_end_id(None, directory) == -1
    assert think_end_id("qwen3", None) == -1
    # the byte-level default tokenizer spells "</think>" in bytes: its first, "<" (as SGLang)
    assert think_end_id("qwen3", directory) == ord("<")
