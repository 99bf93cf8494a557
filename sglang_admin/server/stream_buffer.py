"""What one Generate call has received from its rank but not yet taken, held compactly
and bounded in tokens and in bytes.

A call takes its next output only once gRPC has let the previous message go (grpc core
completes a send when flow control has taken the message's last byte, so a stalled
reader's call holds one message in the transport and no more), so for a slow reader the
outputs of many steps pile up here. They are coalesced per sample into a ``Backlog`` of
flat arrays (4 bytes a token id, a logprob, a hidden-state value; 8 bytes an alternative
of the top logprobs) instead of lists of Python floats and tuples (~120 bytes an
alternative), and taken back out at most ``MESSAGE_BYTES`` at a time, so that one message
handed to gRPC stays small whatever piled up.

A buffer counts its bytes: the backlog plus the output last taken (the message gRPC holds
until the call takes the next one). Past ``max_tokens`` tokens or ``max_bytes`` bytes the
buffer reports an overflow and the caller aborts the request (see ``Communicator``). A
``ByteBudget`` shared by every buffer of the server sums them (``--stream-buffer-bytes-
total``): new calls are refused while it is spent.
"""

from __future__ import annotations

import asyncio
from array import array

from sglang_admin.messages import ReqOutput

# At most this many bytes (as counted here) of backlog go into one message: a slow reader
# reading one message a second still gets ~200 tokens with 20 top logprobs each per read.
MESSAGE_BYTES = 32 * 1024
ID_BYTES = 4  # a token id (uint32 on the wire), a logprob or a hidden value (float32)
ALT_BYTES = 8  # one (token id, logprob) alternative


class StreamOverflow(Exception):
    """A reader fell so far behind that its request was aborted."""


def _alternatives(rows: list[list[tuple[int, float]]]) -> int:
    return sum(len(row) for row in rows)


def output_bytes(out: ReqOutput) -> int:
    """The bytes ``out`` counts for: its tokens and what they carry, at the sizes a
    ``Backlog`` holds them in. The prompt's logprobs, which come once with the final
    output, are not counted: their size is the request's (its prompt), not its reader's."""
    size = ID_BYTES * (len(out.new_token_ids) + len(out.logprobs))
    if out.top_logprobs:
        size += ALT_BYTES * _alternatives(out.top_logprobs)
    if out.token_ids_logprobs:
        size += ALT_BYTES * _alternatives(out.token_ids_logprobs)
    if out.hidden_states:
        size += ID_BYTES * sum(len(row) for row in out.hidden_states)
    return size


class _Rows:
    """Per-token rows of (token id, logprob) pairs, flat: each row's length, ids, values."""

    __slots__ = ("counts", "ids", "values")

    def __init__(self) -> None:
        self.counts = array("I")
        self.ids = array("I")
        self.values = array("f")

    def add(self, rows: list[list[tuple[int, float]]]) -> None:
        for row in rows:
            self.counts.append(len(row))
            for token_id, value in row:
                self.ids.append(token_id)
                self.values.append(value)

    def take(self, count: int) -> list[list[tuple[int, float]]]:
        """The first ``count`` rows as lists (removed from here)."""
        used = sum(self.counts[:count])
        ids, values = self.ids[:used].tolist(), self.values[:used].tolist()
        rows, at = [], 0
        for size in self.counts[:count]:
            rows.append(list(zip(ids[at:at + size], values[at:at + size])))
            at += size
        del self.counts[:count], self.ids[:used], self.values[:used]
        return rows

    def __len__(self) -> int:
        return len(self.counts)


class _Floats:
    """Per-token rows of floats (hidden states), flat: each row's length, the values."""

    __slots__ = ("counts", "values")

    def __init__(self) -> None:
        self.counts = array("I")
        self.values = array("f")

    def add(self, rows: list[list[float]]) -> None:
        for row in rows:
            self.counts.append(len(row))
            self.values.extend(row)

    def take(self, count: int) -> list[list[float]]:
        used = sum(self.counts[:count])
        values = self.values[:used].tolist()
        rows, at = [], 0
        for size in self.counts[:count]:
            rows.append(values[at:at + size])
            at += size
        del self.counts[:count], self.values[:used]
        return rows

    def __len__(self) -> int:
        return len(self.counts)


