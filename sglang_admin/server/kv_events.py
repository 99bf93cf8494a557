"""KV cache events for a cache-aware router: each rank's block events (server/kv_blocks.py
turns its radix node events into the gateway's fixed-size blocks) numbered per rank, kept
for resuming subscribers, and served to SubscribeKvEvents.

Streams and sequence numbers (:class:`KvEventHub`)
--------------------------------------------------
The gateway keeps one admission cursor per ``dp_rank``: every batch carries its rank and
that rank's own sequence number, one more than the rank's previous batch. A batch is sent
only when a step produced block events. A rank's numbering starts from a base taken from
the clock at server start (``time << 20``), so a restarted worker never reuses the numbers
of its previous life and a cursor from that life cannot be mistaken for a current one.

- ``start_sequence_number == 0``: the stream opens with a snapshot, per rank, of every
  live block (one KvCacheCleared first, then stored runs parents first), numbered so that
  it ends at the rank's current sequence; live batches follow with no gap.
- a non-zero start (the gateway resumes after rank 0's cursor): with one rank, the kept
  history replays every batch after it, then the stream goes live; when the history does
  not reach back (or the cursor is not from this process, or there are several ranks,
  whose cursors one number cannot name) the call ends with OUT_OF_RANGE, which the gateway
  answers by clearing the worker and resubscribing from zero.
- a subscriber that falls ``QUEUE_LIMIT`` batches behind is ended with DATA_LOSS (the
  gateway clears and resubscribes from zero).

The gateway keeps one index per worker, shared by its ranks: a KvCacheCleared from any
rank empties it, so after a rank's clear the other ranks re-send their live blocks as their
next batch (with one rank nothing changes).

Every KvEvents message of every rank goes through the index, subscribers or not, so the
snapshot is always exact.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from sglang_admin.messages import KvEvents
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.kv_blocks import KV_BLOCK_SIZE, RankBlockIndex

logger = logging.getLogger(__name__)

HISTORY_BATCHES = 1024  # batches kept per rank for resuming subscribers
HISTORY_BLOCKS = 1 << 16  # ... and at most this many blocks in them
QUEUE_LIMIT = 4096  # batches a subscriber may fall behind before it is cut off
SNAPSHOT_CHUNK_BLOCKS = 8192  # blocks per snapshot batch (~0.5 MB with 16-token blocks)


class KvSubscription:
    """One SubscribeKvEvents call: the batches to send first, then a live queue."""

    def __init__(self, initial: list[pb.KvEventBatch]) -> None:
        self.initial = initial
        self.queue: asyncio.Queue[pb.KvEventBatch | None] = asyncio.Queue()
        self.overflowed = False
        self.closed = False

    def offer(self, batch: pb.KvEventBatch) -> None:
        if self.overflowed or self.closed:
            return
        if self.queue.qsize() >= QUEUE_LIMIT:
            self.overflowed = True
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait(batch)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(None)

    async def batches(self) -> AsyncIterator[pb.KvEventBatch]:
        """The initial batches, then live ones until the subscription ends.

        Raises ServiceError(DATA_LOSS) when this subscriber fell too far behind.
        """
        for batch in self.initial:
            yield batch
        self.initial = []
        while True:
            batch = await self.queue.get()
            if batch is None:
                if self.overflowed:
                    raise ServiceError(
                        grpc.StatusCode.DATA_LOSS,
                        f"KV event subscriber fell more than {QUEUE_LIMIT} batches behind; "
                        "resubscribe from zero for a snapshot",
                    )
                return
            yield batch


@dataclass
class _RankStream:
    index: RankBlockIndex
    seq: int  # sequence number of the rank's last batch (the base before any)
    base: int
    next_event_id: int = 1
    history: deque = field(default_factory=deque)  # recent pb.KvEventBatch, oldest first
    history_sizes: deque = field(default_factory=deque)  # the blocks of each, counted once
    history_blocks: int = 0


def _count_blocks(events: list[pb.KvCacheEvent]) -> int:
    """The blocks a batch's events name (a clear names none)."""
    count = 0
    for e in events:
        kind = e.WhichOneof("data")
        if kind == "stored":
            count += len(e.stored.blocks)
        elif kind == "removed":
            count += len(e.removed.block_hashes)
    return count


