"""OutputBuffer: outputs that pile up are coalesced into one; the limit is reported."""

from __future__ import annotations

import asyncio

from sglang_admin.messages import ReqOutput
from sglang_admin.server.stream_buffer import OutputBuffer, StreamOverflow


def out(tokens: list[int], done: int, finish: str | None = None) -> ReqOutput:
    return ReqOutput("r", list(tokens), 3, done, 0, logprobs=[-0.5] * len(tokens),
                     finish_reason=finish)


def test_outputs_that_pile_up_are_taken_as_one() -> None:
    async def go() -> None:
        buf = OutputBuffer(max_tokens=100)
        assert buf.push(out([1], 1)) and buf.push(out([2, 3], 3)) and buf.push(out([4], 4, "length"))
        assert buf.tokens == 4
        got = await buf.get()
        assert isinstance(got, ReqOutput)
        assert got.new_token_ids == [1, 2, 3, 4] and got.logprobs == [-0.5] * 4
        assert (got.completion_tokens, got.finish_reason) == (4, "length")
        assert buf.tokens == 0

    asyncio.run(go())


def test_a_waiting_reader_is_woken_by_the_next_output() -> None:
    async def go() -> None:
        buf = OutputBuffer(max_tokens=100)
        task = asyncio.ensure_future(buf.get())
        await asyncio.sleep(0)
        assert not task.done()
        buf.push(out([7], 1))
        got = await task
        assert isinstance(got, ReqOutput) and got.new_token_ids == [7]

    asyncio.run(go())


def test_over_the_limit_push_says_so_and_fail_drops_the_backlog() -> None:
    async def go() -> None:
        buf = OutputBuffer(max_tokens=3)
        assert buf.push(out([1, 2, 3], 3))
        assert not buf.push(out([4], 4))
        buf.fail(StreamOverflow("too slow"), drop_pending=True)
        assert buf.push(out([5], 5))  # ignored once ended
        got = await buf.get()
        assert isinstance(got, StreamOverflow) and buf.pending is None

    asyncio.run(go())


def test_an_end_comes_after_the_pending_output() -> None:
    async def go() -> None:
        buf = OutputBuffer(max_tokens=10)
        buf.push(out([1], 1))
        buf.fail(RuntimeError("rank died"))
        first, second = await buf.get(), await buf.get()
        assert isinstance(first, ReqOutput) and isinstance(second, RuntimeError)

    asyncio.run(go())