def _has_extras(out: ReqOutput) -> bool:
    """Whether an output carries anything per token beside its token ids."""
    return bool(out.logprobs or out.top_logprobs or out.token_ids_logprobs or out.hidden_states)


class _Extras:
    """What a backlog's tokens carry beside their ids (logprobs, top logprobs, logprobs of
    chosen ids, hidden states), flat; made only once an output carries any of it."""

    __slots__ = ("logprobs", "tops", "by_ids", "hidden")

    def __init__(self) -> None:
        self.logprobs = array("f")
        self.tops = _Rows()
        self.by_ids = _Rows()
        self.hidden = _Floats()

    def add(self, out: ReqOutput) -> None:
        self.logprobs.extend(out.logprobs)
        self.tops.add(out.top_logprobs)
        self.by_ids.add(out.token_ids_logprobs)
        self.hidden.add(out.hidden_states)

    def aligned(self, tokens: int) -> bool:
        """Every field has one entry per token, or none."""
        return all(len(part) in (0, tokens)
                   for part in (self.logprobs, self.tops, self.by_ids, self.hidden))


class Backlog:
    """One sample's coalesced outputs: the tokens and what they carry in flat arrays; the
    latest output's counters and finish; the prompt logprobs (they come with the final
    output and leave with the last part) as they came. Tokens that carry nothing else (most
    streams) cost one array: the others are made when an output first carries them."""

    __slots__ = ("last", "ids", "extras", "input_logprobs", "input_top_logprobs", "nbytes",
                 "aligned")

    def __init__(self, first: ReqOutput, size: int | None = None) -> None:
        self.ids = array("I")
        self.extras: _Extras | None = None
        self.input_logprobs: list[float | None] = []
        self.input_top_logprobs: list[list[tuple[int, float]]] = []
        self.nbytes = 0
        self.aligned = True  # every per-token field has one entry per token (or none)
        self.last = first
        self.add(first, size)

    def add(self, out: ReqOutput, size: int | None = None) -> None:
        """Append ``out``, a later step of the same sample (its counters and finish win);
        ``size`` is its :func:`output_bytes` when the caller has it."""
        self.ids.extend(out.new_token_ids)
        extras = self.extras
        if extras is None and _has_extras(out):
            extras = self.extras = _Extras()
        if extras is not None:
            extras.add(out)
            self.aligned = self.aligned and extras.aligned(len(self.ids))
        if out.input_logprobs:
            self.input_logprobs = out.input_logprobs
            self.input_top_logprobs = out.input_top_logprobs
        last = self.last
        if out.error is None and last.error is not None:
            out.error, out.error_code = last.error, last.error_code
        self.last = out
        self.nbytes += output_bytes(out) if size is None else size

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def take(self, max_bytes: int) -> tuple[ReqOutput, int]:
        """The next output to send (about ``max_bytes`` of the backlog, at least one
        token; all of it when the fields are not one per token) and the bytes it counted.
        The latest output's finish and the prompt logprobs go with the last part only."""
        total = len(self.ids)
        count = total
        if self.aligned and total > 1 and self.nbytes > max_bytes:
            count = max(1, total * max_bytes // self.nbytes)
        last = self.last
        part = ReqOutput(
            rid=last.rid,
            new_token_ids=self.ids[:count].tolist(),
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens - (total - count),
            cached_tokens=last.cached_tokens,
            queue_time_s=last.queue_time_s,
            index=last.index,
        )
        del self.ids[:count]
        extras = self.extras
        if extras is not None:
            part.logprobs = extras.logprobs[:count].tolist()
            del extras.logprobs[:count]
            part.top_logprobs = extras.tops.take(count)
            part.token_ids_logprobs = extras.by_ids.take(count)
            part.hidden_states = extras.hidden.take(count)
        if count == total:
            part.input_logprobs, part.input_top_logprobs = (self.input_logprobs,
                                                            self.input_top_logprobs)
            self.input_logprobs, self.input_top_logprobs = [], []
            part.finish_reason = last.finish_reason
            part.matched_token_id = last.matched_token_id
            part.matched_stop_str = last.matched_stop_str
            part.stop_trim = last.stop_trim
            part.error, part.error_code = last.error, last.error_code
            part.embedding = last.embedding
            part.spec_verify_ct = last.spec_verify_ct  # the accept figures (final output)
            part.spec_draft_tokens = last.spec_draft_tokens
            part.spec_accepted_tokens = last.spec_accepted_tokens
        taken = output_bytes(part)
        self.nbytes = max(0, self.nbytes - taken)
        return part, taken


class ByteBudget:
    """The bytes every call's buffer holds together, against the server-wide limit."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    @property
    def spent(self) -> bool:
        """True when the buffers hold the limit or more (new calls are refused)."""
        return self.used >= self.limit


class OutputBuffer:
    """One call's not-yet-taken outputs (per sample, coalesced compactly), the output last
    taken (in gRPC's hands until the next take) and, once known, how the call ends."""

    __slots__ = ("max_tokens", "max_bytes", "by_index", "end", "in_flight", "budget",
                 "_held", "_tokens", "_waiter")

    def __init__(self, max_tokens: int, max_bytes: int | None = None,
                 budget: ByteBudget | None = None) -> None:
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.budget = budget
        # pending, per sample, in arrival order: a lone output as it came, two or more
        # coalesced into a Backlog
        self.by_index: dict[int, ReqOutput | Backlog] = {}
        self.end: Exception | None = None  # taken after the pending output
        self.in_flight = 0  # bytes of the output last taken
        self._held = 0  # bytes of by_index
        self._tokens = 0  # tokens of by_index
        self._waiter: asyncio.Future | None = None

    @property
    def pending(self) -> ReqOutput | Backlog | None:
        """What get() takes from next (None: nothing pending)."""
        return next(iter(self.by_index.values()), None)

    @property
    def tokens(self) -> int:
        """Tokens received and not yet taken."""
        return self._tokens

    @property
    def nbytes(self) -> int:
        """Bytes this call holds: its backlog and the output last taken."""
        return self._held + self.in_flight

    def push(self, out: ReqOutput) -> bool:
        """Add a rank's output; False when what is not yet sent exceeds a limit (tokens
        or bytes)."""
        if self.end is not None:
            return True
        held = self.by_index.get(out.index)
        size = output_bytes(out)
        if held is None:
            self.by_index[out.index] = out
        elif type(held) is Backlog:
            held.add(out, size)
        else:
            backlog = self.by_index[out.index] = Backlog(held)
            backlog.add(out, size)
        self._tokens += len(out.new_token_ids)
        self._grow(size)
        self._wake()
        if self.max_bytes is not None and self.nbytes > self.max_bytes:
            return False
        return self._tokens <= self.max_tokens

    def fail(self, exc: Exception, drop_pending: bool = False) -> None:
        """End the call with `exc` (after the pending output unless `drop_pending`)."""
        if self.end is not None:
            return
        self.end = exc
        if drop_pending:
            self.by_index = {}
            self._tokens = 0
            self._grow(-self._held)
        self._wake()

    def release(self) -> None:
        """The call is over: what it held no longer counts."""
        self.by_index = {}
        self._tokens = 0
        self._grow(-self._held)
        self._set_in_flight(0)

    async def get(self) -> ReqOutput | Exception:
        """The next pending output (coalesced, at most ``MESSAGE_BYTES`` of a backlog),
        else the end, else wait for one. Taking it means gRPC let the previous one go."""
        self._set_in_flight(0)
        while True:
            if self.by_index:
                index = next(iter(self.by_index))
                held = self.by_index[index]
                if isinstance(held, Backlog):
                    out, size = held.take(MESSAGE_BYTES)
                    if not held.ids:  # all taken
                        del self.by_index[index]
                        size += held.nbytes  # 0: every counted byte was taken
                else:
                    del self.by_index[index]
                    out, size = held, output_bytes(held)
                self._tokens -= len(out.new_token_ids)
                self._grow(-size)
                self._set_in_flight(size)
                return out
            if self.end is not None:
                return self.end
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _grow(self, delta: int) -> None:
        self._held += delta
        if self.budget is not None:
            self.budget.used += delta

    def _set_in_flight(self, size: int) -> None:
        if self.budget is not None:
            self.budget.used += size - self.in_flight
        self.in_flight = size

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
