"""KV events: radix node events -> fixed-size block events, checked against a model of the
SMG gateway's positional index, and the hub's sequence numbering, snapshots and resume."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from sglang_admin.messages import KvEvents
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.scheduler.kv_pool import TokenAllocator
from sglang_admin.scheduler.radix_cache import RadixCache
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.kv_events import (
    KvEventHub,
    KvSubscription,
    RankBlockIndex,
    chain_hash,
)

B = 4  # a small block size makes splits and partial blocks frequent


# ---------------------------------------------------------------------- helpers


class GatewayView:
    """What the gateway's positional index learns from the events, strictly: a stored run
    must name a parent it knows (no parent-less fallback), removals must name known
    blocks, and every block must have the advertised size."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # block hash -> (parent hash, tokens, position)
        self.blocks: dict[int, tuple[int | None, tuple[int, ...], int]] = {}

    def apply(self, event: pb.KvCacheEvent) -> None:
        which = event.WhichOneof("data")
        if which == "cleared":
            self.blocks.clear()
        elif which == "removed":
            for h in event.removed.block_hashes:
                assert h in self.blocks, f"removal of unknown block {h}"
                del self.blocks[h]
        elif which == "stored":
            parent = (
                event.stored.parent_block_hash
                if event.stored.HasField("parent_block_hash") else None
            )
            if parent is not None:
                assert parent in self.blocks, "stored run after an unknown parent"
                pos = self.blocks[parent][2] + 1
            else:
                pos = 0
            for block in event.stored.blocks:
                assert block.block_size == self.block_size
                assert len(block.token_ids) == self.block_size
                self.blocks[block.block_hash] = (parent, tuple(block.token_ids), pos)
                parent, pos = block.block_hash, pos + 1

    def prefixes(self) -> set[tuple[int, ...]]:
        """The full token prefix that ends at each known block."""
        out = set()
        for h in self.blocks:
            parts = []
            cur: int | None = h
            while cur is not None:
                parent, toks, _ = self.blocks[cur]
                parts.append(toks)
                cur = parent
            out.add(tuple(t for part in reversed(parts) for t in part))
        return out


def expected_prefixes(cache: RadixCache, block_size: int) -> set[tuple[int, ...]]:
    """Every aligned full block of every cached path, as the prefix ending at it."""
    out = set()
    stack = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            full = path + tuple(child.key)
            for end in range(block_size, len(full) + 1, block_size):
                out.add(full[:end])
            stack.append((child, full))
    return out


def put(cache: RadixCache, allocator: TokenAllocator, tokens: list[int]) -> bool:
    """Cache `tokens` as a finished request does (evicting when the pool is full)."""
    m = cache.match_prefix(tokens)
    cache.inc_lock_ref(m.node)
    need = len(tokens) - len(m.slots)
    new = allocator.alloc(need)
    if new is None:
        cache.evict(need - allocator.available)
        new = allocator.alloc(need)
    if new is None:
        cache.dec_lock_ref(m.node)
        return False
    slots = m.slots + new
    k = cache.insert(tokens, slots)
    allocator.free(slots[len(m.slots):k])
    cache.dec_lock_ref(m.node)
    return True


def make(capacity: int = 256) -> tuple[TokenAllocator, RadixCache, list[list]]:
    allocator = TokenAllocator(capacity)
    log: list[list] = []
    return allocator, RadixCache(allocator, on_event=log.append), log


def drain(log: list[list]) -> list[list]:
    events, log[:] = list(log), []
    return events


# ---------------------------------------------------------------------- block index


def test_chain_hash_depends_on_path_only() -> None:
    a = chain_hash(None, [1, 2, 3, 4])
    assert a == chain_hash(None, [1, 2, 3, 4])
    assert chain_hash(a, [5, 6]) != chain_hash(None, [5, 6])
    assert -(2**63) <= chain_hash(a, [7]) < 2**63


