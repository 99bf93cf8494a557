"""KV cache events for a cache-aware router, in the block model the SMG gateway indexes.

What the ranks send
-------------------
Each rank's radix cache is token-granular (page size 1) with variable-length nodes. After
every step a rank sends the step's node events (see ``scheduler/radix_cache.py``):
``["stored", node_hash, parent_node_hash_or_None, tokens]``, ``["removed", [node_hash,
...]]`` and ``["cleared"]``; a node split shows as ``removed [h]``, ``stored upper`` and
``stored h`` (the lower half keeps its hash) in that order.

What the gateway indexes
------------------------
The gateway's event-driven index is positional over fixed-size blocks: it cuts a
request's tokens into ``block_size`` chunks from position 0 (a partial last chunk is
dropped), hashes each chunk's tokens, and matches chunk ``k`` against the blocks workers
reported at position ``k``, following ``parent_block_hash`` to place a stored run after
its parent. It learns ``block_size`` from the first stored block it sees. So node
segments cannot be forwarded as blocks: a node of 37 tokens is not a block.

The mapping (:class:`RankBlockIndex`): a *block* is the aligned chunk
``path[k*B:(k+1)*B]`` of a cached token path, owned by the node in which it ends. Its hash
chains the previous block's hash with its tokens, so it depends only on the path, never on
how the tree cuts it. Per node the index keeps the path length at the node's end, the
tokens since the last block boundary, the hash of the last block at or before its end, and
the blocks it owns. Then:

- node stored: its new blocks are ``parent_tail + tokens`` cut into full chunks, stored
  after the parent's last block (no event when the node completes no block);
- nodes removed (eviction takes leaves only): the blocks they owned are removed, so the
  gateway's view stays prefix-closed;
- node split: the block set does not change; the index re-files the blocks under the two
  halves and forwards nothing;
- cleared: forwarded as KvCacheCleared (a FlushCache produces one).

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
import hashlib
import logging
import os
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from sglang_admin.constants import LORA_NAMESPACE_SHIFT, LORA_TOKEN_MASK
from sglang_admin.messages import KvEvents
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import ServiceError

logger = logging.getLogger(__name__)


def _block_size_from_env() -> int:
    raw = os.environ.get("SGLANG_ADMIN_KV_BLOCK_SIZE", "16")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        logger.warning("SGLANG_ADMIN_KV_BLOCK_SIZE=%r is not a positive integer; using 16", raw)
        return 16
    return value


KV_BLOCK_SIZE = _block_size_from_env()  # the gateway's default --block-size is 16
HISTORY_BATCHES = 1024  # batches kept per rank for resuming subscribers
HISTORY_BLOCKS = 1 << 16  # ... and at most this many blocks in them
QUEUE_LIMIT = 4096  # batches a subscriber may fall behind before it is cut off
SNAPSHOT_CHUNK_BLOCKS = 8192  # blocks per snapshot batch (~0.5 MB with 16-token blocks)

Block = tuple[int, list[int]]  # (block hash, its tokens)


def chain_hash(prev: int | None, tokens: Sequence[int]) -> int:
    """Hash of a block: blake2b-64 of the previous block's hash and this block's tokens,
    as a signed int64 (the proto's ``block_hash``). Depends only on the token path."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if prev is None else b"\x01" + prev.to_bytes(8, "little", signed=True))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass
class _Node:
    """What the index knows of one radix node (keyed by the node's own hash)."""

    parent: int | None  # the parent node's hash; None for a child of the root
    start: int  # path length before the node
    end: int  # path length at the node's end
    tail: list[int]  # path tokens after the last block boundary at or before `end`
    prev_block: int | None  # hash of the last block ending at or before `start`
    last_block: int | None  # hash of the last block ending at or before `end`
    blocks: list[Block] = field(default_factory=list)  # blocks ending inside the node


_ROOT = _Node(parent=None, start=0, end=0, tail=[], prev_block=None, last_block=None)


class RankBlockIndex:
    """One rank's radix node events turned into fixed-size block events (see module doc)."""

    def __init__(self, block_size: int = KV_BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.nodes: dict[int, _Node] = {}
        self.unknown_parents = 0  # stores whose parent node was never seen (skipped)

    @property
    def num_blocks(self) -> int:
        return sum(len(node.blocks) for node in self.nodes.values())

    def apply(self, raw_events: Sequence[Sequence[Any]]) -> list[pb.KvCacheEvent]:
        """Apply one step's node events; returns the block events (event_id unset)."""
        out: list[pb.KvCacheEvent] = []
        i, n = 0, len(raw_events)
        while i < n:
            ev = raw_events[i]
            kind = ev[0] if ev else None
            if kind == "removed" and self._is_split(raw_events, i):
                out += self._split(raw_events[i + 1], raw_events[i + 2])
                i += 3
                continue
            if kind == "stored":
                out += self._store(int(ev[1]), ev[2], list(ev[3]))
            elif kind == "removed":
                event = self._remove([int(h) for h in ev[1]])
                if event is not None:
                    out.append(event)
            elif kind == "cleared":
                self.nodes.clear()
                out.append(pb.KvCacheEvent(cleared=pb.KvCacheCleared()))
            else:
                logger.warning("ignoring unknown radix cache event %r", kind)
            i += 1
        return out

    def snapshot(self) -> list[pb.KvCacheEvent]:
        """Stored events for every live block, parents before children (no clear)."""
        events = []
        for node in sorted(self.nodes.values(), key=lambda node: node.start):
            if node.blocks:
                events.append(self._stored_event(node.blocks, node.prev_block))
        return events

    # ------------------------------------------------------------------ internals

    def _stored_event(self, blocks: list[Block], parent: int | None) -> pb.KvCacheEvent:
        stored = pb.KvBlocksStored(blocks=[self._block(h, tokens) for h, tokens in blocks])
        if parent is not None:
            stored.parent_block_hash = parent
        return pb.KvCacheEvent(stored=stored)

    def _block(self, block_hash: int, tokens: list[int]) -> pb.KvBlock:
        """A block; tokens of a LoRA adapter's requests carry its cache namespace in their
        high bits (scheduler/lora_registry.py): sent as the tokens and KvBlock.lora_id."""
        namespace = tokens[0] >> LORA_NAMESPACE_SHIFT if tokens else 0
        if not namespace:
            return pb.KvBlock(block_hash=block_hash, token_ids=tokens, block_size=self.block_size)
        return pb.KvBlock(block_hash=block_hash, token_ids=[t & LORA_TOKEN_MASK for t in tokens],
                          block_size=self.block_size, lora_id=namespace)

    def _new_node(self, parent_hash: int | None, tokens: list[int]) -> _Node | None:
        parent = _ROOT if parent_hash is None else self.nodes.get(int(parent_hash))
        if parent is None:
            self.unknown_parents += 1
            return None
        bs = self.block_size
        buf = parent.tail + tokens
        full = len(buf) // bs
        prev = parent.last_block
        blocks: list[Block] = []
        for k in range(full):
            chunk = buf[k * bs : (k + 1) * bs]
            prev = chain_hash(prev, chunk)
            blocks.append((prev, chunk))
        return _Node(
            parent=None if parent_hash is None else int(parent_hash),
            start=parent.end,
            end=parent.end + len(tokens),
            tail=buf[full * bs :],
            prev_block=parent.last_block,
            last_block=prev,
            blocks=blocks,
        )

    def _store(
        self, node_hash: int, parent_hash: int | None, tokens: list[int]
    ) -> list[pb.KvCacheEvent]:
        out: list[pb.KvCacheEvent] = []
        old = self.nodes.pop(node_hash, None)
        if old is not None:  # not a pattern the cache emits; stay consistent anyway
            logger.warning("radix node %d stored twice; replacing it", node_hash)
            if old.blocks:
                out.append(self._removed_event(old.blocks))
        node = self._new_node(parent_hash, tokens)
        if node is not None:
            self.nodes[node_hash] = node
            if node.blocks:
                out.append(self._stored_event(node.blocks, node.prev_block))
        return out

    @staticmethod
    def _removed_event(blocks: list[Block]) -> pb.KvCacheEvent:
        return pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=[h for h, _ in blocks]))

    def _remove(self, node_hashes: list[int]) -> pb.KvCacheEvent | None:
        blocks: list[Block] = []
        for node_hash in node_hashes:
            node = self.nodes.pop(node_hash, None)
            if node is not None:
                blocks += node.blocks
        return self._removed_event(blocks) if blocks else None

    def _is_split(self, events: Sequence[Sequence[Any]], i: int) -> bool:
        """removed [h], stored (u, parent(h), ...), stored (h, u, ...): a node split."""
        if i + 2 >= len(events):
            return False
        removed, upper, lower = events[i], events[i + 1], events[i + 2]
        if len(removed[1]) != 1 or upper[0] != "stored" or lower[0] != "stored":
            return False
        h = int(removed[1][0])
        node = self.nodes.get(h)
        return (
            node is not None
            and int(lower[1]) == h
            and lower[2] is not None
            and int(lower[2]) == int(upper[1])
            and (upper[2] is None) == (node.parent is None)
            and (upper[2] is None or int(upper[2]) == node.parent)
        )

    def _split(self, upper_ev: Sequence[Any], lower_ev: Sequence[Any]) -> list[pb.KvCacheEvent]:
        """Re-file a split node's blocks under its two halves.

        The halves cover the old node's path span, so its blocks are theirs and nothing is
        forwarded; should they differ, the old blocks are removed and the new ones stored.
        """
        h = int(lower_ev[1])
        old = self.nodes.pop(h)
        upper = self._new_node(upper_ev[2], list(upper_ev[3]))
        lower = None
        if upper is not None:
            self.nodes[int(upper_ev[1])] = upper
            lower = self._new_node(int(upper_ev[1]), list(lower_ev[3]))
        if lower is not None:
            self.nodes[h] = lower
        halves = [n for n in (upper, lower) if n is not None]
        if [b for n in halves for b, _ in n.blocks] == [b for b, _ in old.blocks]:
            return []
        logger.warning("radix split of node %d changed its blocks; re-sending them", h)
        out = [self._removed_event(old.blocks)] if old.blocks else []
        out += [self._stored_event(n.blocks, n.prev_block) for n in halves if n.blocks]
        return out


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
