"""The server side of n > 1, stream_interval and stop-string trimming: the answer built
from rank outputs (server/generate_codec/streams.py) and per-sample coalescing in the stream
buffer."""

from __future__ import annotations

import asyncio

from sglang_admin.messages import GenerateReq, ReqOutput, SamplingParams
from sglang_admin.server.generate_codec import SampleStreams
from sglang_admin.server.stream_buffer import OutputBuffer


def out(index: int, tokens: list[int], done: int, finish: str | None = None,
        **kw) -> ReqOutput:
    return ReqOutput("wire", tokens, 3, done, 0, index=index, finish_reason=finish, **kw)


def gen(stream: bool, n: int = 2) -> GenerateReq:
    return GenerateReq("wire", [1, 2, 3], SamplingParams(), stream=stream, n=n)


def test_streamed_samples_chunk_every_interval_and_complete_each() -> None:
    answer = SampleStreams("rid", gen(True), stream_interval=2)
    sent = []
    for o in [out(0, [5], 1), out(1, [6], 1), out(0, [7], 2), out(1, [8], 2),
              out(0, [9], 3, "length"), out(1, [10], 3, "length")]:
        sent += answer.feed(o)
    assert answer.finished
    chunks = [(m.chunk.index, list(m.chunk.token_ids)) for m in sent if m.HasField("chunk")]
    assert chunks == [(0, [5, 7]), (1, [6, 8]), (0, [9]), (1, [10])]
    completes = [m.complete for m in sent if m.HasField("complete")]
    assert [(c.index, list(c.output_ids)) for c in completes] == [(0, [9]), (1, [10])]
    assert all(m.request_id == "rid" for m in sent)


def test_unstreamed_answer_is_one_complete_per_sample_with_the_stop_trimmed() -> None:
    answer = SampleStreams("rid", gen(False), stream_interval=1)
    assert answer.feed(out(1, [6, 7], 2)) == []
    (first,) = answer.feed(out(1, [8], 3, "stop", matched_stop_str="xy", stop_trim=2))
    assert not answer.finished
    (second,) = answer.feed(out(0, [1, 2, 3], 3, "length"))
    assert answer.finished
    assert first.complete.index == 1 and list(first.complete.output_ids) == [6]
    assert first.complete.matched_stop_str == "xy" and first.complete.completion_tokens == 3
    assert second.complete.index == 0 and list(second.complete.output_ids) == [1, 2, 3]


def test_the_buffer_coalesces_each_sample_on_its_own() -> None:
    async def go() -> None:
        buf = OutputBuffer(max_tokens=100)
        for o in [out(0, [1], 1), out(1, [2], 1), out(0, [3], 2), out(1, [4], 2, "stop")]:
            assert buf.push(o)
        assert buf.tokens == 4
        first, second = await buf.get(), await buf.get()
        assert (first.index, first.new_token_ids) == (0, [1, 3])
        assert (second.index, second.new_token_ids, second.finish_reason) == (1, [2, 4], "stop")
        assert buf.pending is None

    asyncio.run(go())


def test_piled_up_tokens_still_go_out_n_per_chunk() -> None:
    answer = SampleStreams("rid", gen(True, n=1), stream_interval=3)
    sent = answer.feed(out(0, [1, 2, 3, 4, 5, 6, 7], 7))  # a slow reader's coalesced steps
    sent += answer.feed(out(0, [8], 8, "length"))
    chunks = [list(m.chunk.token_ids) for m in sent if m.HasField("chunk")]
    assert chunks == [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert [m.chunk.completion_tokens for m in sent if m.HasField("chunk")] == [3, 6, 8]
    assert list(sent[-1].complete.output_ids) == [7, 8]
