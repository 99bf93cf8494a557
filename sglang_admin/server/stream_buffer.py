"""What one Generate call has received from its rank but not yet taken: at most one
output, into which everything that arrives meanwhile is coalesced.

A call takes its next output only once gRPC has written the previous message, so for a
slow reader the outputs of many steps pile up here; coalescing them keeps one ReqOutput
per call (the next message carries every token that piled up) instead of one per step.
The tokens it holds are counted: past ``max_tokens`` the buffer reports an overflow and
the caller aborts the request (see ``Communicator``), so a reader that stalls costs the
server a bounded amount of memory whatever it does. The samples of an n > 1 request
coalesce each on its own (one pending output per sample index).
"""

from __future__ import annotations

import asyncio

from sglang_admin.messages import ReqOutput


class StreamOverflow(Exception):
    """A reader fell so far behind that its request was aborted."""


def coalesce(into: ReqOutput, out: ReqOutput) -> None:
    """Append `out` (a later step of the same request) to `into`."""
    into.new_token_ids.extend(out.new_token_ids)
    into.logprobs.extend(out.logprobs)
    into.top_logprobs.extend(out.top_logprobs)
    into.prompt_tokens = out.prompt_tokens
    into.completion_tokens = out.completion_tokens
    into.cached_tokens = out.cached_tokens
    into.finish_reason = out.finish_reason
    into.matched_token_id = out.matched_token_id
    into.matched_stop_str = out.matched_stop_str
    into.stop_trim = out.stop_trim
    into.token_ids_logprobs.extend(out.token_ids_logprobs)
    into.hidden_states.extend(out.hidden_states)
    if out.input_logprobs:
        into.input_logprobs, into.input_top_logprobs = out.input_logprobs, out.input_top_logprobs
    if out.error is not None:
        into.error, into.error_code = out.error, out.error_code


class OutputBuffer:
    """One call's not-yet-taken output (coalesced) and, once known, how the call ends."""

    __slots__ = ("max_tokens", "by_index", "end", "_waiter")

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.by_index: dict[int, ReqOutput] = {}  # pending, per sample, in arrival order
        self.end: Exception | None = None  # taken after the pending output
        self._waiter: asyncio.Future | None = None

    @property
    def pending(self) -> ReqOutput | None:
        """The next output get() returns (None: nothing pending)."""
        return next(iter(self.by_index.values()), None)

    @property
    def tokens(self) -> int:
        """Tokens received and not yet taken."""
        return sum(len(out.new_token_ids) for out in self.by_index.values())

    def push(self, out: ReqOutput) -> bool:
        """Add a rank's output; False when the tokens not yet taken exceed the limit."""
        if self.end is not None:
            return True
        held = self.by_index.get(out.index)
        if held is None:
            self.by_index[out.index] = out
        else:
            coalesce(held, out)
        self._wake()
        return self.tokens <= self.max_tokens

    def fail(self, exc: Exception, drop_pending: bool = False) -> None:
        """End the call with `exc` (after the pending output unless `drop_pending`)."""
        if self.end is not None:
            return
        self.end = exc
        if drop_pending:
            self.by_index = {}
        self._wake()

    async def get(self) -> ReqOutput | Exception:
        """The pending output (all of it, coalesced), else the end, else wait for one."""
        while True:
            if self.by_index:
                return self.by_index.pop(next(iter(self.by_index)))
            if self.end is not None:
                return self.end
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
