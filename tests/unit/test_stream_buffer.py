"""OutputBuffer: outputs that pile up are coalesced into one; the limit is reported."""

from __future__ import annotations

import asyncio
import itertools

from sglang_admin.messages import ReqOutput
from sglang_admin.server.stream_buffer import (
    MESSAGE_BYTES,
    ByteBudget,
    OutputBuffer,
    StreamOverflow,
)


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


def heavy(first: int, count: int, done: int, top: int = 20,
          finish: str | None = None) -> ReqOutput:
    """`count` tokens from `first`, each with its logprob and `top` alternatives."""
    ids = list(range(first, first + count))
    return ReqOutput("r", ids, 3, done, 0, logprobs=[-0.25] * count,
                     top_logprobs=[[(t + k, -0.5 * k) for k in range(top)] for t in ids],
                     finish_reason=finish)


def test_a_logprob_heavy_backlog_is_held_compactly_and_comes_back_equal() -> None:
    """Coalesced outputs keep every id and value (float32 on the wire: these are exact)."""
    async def go() -> None:
        buf = OutputBuffer(max_tokens=10_000, max_bytes=1 << 20)
        for i in range(10):
            assert buf.push(heavy(i, 1, i + 1, finish="length" if i == 9 else None))
        # 10 tokens x (id + logprob + 20 alternatives of 8 bytes)
        assert buf.nbytes == 10 * (4 + 4 + 20 * 8)
        got = await buf.get()
        assert isinstance(got, ReqOutput)
        want = heavy(0, 10, 10, finish="length")
        assert got.new_token_ids == want.new_token_ids and got.logprobs == want.logprobs
        assert got.top_logprobs == want.top_logprobs
        assert (got.completion_tokens, got.finish_reason) == (10, "length")
        assert buf.nbytes == 10 * 168  # in gRPC's hands until the next take
        buf.release()
        assert buf.nbytes == 0

    asyncio.run(go())


def test_a_large_backlog_leaves_in_messages_of_bounded_size() -> None:
    """What piled up for a slow reader is sent MESSAGE_BYTES at a time, in order; the
    finish goes with the last part and the counters add up."""
    async def go() -> None:
        buf = OutputBuffer(max_tokens=10_000, max_bytes=1 << 20)
        total = 1000
        for i in range(total):
            buf.push(heavy(i, 1, i + 1, finish="length" if i == total - 1 else None))
        parts = []
        while True:
            got = await buf.get()
            assert isinstance(got, ReqOutput)
            assert buf.in_flight <= MESSAGE_BYTES
            parts.append(got)
            if got.finish_reason:
                break
        assert len(parts) >= total * 168 // MESSAGE_BYTES
        ids = [t for p in parts for t in p.new_token_ids]
        assert ids == list(range(total))
        assert [p.completion_tokens for p in parts] == list(
            itertools.accumulate(len(p.new_token_ids) for p in parts))
        assert all(p.finish_reason is None for p in parts[:-1])
        assert [r for p in parts for r in p.top_logprobs] == heavy(0, total, total).top_logprobs
        assert buf.pending is None

    asyncio.run(go())


def test_the_byte_limit_counts_what_tokens_carry() -> None:
    """A few tokens with 20 alternatives each pass the byte limit long before the token
    limit; what was taken last (still in gRPC's hands) counts too."""
    async def go() -> None:
        buf = OutputBuffer(max_tokens=4096, max_bytes=100 * 168)
        buf.push(heavy(0, 50, 50))
        await buf.get()  # 50 tokens now in flight
        assert buf.push(heavy(50, 50, 100))
        assert not buf.push(heavy(100, 1, 101))
        plain = OutputBuffer(max_tokens=4096, max_bytes=100 * 168)
        assert all(plain.push(out([i], i + 1)) for i in range(1000))  # 8 bytes a token

    asyncio.run(go())


def test_the_server_wide_budget_sums_every_buffer() -> None:
    async def go() -> None:
        budget = ByteBudget(limit=3 * 168)
        a, b = (OutputBuffer(4096, 1 << 20, budget) for _ in range(2))
        a.push(heavy(0, 1, 1))
        b.push(heavy(0, 1, 1))
        assert budget.used == 2 * 168 and not budget.spent
        a.push(heavy(1, 1, 2))
        assert budget.spent
        await a.get()  # taken: still held until a's next take
        assert budget.spent
        a.fail(StreamOverflow("too slow"), drop_pending=True)
        a.release()
        assert budget.used == 168 and not budget.spent
        b.release()
        assert budget.used == 0

    asyncio.run(go())