def test_store_emits_full_aligned_blocks_only() -> None:
    index = RankBlockIndex(B)
    out = index.apply([["stored", 11, None, [1, 2, 3, 4, 5, 6]]])
    assert len(out) == 1 and out[0].WhichOneof("data") == "stored"
    blocks = out[0].stored.blocks
    assert [list(b.token_ids) for b in blocks] == [[1, 2, 3, 4]]
    assert not out[0].stored.HasField("parent_block_hash")
    # The child completes the block that straddles the boundary: [5, 6, 7, 8].
    out = index.apply([["stored", 12, 11, [7, 8, 9]]])
    assert [list(b.token_ids) for b in out[0].stored.blocks] == [[5, 6, 7, 8]]
    assert out[0].stored.parent_block_hash == blocks[0].block_hash
    # A node that completes no block sends nothing.
    assert index.apply([["stored", 13, 12, [10]]]) == []


def test_split_forwards_nothing_and_eviction_removes_owned_blocks() -> None:
    allocator, cache, log = make()
    index = RankBlockIndex(B)
    view = GatewayView(B)
    put(cache, allocator, list(range(1, 11)))  # one node of 10 tokens: blocks 1-4, 5-8
    for e in index.apply(drain(log)):
        view.apply(e)
    assert len(view.blocks) == 2
    put(cache, allocator, [1, 2, 3, 4, 5, 6, 99, 98])  # splits the node after 6 tokens
    events = index.apply(drain(log))
    # Only the new leaf's block [5, 6, 99, 98] is new; the split itself sends nothing.
    assert [e.WhichOneof("data") for e in events] == ["stored"]
    for e in events:
        view.apply(e)
    assert view.prefixes() == expected_prefixes(cache, B)
    cache.evict(1000)
    for e in index.apply(drain(log)):
        view.apply(e)
    assert view.blocks == {} and index.num_blocks == 0


