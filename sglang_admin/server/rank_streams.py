"""Generate's half of the server's link to the ranks (mixed into Communicator).

A request goes to one rank under a wire id unique to the call; the rank's outputs come back
into a per-request OutputBuffer (server/stream_buffer.py) matched by that id, coalesced
while the call is busy writing, and the request is aborted with RESOURCE_EXHAUSTED once more
than --stream-buffer-tokens or --stream-buffer-bytes wait there (a stalled reader). Every
buffer counts against one ByteBudget (--stream-buffer-bytes-total).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from sglang_admin.messages import AbortReq, GenerateReq, ReqOutput, encode
from sglang_admin.server.stream_buffer import OutputBuffer, StreamOverflow

logger = logging.getLogger(__name__)


class RankUnavailable(Exception):
    """The rank serving a call died or the server is shutting down."""


@dataclass
class _Stream:
    """One Generate call in flight: its rank, its output buffer and the id the rank sees."""

    rank: int
    buffer: OutputBuffer
    wire_id: str
    abort_claimed: bool = False  # an Abort RPC already took this request
    heard: bool = False  # an output of this request arrived already


class RankStreams:
    """Communicator's Generate streams: the rank a request goes to, its outputs filed in its
    call's buffer, and the abort of a request whose call left (mixed into Communicator: the
    attributes are its, set in its ``__init__``)."""

    def pick_rank(self, pinned: int | None = None) -> int:
        if pinned is not None:
            return pinned
        if self.args.load_balance_method == "round_robin":
            return next(self._rr)
        live = [r for r in range(self.args.dp_size) if r not in self.dead_ranks] or [0]
        return min(live, key=lambda r: self.inflight[r])

    def is_inflight(self, rid: str) -> bool:
        return rid in self.streams

    async def generate(self, req: GenerateReq, rank: int) -> AsyncGenerator[ReqOutput, None]:
        """Send a request to `rank` and yield its outputs until it finishes.

        When the consumer stops early (cancelled call, deadline), the rank gets an Abort so
        the request's KV is freed at the next step.
        """
        if rank in self.dead_ranks:
            raise RankUnavailable(f"scheduler rank {rank} {self.dead_ranks[rank]}")
        if self.down_reason is not None:
            raise RankUnavailable(self.down_reason)
        # The rank sees a wire id unique to this call: a request id the client reuses right
        # after cancelling can never be confused with the old request still leaving the rank.
        rid = req.rid
        req.rid = f"{rid}~{next(self._wire_seq)}"
        stream = _Stream(rank, OutputBuffer(self.args.stream_buffer_tokens,
                                            self.args.stream_buffer_bytes, self.buffered),
                         req.rid)
        buffer = stream.buffer
        self.streams[rid] = stream
        self.by_wire_id[req.rid] = stream
        self.inflight[rank] += 1
        finished = False
        unfinished_samples = max(req.n, 1)  # n > 1: one finish per sample
        try:
            await self._send(rank, encode(req))
            while True:
                item = await buffer.get()
                if isinstance(item, Exception):
                    finished = True  # a rank that died, or an overflow already aborted
                    raise item
                if item.finish_reason is not None:
                    unfinished_samples -= 1
                    # an error (a refusal) ends the request whatever the samples
                    finished = unfinished_samples <= 0 or item.error is not None
                # no reference to the output stays in this frame while the call writes it
                # (the caller's message has what it needs): a stalled call holds one message
                slot = [item]
                del item
                yield slot.pop()
                if finished:
                    return
        finally:
            buffer.release()
            self.inflight[rank] -= 1
            self.streams.pop(rid, None)
            self.by_wire_id.pop(req.rid, None)
            if not finished and rank not in self.dead_ranks:
                self._send_nowait(rank, AbortReq(req.rid, "client gone"))

    def abort(self, rid: str, reason: str = "aborted by client") -> bool:
        """Abort an in-flight request by id; False when no such request is in flight or
        another abort already claimed it (concurrent aborts: exactly one succeeds)."""
        stream = self.streams.get(rid)
        if stream is None or stream.abort_claimed:
            return False
        stream.abort_claimed = True
        self._send_nowait(stream.rank, AbortReq(stream.wire_id, reason))
        return True

    def _file_outputs(self, outputs: list[ReqOutput]) -> None:
        """File a step's outputs in their calls' buffers: first the outputs of requests not
        heard of before (a new request's first token is written ahead of the step's other
        streams, not behind all of them), then the others, each request's in order."""
        later: list[tuple[_Stream, ReqOutput]] = []
        for out in outputs:
            stream = self.by_wire_id.get(out.rid)
            if stream is None:
                continue
            if stream.heard:
                later.append((stream, out))
                continue
            stream.heard = True
            if not stream.buffer.push(out):
                self._overflow(stream)
        for stream, out in later:
            if not stream.buffer.push(out):
                self._overflow(stream)

    def _overflow(self, stream: _Stream) -> None:
        """A reader fell more than a buffer limit behind: abort its request on the rank
        (its KV is freed) and end the call with RESOURCE_EXHAUSTED."""
        buffer = stream.buffer
        tokens, nbytes = buffer.tokens, buffer.nbytes
        if tokens > buffer.max_tokens:
            limit = f"{buffer.max_tokens} generated tokens were waiting to be sent " \
                    f"(--stream-buffer-tokens)"
        else:
            limit = f"{buffer.max_bytes} bytes of generated output (tokens with their " \
                    f"logprobs and hidden states) were waiting to be sent " \
                    f"(--stream-buffer-bytes)"
        logger.warning(
            "aborting %s: its reader fell %d tokens / %d bytes behind (limits %d tokens, "
            "%s bytes)", stream.wire_id, tokens, nbytes, buffer.max_tokens, buffer.max_bytes,
        )
        buffer.fail(
            StreamOverflow(
                f"request aborted: the client read its stream too slowly and more than {limit}"
            ),
            drop_pending=True,
        )
        if stream.rank not in self.dead_ranks:
            self._send_nowait(stream.rank, AbortReq(stream.wire_id, "reader too slow"))
