"""The server's side of the ZMQ link to the scheduler ranks (zmq.asyncio): the sockets, the
inbox read and dispatched by message type, the ranks' readiness, states and heartbeats, and
the sends to a rank.

- Generate: a request goes to one rank, its outputs come back into its call's buffer
  (server/rank_streams.py).
- Admin ops: one message to every rank, one reply per rank matched by a fresh id
  (server/rank_calls.py).
- Ranks publish their state after steps; GetLoads reads it without a round trip.
- KV events go through the block index to the subscribers (server/kv_events.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from sglang_admin.config import ServerArgs
from sglang_admin.messages import (
    AdminReply,
    BatchOutput,
    FailedMsg,
    Heartbeat,
    KvEvents,
    ModelInfo,
    RankState,
    ReadyMsg,
    ShutdownReq,
    StateUpdate,
    decode,
    encode,
)
from sglang_admin.server.kv_events import KvEventHub
from sglang_admin.server.metrics import Metrics
from sglang_admin.server.rank_calls import RankCalls, RankFailure, _AdminCall
from sglang_admin.server.rank_streams import RankStreams, RankUnavailable, _Stream
from sglang_admin.server.stream_buffer import ByteBudget

__all__ = ["Communicator", "RankFailure", "RankUnavailable"]

logger = logging.getLogger(__name__)

READ_BATCH = 64  # messages dispatched per inbox wake-up before other callbacks get a turn
# plain ints: pyzmq's enum constants cost an enum operation on every use
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


class Communicator(RankStreams, RankCalls):
    """Routes requests to ranks and results back to the calls waiting for them."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ctx = zmq.asyncio.Context()
        # A plain socket, drained by a loop reader callback (_on_readable): no task and no
        # future per message, and a reply wakes its call one loop iteration sooner.
        self.inbox = zmq.Socket(self.ctx, zmq.PULL)
        self.inbox.bind(args.server_addr)
        self.outboxes = []
        for rank in range(args.dp_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(args.scheduler_addr(rank))
            self.outboxes.append(sock)
        # The same sockets without the asyncio layer: a send that the socket takes at once
        # (nearly every one: a rank drains its inbox between steps) costs no Future, no
        # callback and no kwargs copy; only one it cannot take goes through the layer.
        # While a send waits in that layer, later ones queue behind it there (in order).
        self._plain_outboxes = [zmq.Socket.shadow(sock.underlying) for sock in self.outboxes]
        self._queued_sends = [0] * args.dp_size
        self.streams: dict[str, _Stream] = {}  # by the client's request id
        self.buffered = ByteBudget(args.stream_buffer_bytes_total)  # every stream's buffer
        self.by_wire_id: dict[str, _Stream] = {}  # by the id the rank sees
        self._wire_seq = itertools.count()
        self._admin_seq = itertools.count()
        self.calls: dict[str, _AdminCall] = {}
        self.inflight = [0] * args.dp_size
        self.rank_states: list[RankState | None] = [None] * args.dp_size
        # Each rank's last heartbeat and when it arrived (monotonic): server/watchdog.py
        self.heartbeats: list[Heartbeat | None] = [None] * args.dp_size
        self.heard_at: list[float] = [0.0] * args.dp_size
        # --tp-size > 1: when each TP follower's heartbeat last arrived, by (dp, tp) rank
        self.follower_heard_at: dict[tuple[int, int], float] = {}
        self.model_info: ModelInfo | None = None  # rank 0's, once the ranks are ready
        self.ready_ranks: set[int] = set()
        self.ready = asyncio.Event()
        self.startup_error: str | None = None
        self.dead_ranks: dict[int, str] = {}
        self.kv_hub = KvEventHub(args.dp_size)  # block events for SubscribeKvEvents
        self._kv_deferred: list[KvEvents] = []  # KvEvents waiting for their turn (_dispatch)
        self.last_receive_time = 0.0
        self._rr = itertools.cycle(range(args.dp_size))
        self._shared_reads: dict[str, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # set while reading the inbox
        self.closed = False
        self.down_reason: str | None = None  # set by fail_all: the server is going down
        self.metrics = Metrics(args, self.served_model_name, self.published_states)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.inbox.FD, self._on_readable)
        self._loop.call_soon(self._on_readable)  # what arrived before the reader was added

    async def close(self) -> None:
        self.kv_hub.close()
        self.closed = True
        for rank, sock in enumerate(self.outboxes):
            if rank not in self.dead_ranks:
                try:
                    await sock.send(encode(ShutdownReq()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        if self._loop is not None:
            self._loop.remove_reader(self.inbox.FD)
            self._loop = None
        self.inbox.close(linger=0)
        for sock in self.outboxes:
            sock.close(linger=0)
        self.ctx.term()

    @property
    def healthy(self) -> bool:
        return self.ready.is_set() and not self.dead_ranks

    def rank_failed(self, rank: int, reason: str) -> None:
        """A rank is gone: every call waiting on it ends now with UNAVAILABLE."""
        if rank in self.dead_ranks:
            return
        self.dead_ranks[rank] = reason
        logger.error("rank %d failed: %s", rank, reason)
        for stream in self.streams.values():
            if stream.rank == rank:
                stream.buffer.fail(RankUnavailable(f"scheduler rank {rank} {reason}"))
        for call in self.calls.values():
            if rank in call.ranks:
                call.finish()
        if not self.ready.is_set() and self.startup_error is None:
            self.startup_error = f"scheduler rank {rank} {reason}"
            self.ready.set()

    def fail_all(self, reason: str) -> None:
        """The server is going down: every waiting call, on any rank, ends now."""
        self.down_reason = reason
        for stream in self.streams.values():
            stream.buffer.fail(RankUnavailable(reason))
        for call in self.calls.values():
            call.finish()

    # ------------------------------------------------------------------ inbound

    def _on_readable(self) -> None:
        """Dispatch what the inbox holds. ZMQ's FD only signals a change, so read until the
        inbox is empty, or, after a batch, come back at the next loop iteration (the other
        callbacks, gRPC writes among them, run in between)."""
        if self._loop is None:  # closed
            return
        inbox = self.inbox
        for _ in range(READ_BATCH):
            # asked first: a receive that finds the inbox empty raises zmq.Again, and every
            # wake-up ends with one (an exception made, raised and caught: several us)
            if not inbox.get(_EVENTS) & _POLLIN:
                return
            try:
                data = inbox.recv(_NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(data)
            except Exception:  # noqa: BLE001 - a corrupt frame must not stop the server
                logger.exception("undecodable message from a rank")
                continue
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001
                logger.exception("failed to dispatch %s", type(msg).__name__)
        self._loop.call_soon(self._on_readable)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchOutput):
            self.last_receive_time = time.time()
            self._file_outputs(msg.outputs)
        elif isinstance(msg, StateUpdate):
            self.rank_states[msg.state.dp_rank] = msg.state
        elif isinstance(msg, Heartbeat):
            if msg.tp_rank:
                self.follower_heard_at[msg.dp_rank, msg.tp_rank] = time.monotonic()
                return
            self.heartbeats[msg.dp_rank] = msg
            self.heard_at[msg.dp_rank] = time.monotonic()
        elif isinstance(msg, AdminReply):
            call = self.calls.get(msg.rid)
            if call is None or msg.dp_rank not in call.ranks:
                logger.warning(
                    "dropping late reply from rank %d for %s (its call already ended)",
                    msg.dp_rank, msg.rid,
                )
                return
            call.replies[msg.dp_rank] = msg
            if len(call.replies) == len(call.ranks):
                call.finish()
        elif isinstance(msg, KvEvents):
            if self._loop is None or (self.kv_hub.subscribers and not self._kv_deferred):
                self._publish_kv_events(msg)
            else:
                # Nobody reads the events live: the answer that came with them (a flush's)
                # goes out first, their bookkeeping (history, sequence numbers) right after
                # it. Once one waits, later ones wait behind it: they stay in order.
                self._kv_deferred.append(msg)
                if len(self._kv_deferred) == 1:
                    # Two hops: the answer of the same ZMQ message, dispatched after these
                    # events, queues its call's wake-up behind our first hop; the second
                    # hop runs after that call has resumed and handed gRPC its response.
                    self._loop.call_soon(self._loop.call_soon, self._publish_deferred_kv_events)
        elif isinstance(msg, ReadyMsg):
            self.ready_ranks.add(msg.dp_rank)
            self.rank_states[msg.dp_rank] = msg.state
            self.heard_at[msg.dp_rank] = time.monotonic()
            for tp_rank in range(1, self.args.tp_size // self.args.nnodes):  # this node's, loaded
                self.follower_heard_at[msg.dp_rank, tp_rank] = time.monotonic()
            if msg.dp_rank == 0 or self.model_info is None:
                self.model_info = msg.model_info
            if len(self.ready_ranks) == self.args.dp_size:
                self.ready.set()
        elif isinstance(msg, FailedMsg):
            self.rank_failed(msg.dp_rank, f"failed to start: {msg.error}")

    def _publish_deferred_kv_events(self) -> None:
        """File every KvEvents that waited for an answer to go out, in arrival order."""
        waiting, self._kv_deferred = self._kv_deferred, []
        for msg in waiting:
            try:
                self._publish_kv_events(msg)
            except Exception:  # noqa: BLE001 - one bad batch must not hold back the others
                logger.exception("failed to file KV events of rank %d", msg.dp_rank)

    def _publish_kv_events(self, msg: KvEvents) -> None:
        batch = self.kv_hub.publish(msg)
        self.metrics.kv_events_published(msg.dp_rank, len(batch.events) if batch else 0)

    def served_model_name(self) -> str:
        """--served-model-name, or the path of the model the ranks loaded."""
        info = self.model_info
        return self.args.served_model_name or (info.model_path if info else "") or "unknown"

    def published_states(self) -> list[tuple[int, RankState, float]]:
        """(rank, its last published state, that state's age in s) for each rank heard of."""
        now = time.time()
        return [(rank, state, self.state_age(rank, now))
                for rank, state in enumerate(self.rank_states) if state is not None]

    def state_age(self, rank: int, now: float | None = None) -> float:
        """Seconds since rank ``rank`` last published its state or confirmed it unchanged
        (its heartbeat carries when its loop last checked); 0 before any state."""
        state = self.rank_states[rank]
        if state is None:
            return 0.0
        beat = self.heartbeats[rank]
        seen = max(state.timestamp, beat.state_confirmed if beat is not None else 0.0)
        return max(0.0, (time.time() if now is None else now) - seen)

    def _send_nowait(self, rank: int, msg: Any) -> None:
        if self.closed:  # shutting down: the rank is being stopped anyway
            return
        name = type(msg).__name__

        def check(fut: asyncio.Future) -> None:
            # zmq.asyncio reports a failed send through the future, not by raising.
            if not fut.cancelled() and fut.exception() is not None:
                logger.warning("could not send %s to rank %d: %s", name, rank, fut.exception())

        data = encode(msg)
        if not self._queued_sends[rank]:
            try:
                self._plain_outboxes[rank].send(data, _NOBLOCK)
                return
            except zmq.Again:
                pass  # the socket is full: the asyncio layer reports what becomes of it
            except zmq.ZMQError as exc:
                logger.warning("could not send %s to rank %d: %s", name, rank, exc)
                return
        try:
            fut = self.outboxes[rank].send(data, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("could not send %s to rank %d: %s", name, rank, exc)
            return
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(check)

    async def _send(self, rank: int, data: bytes) -> None:
        """Send ``data`` to ``rank``: at once when its socket takes it, else once it can."""
        if not self._queued_sends[rank]:
            try:
                self._plain_outboxes[rank].send(data, _NOBLOCK)
                return
            except zmq.Again:
                pass
        self._queued_sends[rank] += 1
        try:
            await self.outboxes[rank].send(data)
        finally:
            self._queued_sends[rank] -= 1