def test_randomized_against_the_radix_cache() -> None:
    rng = random.Random(7)
    allocator, cache, log = make(capacity=300)
    index = RankBlockIndex(B)
    view = GatewayView(B)
    prefixes = [[rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    for step in range(600):
        op = rng.random()
        if op < 0.6:
            tail = [rng.randrange(1, 6) for _ in range(rng.randrange(0, 15))]
            tokens = rng.choice(prefixes) + tail
            put(cache, allocator, tokens)
        elif op < 0.8:
            cache.match_prefix([rng.randrange(1, 6) for _ in range(rng.randrange(1, 20))])
        elif op < 0.97:
            cache.evict(rng.randrange(1, 40))
        else:
            cache.reset()
            allocator.reset()
        for e in index.apply(drain(log)):
            view.apply(e)
        assert view.prefixes() == expected_prefixes(cache, B), f"diverged at step {step}"
    # A snapshot rebuilds the same view from nothing.
    fresh = GatewayView(B)
    for e in index.snapshot():
        fresh.apply(e)
    assert fresh.prefixes() == view.prefixes()
    assert index.unknown_parents == 0


def test_cleared_is_forwarded() -> None:
    allocator, cache, log = make()
    index = RankBlockIndex(B)
    put(cache, allocator, list(range(20)))
    index.apply(drain(log))
    cache.reset()
    out = index.apply(drain(log))
    assert [e.WhichOneof("data") for e in out] == ["cleared"]
    assert index.nodes == {}


def test_unknown_parent_is_skipped_not_misplaced() -> None:
    index = RankBlockIndex(B)
    assert index.apply([["stored", 5, 4242, [1, 2, 3, 4, 5]]]) == []
    assert index.unknown_parents == 1
    assert index.apply([["removed", [5]]]) == []


# ---------------------------------------------------------------------- hub


def stored_msg(rank: int, node: int, parent: int | None, tokens: list[int]) -> KvEvents:
    return KvEvents(rank, [["stored", node, parent, tokens]])


def test_sequence_numbers_are_per_rank_and_consecutive() -> None:
    hub = KvEventHub(2, block_size=B, base=1000)
    b0 = hub.publish(stored_msg(0, 1, None, [1, 2, 3, 4]))
    b1 = hub.publish(stored_msg(1, 1, None, [1, 2, 3, 4]))
    assert hub.publish(stored_msg(0, 2, 1, [5])) is None  # no block: no batch, no number
    b2 = hub.publish(stored_msg(0, 3, 2, [6, 7, 8]))
    assert (b0.sequence_number, b0.dp_rank) == (1001, 0)
    assert (b1.sequence_number, b1.dp_rank) == (1001, 1)
    assert b2.sequence_number == 1002
    assert [e.event_id for e in [*b0.events, *b2.events]] == [1, 2]
    assert b0.timestamp > 0


def test_default_base_comes_from_the_clock() -> None:
    hub = KvEventHub(1, block_size=B)
    assert hub.ranks[0].seq > (1_600_000_000 << 20)


async def collect(sub: KvSubscription, n: int) -> list[pb.KvEventBatch]:
    out = []
    agen = sub.batches()
    for _ in range(n):
        out.append(await asyncio.wait_for(agen.__anext__(), 1))
    await agen.aclose()
    return out


def test_subscribe_from_zero_gets_a_snapshot_then_live_batches() -> None:
    async def run() -> None:
        hub = KvEventHub(1, block_size=B, base=50)
        hub.publish(stored_msg(0, 1, None, list(range(10))))
        hub.publish(stored_msg(0, 2, 1, list(range(10, 13))))
        sub = hub.subscribe(0)
        hub.publish(stored_msg(0, 3, 2, [13, 14, 15, 16]))
        got = await collect(sub, 2)
        snap, live = got
        assert snap.sequence_number == 52 and live.sequence_number == 53
        assert snap.events[0].WhichOneof("data") == "cleared"
        view = GatewayView(B)
        for batch in got:
            for e in batch.events:
                view.apply(e)
        assert len(view.blocks) == 4  # 0-3, 4-7, 8-11, 12-15
        hub.unsubscribe(sub)
        assert not hub.subscribers

    asyncio.run(run())


def test_snapshot_with_several_ranks_clears_once() -> None:
    hub = KvEventHub(2, block_size=B, base=10)
    hub.publish(stored_msg(0, 1, None, list(range(8))))
    hub.publish(stored_msg(1, 1, None, list(range(100, 104))))
    sub = hub.subscribe(0)
    kinds = [[e.WhichOneof("data") for e in b.events] for b in sub.initial]
    assert kinds == [["cleared", "stored"], ["stored"]]
    assert [(b.dp_rank, b.sequence_number) for b in sub.initial] == [(0, 11), (1, 11)]


def test_a_clear_on_one_rank_makes_the_others_resend_their_blocks() -> None:
    hub = KvEventHub(2, block_size=B, base=0)
    hub.publish(stored_msg(0, 1, None, list(range(8))))
    hub.publish(stored_msg(1, 1, None, list(range(100, 104))))
    sub = hub.subscribe(0)
    view = GatewayView(B)  # one view per worker: the gateway pools the ranks
    for b in sub.initial:
        for e in b.events:
            view.apply(e)
    assert len(view.blocks) == 3
    cleared = hub.publish(KvEvents(0, [["cleared"]]))
    assert sub.queue.get_nowait() is cleared
    resent = sub.queue.get_nowait()
    assert sub.queue.empty()
    assert (cleared.dp_rank, cleared.sequence_number) == (0, 2)
    assert (resent.dp_rank, resent.sequence_number) == (1, 2)
    for b in (cleared, resent):
        for e in b.events:
            view.apply(e)
    assert view.prefixes() == {tuple(range(100, 104))}  # rank 1's block survives the clear


def test_snapshot_of_an_idle_worker_is_one_clear() -> None:
    hub = KvEventHub(1, block_size=B, base=10)
    sub = hub.subscribe(0)
    assert len(sub.initial) == 1 and sub.initial[0].sequence_number == 10
    assert [e.WhichOneof("data") for e in sub.initial[0].events] == ["cleared"]


def test_large_snapshot_is_chunked_with_consecutive_numbers(monkeypatch) -> None:
    import sglang_admin.server.kv_events as kv

    monkeypatch.setattr(kv, "SNAPSHOT_CHUNK_BLOCKS", 2)
    hub = KvEventHub(1, block_size=B, base=100)
    parent = None
    for node in range(1, 6):  # five nodes of one block each
        hub.publish(stored_msg(0, node, parent, [node] * B))
        parent = node
    sub = hub.subscribe(0)
    seqs = [b.sequence_number for b in sub.initial]
    assert seqs == list(range(seqs[0], 106)) and len(seqs) >= 3
    view = GatewayView(B)
    for b in sub.initial:
        for e in b.events:
            view.apply(e)
    assert len(view.blocks) == 5
    # each batch is marked as chunk i of n of the rank's snapshot of its 5 live blocks
    marks = [(b.snapshot.index, b.snapshot.count, b.snapshot.blocks) for b in sub.initial]
    assert marks == [(i, len(seqs), 5) for i in range(len(seqs))]
    hub.publish(stored_msg(0, 9, None, [9] * B))
    assert not sub.queue.get_nowait().HasField("snapshot")  # a live batch is no chunk


def test_resume_from_history_and_out_of_range() -> None:
    hub = KvEventHub(1, block_size=B, base=100)
    for node in range(1, 5):
        hub.publish(stored_msg(0, node, node - 1 if node > 1 else None, [node] * B))
    assert [b.sequence_number for b in hub.subscribe(102).initial] == [103, 104]
    assert hub.subscribe(104).initial == []  # up to date: live only
    for bad in (99, 105, 7):  # before this run, ahead of it, another run's cursor
        with pytest.raises(ServiceError) as err:
            hub.subscribe(bad)
        assert err.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_resume_beyond_kept_history_is_out_of_range(monkeypatch) -> None:
    import sglang_admin.server.kv_events as kv

    monkeypatch.setattr(kv, "HISTORY_BATCHES", 2)
    hub = KvEventHub(1, block_size=B, base=0)
    for node in range(1, 6):
        hub.publish(stored_msg(0, node, node - 1 if node > 1 else None, [node] * B))
    assert [b.sequence_number for b in hub.subscribe(3).initial] == [4, 5]
    with pytest.raises(ServiceError) as err:
        hub.subscribe(1)
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_resume_with_several_ranks_is_out_of_range() -> None:
    hub = KvEventHub(2, block_size=B, base=0)
    with pytest.raises(ServiceError) as err:
        hub.subscribe(5)
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_a_subscriber_that_falls_behind_ends_with_data_loss(monkeypatch) -> None:
    import sglang_admin.server.kv_events as kv

    monkeypatch.setattr(kv, "QUEUE_LIMIT", 3)

    async def run() -> None:
        hub = KvEventHub(1, block_size=B, base=0)
        sub = hub.subscribe(0)
        for node in range(1, 10):
            hub.publish(stored_msg(0, node, node - 1 if node > 1 else None, [node] * B))
        agen = sub.batches()
        got = []
        with pytest.raises(ServiceError) as err:
            async for batch in agen:
                got.append(batch)
        assert err.value.code == grpc.StatusCode.DATA_LOSS
        assert len(got) == 1 + 3  # the snapshot, then what fit in the queue

    asyncio.run(run())


def test_close_ends_live_subscriptions() -> None:
    async def run() -> None:
        hub = KvEventHub(1, block_size=B, base=0)
        sub = hub.subscribe(0)
        hub.close()
        assert [b.sequence_number for b in [b async for b in sub.batches()]] == [0]
        with pytest.raises(ServiceError) as err:  # shutting down: no new subscribers
            hub.subscribe(0)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())