def test_the_prompt_logprobs_leave_with_the_last_part_uncounted() -> None:
    """The prompt's logprobs come with the final output; split, they go with the part that
    carries the finish. Their size is the prompt's, not the reader's: not counted."""
    async def go() -> None:
        buf = OutputBuffer(max_tokens=10_000, max_bytes=300 * 168)
        for i in range(299):
            assert buf.push(heavy(i, 1, i + 1))
        final = heavy(299, 1, 300, finish="length")
        final.input_logprobs = [None] + [-1.0] * 4999
        final.input_top_logprobs = [[(1, -1.0)] * 20] * 5000
        assert buf.push(final)  # 5000 prompt positions with 20 alternatives: not counted
        parts = []
        while not parts or parts[-1].finish_reason is None:
            got = await buf.get()
            assert isinstance(got, ReqOutput)
            parts.append(got)
        assert len(parts) > 1
        assert all(not p.input_logprobs for p in parts[:-1])
        assert parts[-1].input_logprobs == final.input_logprobs
        assert len(parts[-1].input_top_logprobs) == 5000

    asyncio.run(go())


def test_plain_tokens_then_logprobs_come_out_whole_in_one_output() -> None:
    """A backlog of plain tokens makes its logprob arrays only when an output brings some;
    fields that no longer have one entry per token make it leave whole, as they came."""

    async def go() -> None:
        buf = OutputBuffer(max_tokens=100)
        buf.push(ReqOutput("r", [1], 3, 1, 0))
        buf.push(ReqOutput("r", [2], 3, 2, 0))
        buf.push(ReqOutput("r", [3], 3, 3, 0, logprobs=[-1.0]))
        assert buf.tokens == 3
        got = await buf.get()
        assert isinstance(got, ReqOutput)
        assert got.new_token_ids == [1, 2, 3] and got.logprobs == [-1.0]
        assert got.completion_tokens == 3 and buf.tokens == 0

    asyncio.run(go())


def test_the_token_count_follows_every_way_out() -> None:
    """Taken, failed with the pending dropped, released: the count the limit checks
    against is what is still held."""

    async def go() -> None:
        buf = OutputBuffer(max_tokens=4)
        assert buf.push(ReqOutput("r", [1, 2], 3, 2, 0))
        assert buf.push(ReqOutput("r", [3, 4], 3, 4, 0, index=1))
        assert not buf.push(ReqOutput("r", [5], 3, 3, 0))  # 5 > 4 held
        await buf.get()  # sample 0: three tokens
        assert buf.tokens == 2
        buf.fail(StreamOverflow("x"), drop_pending=True)
        assert buf.tokens == 0
        other = OutputBuffer(max_tokens=4)
        other.push(ReqOutput("r", [1], 3, 1, 0))
        other.release()
        assert other.tokens == 0 and other.push(ReqOutput("r", [1, 2, 3, 4], 3, 4, 0))

    asyncio.run(go())


# what a backlog's part takes from its outputs token by token, or recomputes; every other
# field of ReqOutput is said once, by the final output, and must reach the reader
PER_TOKEN = {"rid", "new_token_ids", "prompt_tokens", "completion_tokens", "cached_tokens",
             "queue_time_s", "index", "logprobs", "top_logprobs", "token_ids_logprobs",
             "hidden_states"}


def test_the_final_outputs_fields_survive_a_backlog_whole_or_split() -> None:
    """Two or more outputs of a sample pile up when the reader is slower than the rank (a
    loaded server, a logprob stream): the backlog's last part must carry everything the
    final output says, the speculative accept figures included (they were dropped, so a
    request that verified drafts reported 0 drafted now and then)."""
    import dataclasses

    final_values = {
        "finish_reason": "stop", "matched_token_id": 7, "error": "e", "error_code": "INTERNAL",
        "matched_stop_str": "ab", "stop_trim": 2, "input_logprobs": [None, -1.0],
        "input_top_logprobs": [[], [(1, -1.0)]], "embedding": [0.5, 0.25],
        "spec_verify_ct": 5, "spec_draft_tokens": 22, "spec_accepted_tokens": 21,
    }
    names = {f.name for f in dataclasses.fields(ReqOutput)}
    assert names - PER_TOKEN == set(final_values), "a new final field: add it here and to Backlog.take"

    async def go(steps: int) -> list[ReqOutput]:
        buf = OutputBuffer(max_tokens=100_000)
        for i in range(steps - 1):
            assert buf.push(out([i], i + 1))
        assert buf.push(ReqOutput("r", [99], 3, steps, 0, logprobs=[-0.5], **final_values))
        parts: list[ReqOutput] = []
        while not parts or parts[-1].finish_reason is None:
            got = await buf.get()
            assert isinstance(got, ReqOutput)
            parts.append(got)
        return parts

    for steps in (2, 20_000):  # taken whole; split into parts of MESSAGE_BYTES
        parts = asyncio.run(go(steps))
        assert (len(parts) > 1) == (steps > 2)
        assert sum(len(p.new_token_ids) for p in parts) == steps
        for name, value in final_values.items():
            assert getattr(parts[-1], name) == value, name
            for early in parts[:-1]:
                assert getattr(early, name) in (None, 0, []), name