class KvEventHub:
    """Every rank's block index and sequence numbering, and the live subscribers."""

    def __init__(
        self, dp_size: int, block_size: int = KV_BLOCK_SIZE, base: int | None = None
    ) -> None:
        start = int(time.time()) << 20 if base is None else base
        self.ranks = [
            _RankStream(index=RankBlockIndex(block_size), seq=start, base=start)
            for _ in range(dp_size)
        ]
        self.subscribers: set[KvSubscription] = set()
        self.closed = False

    # ------------------------------------------------------------------ inbound

    def publish(self, msg: KvEvents) -> pb.KvEventBatch | None:
        """Apply one KvEvents message of a rank; fan the resulting batch out (if any).

        The gateway's index of a worker is shared by its ranks, so a KvCacheCleared from
        one rank empties it for all: after one, every other rank re-sends its live blocks.
        """
        if not 0 <= msg.dp_rank < len(self.ranks):
            logger.warning("KV events from unknown rank %d dropped", msg.dp_rank)
            return None
        events = self.ranks[msg.dp_rank].index.apply(msg.events)
        batch = self._emit(msg.dp_rank, events)
        if any(e.WhichOneof("data") == "cleared" for e in events):
            for other, rank in enumerate(self.ranks):
                if other != msg.dp_rank:
                    self._emit(other, rank.index.snapshot())
        return batch

    def _emit(self, dp_rank: int, events: list[pb.KvCacheEvent]) -> pb.KvEventBatch | None:
        """Number a rank's events as its next batch, keep it, and fan it out."""
        if not events:
            return None
        rank = self.ranks[dp_rank]
        for event in events:
            event.event_id = rank.next_event_id
            rank.next_event_id += 1
        rank.seq += 1
        batch = pb.KvEventBatch(
            sequence_number=rank.seq, timestamp=time.time(), events=events, dp_rank=dp_rank
        )
        blocks = _count_blocks(events)
        rank.history.append(batch)
        rank.history_sizes.append(blocks)
        rank.history_blocks += blocks
        while len(rank.history) > HISTORY_BATCHES or (
            rank.history_blocks > HISTORY_BLOCKS and len(rank.history) > 1
        ):
            rank.history.popleft()
            rank.history_blocks -= rank.history_sizes.popleft()
        for sub in list(self.subscribers):
            sub.offer(batch)
        return batch

    # ------------------------------------------------------------------ subscribers

    def subscribe(self, start_sequence_number: int) -> KvSubscription:
        """Register a subscriber (synchronously: no batch can slip in between).

        Raises ServiceError(OUT_OF_RANGE) when a non-zero cursor cannot be resumed, and
        UNAVAILABLE once the hub is closed (the server is shutting down).
        """
        if self.closed:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if start_sequence_number:
            initial = self._resume(start_sequence_number)
        else:
            initial = self._snapshot()
        sub = KvSubscription(initial)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: KvSubscription) -> None:
        self.subscribers.discard(sub)
        sub.close()

    def close(self) -> None:
        """End every live subscription and refuse new ones (at shutdown)."""
        self.closed = True
        for sub in list(self.subscribers):
            self.unsubscribe(sub)

    def _resume(self, cursor: int) -> list[pb.KvEventBatch]:
        if len(self.ranks) != 1:
            raise ServiceError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"KV event cursor {cursor} cannot be resumed: this worker has "
                f"{len(self.ranks)} data-parallel ranks, each with its own sequence; "
                "resubscribe from zero for a snapshot",
            )
        rank = self.ranks[0]
        if cursor == rank.seq:
            return []
        if cursor < rank.base or cursor > rank.seq:
            raise ServiceError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"KV event cursor {cursor} is not from this worker's current run (its "
                f"sequence runs from {rank.base + 1} to {rank.seq}); resubscribe from zero "
                "for a snapshot",
            )
        if not rank.history or rank.history[0].sequence_number > cursor + 1:
            raise ServiceError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"KV event history no longer reaches back to sequence {cursor + 1}; "
                "resubscribe from zero for a snapshot",
            )
        return [b for b in rank.history if b.sequence_number > cursor]

    def _snapshot(self) -> list[pb.KvEventBatch]:
        """Every rank's live blocks, numbered to end at the rank's current sequence.

        The first batch opens with one KvCacheCleared: the gateway's index of a worker is
        shared by its ranks, so a clear per rank would wipe the ranks sent before it.
        """
        now = time.time()
        batches: list[pb.KvEventBatch] = []
        for dp_rank, rank in enumerate(self.ranks):
            events = rank.index.snapshot()
            if dp_rank == 0:
                events.insert(0, pb.KvCacheEvent(cleared=pb.KvCacheCleared()))
            chunks: list[list[pb.KvCacheEvent]] = [[]]
            size = 0
            for event in events:
                blocks = len(event.stored.blocks)
                if chunks[-1] and size + blocks > SNAPSHOT_CHUNK_BLOCKS:
                    chunks.append([])
                    size = 0
                chunks[-1].append(event)
                size += blocks
            first = rank.seq - len(chunks) + 1
            sent = [(i, chunk) for i, chunk in enumerate(chunks) if chunk or dp_rank == 0]
            blocks = sum(len(e.stored.blocks) for e in events)
            for n, (i, chunk) in enumerate(sent):
                batches.append(
                    pb.KvEventBatch(
                        sequence_number=first + i, timestamp=now, events=chunk, dp_rank=dp_rank,
                        snapshot=pb.KvSnapshotChunk(index=n, count=len(sent), blocks=blocks),
                    )
                )
        return batches
