"""RadixCache: unit tests, a randomized check against a brute-force model, and the
scheduler's usage pattern under memory pressure."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import pytest

from sglang_admin.scheduler.kv_pool import TokenAllocator
from sglang_admin.scheduler.radix_cache import RadixCache, TreeNode, path_hash

# ---------------------------------------------------------------------- helpers


def make(capacity: int = 64, events: bool = False, disable: bool = False
         ) -> tuple[TokenAllocator, RadixCache, list[list]]:
    allocator = TokenAllocator(capacity, debug=True)
    log: list[list] = []
    cache = RadixCache(allocator, on_event=log.append if events else None, disable=disable)
    return allocator, cache, log


def put(cache: RadixCache, allocator: TokenAllocator, tokens: list[int]) -> list[int]:
    """Cache `tokens` the way a finished request does: match, lock, alloc, insert, unlock."""
    m = cache.match_prefix(tokens)
    cache.inc_lock_ref(m.node)
    new = allocator.alloc(len(tokens) - len(m.slots))
    assert new is not None
    slots = m.slots + new
    k = cache.insert(tokens, slots)
    allocator.free(slots[len(m.slots):k])
    cache.dec_lock_ref(m.node)
    return slots


def nodes(cache: RadixCache) -> list[tuple[tuple[int, ...], TreeNode]]:
    """(full token path, node) of every node but the root."""
    out = []
    stack: list[tuple[tuple[int, ...], TreeNode]] = [((), cache.root)]
    while stack:
        path, node = stack.pop()
        for child in node.children.values():
            child_path = path + tuple(child.key)
            out.append((child_path, child))
            stack.append((child_path, child))
    return out


def contents(cache: RadixCache) -> dict[tuple[int, ...], tuple[int, int, int]]:
    """Every cached prefix -> (slot, node last_access, node lock_ref)."""
    out = {}
    for path, node in nodes(cache):
        start = len(path) - len(node.key)
        for i, slot in enumerate(node.value):
            out[path[: start + i + 1]] = (slot, node.last_access, node.lock_ref)
    return out


def node_path(node: TreeNode) -> list[int]:
    path: list[int] = []
    while node.parent is not None:
        path[:0] = node.key
        node = node.parent
    return path


def segments(cache: RadixCache) -> set[tuple[int, ...]]:
    return {path for path, _ in nodes(cache)}


class Mirror:
    """What a router rebuilds from the cache's events."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}

    def apply(self, event: list) -> None:
        kind = event[0]
        if kind == "stored":
            _, h, parent, tokens = event
            assert h not in self.blocks, "stored twice"
            assert parent is None or parent in self.blocks, "parent unknown"
            self.blocks[h] = (parent, list(tokens))
        elif kind == "removed":
            for h in event[1]:
                del self.blocks[h]
        elif kind == "cleared":
            assert len(event) == 1
            self.blocks.clear()
        else:
            raise AssertionError(f"unknown event {event!r}")

    def paths(self) -> dict[int, tuple[int, ...]]:
        out = {}
        for h in self.blocks:
            path: list[int] = []
            cur: int | None = h
            while cur is not None:
                parent, tokens = self.blocks[cur]
                path[:0] = tokens
                cur = parent
            out[h] = tuple(path)
        return out


def assert_mirror_matches(mirror: Mirror, cache: RadixCache) -> None:
    paths = mirror.paths()
    assert sorted(paths.values()) == sorted(segments(cache))
    for h, path in paths.items():
        assert h == path_hash(path)


# ---------------------------------------------------------------------- match / insert


def test_empty_cache_matches_nothing() -> None:
    _, cache, _ = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.slots == [] and m.node is cache.root
    assert cache.match_prefix([]).node is cache.root
    assert cache.total_size() == cache.evictable_size == cache.protected_size == 0


def test_insert_then_match_exact_longer_and_diverging() -> None:
    allocator, cache, _ = make()
    slots = allocator.alloc(4)
    assert slots is not None
    assert cache.insert([1, 2, 3, 4], slots) == 0
    assert cache.total_size() == cache.evictable_size == 4
    assert cache.match_prefix([1, 2, 3, 4]).slots == slots
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots == slots
    assert cache.match_prefix([9, 1, 2]).slots == []
    assert cache.match_prefix((1, 2, 3, 4)).slots == slots  # any Sequence works
    assert cache.match_prefix(range(1, 4)).slots == slots[:3]
    cache.check()


def test_match_ending_inside_a_node_splits_it() -> None:
    allocator, cache, _ = make()
    slots = put(cache, allocator, [1, 2, 3, 4, 5])
    assert segments(cache) == {(1, 2, 3, 4, 5)}
    m = cache.match_prefix([1, 2, 7])
    assert m.slots == slots[:2]
    assert m.node.key == [1, 2] and m.node.value == slots[:2]
    assert segments(cache) == {(1, 2), (1, 2, 3, 4, 5)}
    assert cache.total_size() == 5
    # the lower half kept its slots
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == slots
    cache.check()


def test_insert_returns_prefix_already_cached_and_keeps_tree_slots() -> None:
    allocator, cache, _ = make(capacity=16)
    first = allocator.alloc(3)
    assert first is not None
    assert cache.insert([1, 2, 3], first) == 0
    # another request computed the same prefix in its own slots, plus two more tokens
    second = allocator.alloc(5)
    assert second is not None
    k = cache.insert([1, 2, 3, 4, 5], second)
    assert k == 3
    allocator.free(second[:k])  # duplicates of tree-owned KV: the caller frees them
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == first + second[3:]
    assert cache.total_size() == 5
    assert allocator.available + cache.total_size() == 16
    # fully present: returns the whole length, owns nothing new
    third = allocator.alloc(2)
    assert third is not None
    assert cache.insert([1, 2], third) == 2
    allocator.free(third)
    assert cache.insert([], []) == 0
    assert allocator.available + cache.total_size() == 16
    cache.check()


def test_insert_diverging_and_ending_inside_node_splits() -> None:
    allocator, cache, _ = make()
    put(cache, allocator, [1, 2, 3, 4])
    put(cache, allocator, [1, 2, 9])
    assert segments(cache) == {(1, 2), (1, 2, 3, 4), (1, 2, 9)}
    slots = allocator.alloc(3)
    assert slots is not None
    assert cache.insert([1, 2, 3], slots) == 3  # ends inside [3, 4]
    allocator.free(slots)
    assert segments(cache) == {(1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 2, 9)}
    assert cache.total_size() == 5
    cache.check()


def test_insert_rejects_length_mismatch() -> None:
    _, cache, _ = make()
    with pytest.raises(ValueError):
        cache.insert([1, 2], [1])


# ---------------------------------------------------------------------- locks


def test_lock_protects_path_and_sizes_follow() -> None:
    allocator, cache, _ = make()
    put(cache, allocator, [1, 2, 3, 4])
    put(cache, allocator, [1, 2, 5, 6, 7])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.node)
    assert (cache.protected_size, cache.evictable_size) == (4, 3)  # [1,2] + [3,4] locked
    cache.inc_lock_ref(m.node)
    assert cache.protected_size == 4
    assert cache.evict(100) == 3  # only [5, 6, 7]
    assert segments(cache) == {(1, 2), (1, 2, 3, 4)}
    cache.dec_lock_ref(m.node)
    assert cache.evict(100) == 0  # still locked once
    cache.dec_lock_ref(m.node)
    assert (cache.protected_size, cache.evictable_size) == (0, 4)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m.node)
    assert cache.evict(1) == 2  # the leaf [3, 4] first
    assert cache.evict(1) == 2  # then [1, 2]
    assert cache.total_size() == 0 and allocator.available == 64
    cache.check()


def test_root_lock_is_a_no_op() -> None:
    _, cache, _ = make()
    cache.inc_lock_ref(cache.root)
    cache.dec_lock_ref(cache.root)
    assert cache.protected_size == 0


def test_lock_handle_survives_a_split_above_it() -> None:
    allocator, cache, _ = make()
    put(cache, allocator, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.inc_lock_ref(m.node)
    assert cache.protected_size == 5
    cache.match_prefix([1, 2])  # splits the locked node
    assert cache.protected_size == 5
    cache.check()
    put(cache, allocator, [1, 2, 8])  # sibling under the split point: unlocked
    assert (cache.protected_size, cache.evictable_size) == (5, 1)
    cache.dec_lock_ref(m.node)
    assert (cache.protected_size, cache.evictable_size) == (0, 6)
    cache.check()


def test_locking_an_evicted_node_is_an_error() -> None:
    allocator, cache, _ = make()
    put(cache, allocator, [1, 2])
    m = cache.match_prefix([1, 2])
    cache.evict(10)
    with pytest.raises(ValueError):
        cache.inc_lock_ref(m.node)


# ---------------------------------------------------------------------- eviction


def test_evicts_least_recently_used_first() -> None:
    allocator, cache, _ = make()
    put(cache, allocator, [1, 1])
    put(cache, allocator, [2, 2])
    put(cache, allocator, [3, 3])
    cache.match_prefix([1, 1])  # now [2,2] is the oldest, then [3,3], then [1,1]
    assert cache.evict(1) == 2
    assert segments(cache) == {(1, 1), (3, 3)}
    assert cache.evict(1) == 2
    assert segments(cache) == {(1, 1)}
    cache.match_prefix([1, 1])
    put(cache, allocator, [4, 4])
    assert cache.evict(3) == 4  # whole nodes: [1,1] then [4,4]
    assert cache.total_size() == 0 and allocator.available == 64
    assert cache.evict(5) == 0


def test_insert_refreshes_lru_and_partial_match_refreshes_only_the_prefix() -> None:
    allocator, cache, _ = make()
    put(cache, allocator, [1, 2, 3])
    put(cache, allocator, [5, 6])
    cache.match_prefix([1, 2, 9])  # touches [1,2] only: [3] keeps its old stamp
    assert cache.evict(1) == 1
    assert segments(cache) == {(1, 2), (5, 6)}
    put(cache, allocator, [5, 6])  # refreshes [5,6]
    assert cache.evict(1) == 2
    assert segments(cache) == {(5, 6)}


def test_eviction_cascades_to_parents_that_become_leaves() -> None:
    allocator, cache, _ = make()
    put(cache, allocator, [1, 2, 3])
    put(cache, allocator, [1, 2, 4])
    put(cache, allocator, [7])
    cache.match_prefix([7])
    assert segments(cache) == {(1, 2), (1, 2, 3), (1, 2, 4), (7,)}
    assert cache.evict(3) == 4  # [3], [4], then the parent [1, 2]
    assert segments(cache) == {(7,)}
    cache.check()


def test_stale_lru_entries_stay_bounded() -> None:
    allocator, cache, _ = make()
    put(cache, allocator, [1, 2, 3])
    for _ in range(10_000):
        cache.match_prefix([1, 2, 3])
    assert len(cache._heap) <= 2048
    cache.check()
    assert cache.evict(1) == 3


# ---------------------------------------------------------------------- reset / disable


def test_reset_frees_everything_and_pool_is_as_at_start_up() -> None:
    fresh = TokenAllocator(64).free_slots()
    allocator, cache, _ = make()
    put(cache, allocator, [1, 2, 3, 4])
    put(cache, allocator, [1, 2, 5])
    put(cache, allocator, [6] * 10)
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(m.node)
    assert cache.reset() == 15
    assert cache.total_size() == cache.evictable_size == cache.protected_size == 0
    assert allocator.available == 64
    assert sorted(allocator.free_slots()) == list(range(1, 65))
    allocator.check()
    allocator.reset()
    assert allocator.free_slots() == fresh
    assert cache.match_prefix([1, 2, 3]).slots == []
    assert cache.evict(10) == 0
    put(cache, allocator, [1, 2, 3])  # usable afterwards
    assert cache.match_prefix([1, 2, 3]).slots == [1, 2, 3]
    cache.check()


def test_disabled_cache_caches_nothing_and_insert_frees() -> None:
    allocator, cache, log = make(capacity=16, events=True, disable=True)
    for _ in range(3):
        m = cache.match_prefix([1, 2, 3])
        assert m.slots == [] and m.node is cache.root
        cache.inc_lock_ref(m.node)
        new = allocator.alloc(4)
        assert new is not None
        slots = m.slots + new
        k = cache.insert([1, 2, 3, 4], slots)
        assert k == 0
        allocator.free(slots[len(m.slots):k])  # the standard pattern frees nothing more
        cache.dec_lock_ref(m.node)
        assert allocator.available == 16  # insert freed all of them
    assert cache.total_size() == cache.evictable_size == cache.protected_size == 0
    assert cache.evict(8) == 0
    assert cache.reset() == 0
    assert log == [["cleared"]]
    allocator.check()


# ---------------------------------------------------------------------- events


def test_path_hash_is_stable() -> None:
    # Pinned: routers may compute it themselves; it must not change between versions.
    assert path_hash([1, 2, 3]) == -5405627362230748553
    assert path_hash((1, 2, 3)) == path_hash(range(1, 4))


def test_events_store_split_evict_clear() -> None:
    allocator, cache, log = make(events=True)
    put(cache, allocator, [1, 2, 3, 4])
    h4 = path_hash([1, 2, 3, 4])
    assert log == [["stored", h4, None, [1, 2, 3, 4]]]
    log.clear()
    put(cache, allocator, [1, 2, 5])  # the match splits [1,2,3,4] at 2, the insert adds [5]
    h2, h5 = path_hash([1, 2]), path_hash([1, 2, 5])
    assert log == [
        ["removed", [h4]],
        ["stored", h2, None, [1, 2]],
        ["stored", h4, h2, [3, 4]],
        ["stored", h5, h2, [5]],
    ]
    log.clear()
    cache.match_prefix([1, 2, 3])  # split of [3, 4]: the lower half keeps its hash
    h3 = path_hash([1, 2, 3])
    assert log == [["removed", [h4]], ["stored", h3, h2, [3]], ["stored", h4, h3, [4]]]
    log.clear()
    cache.match_prefix([1, 2, 5])
    assert cache.evict(2) == 2
    assert log == [["removed", [h4, h3]]]
    log.clear()
    cache.match_prefix([1, 2, 5])  # no split, no event
    assert log == []
    cache.reset()
    assert log == [["cleared"]]


def test_no_event_work_without_callback() -> None:
    allocator, cache, _ = make(events=False)
    put(cache, allocator, [1, 2, 3])
    cache.match_prefix([1, 2])
    assert all(node.block_hash is None for _, node in nodes(cache))


# ---------------------------------------------------------------------- randomized vs model


@dataclass
class ModelReq:
    tokens: list[int]
    slots: list[int]
    matched: int
    node: TreeNode


class Model:
    """Brute force: every cached prefix -> slot and LRU stamp; locks as locked paths."""

    def __init__(self) -> None:
        self.cached: dict[tuple[int, ...], int] = {}
        self.stamp: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.locked: list[tuple[int, ...]] = []

    def match_len(self, seq: list[int]) -> int:
        n = 0
        while n < len(seq) and tuple(seq[: n + 1]) in self.cached:
            n += 1
        return n

    def touch(self, seq: list[int], n: int) -> None:
        self.clock += 1
        for i in range(1, n + 1):
            self.stamp[tuple(seq[:i])] = self.clock

    def match(self, seq: list[int]) -> list[int]:
        n = self.match_len(seq)
        self.touch(seq, n)
        return [self.cached[tuple(seq[: i + 1])] for i in range(n)]

    def insert(self, seq: list[int], slots: list[int]) -> int:
        k = self.match_len(seq)
        for i in range(k, len(seq)):
            self.cached[tuple(seq[: i + 1])] = slots[i]
        self.touch(seq, len(seq))
        return k

    def lock_count(self, prefix: tuple[int, ...]) -> int:
        return sum(1 for p in self.locked if p[: len(prefix)] == prefix and len(p) >= len(prefix))


def run_randomized(seed: int, ops: int, events: bool) -> None:
    rng = random.Random(seed)
    capacity = 48
    allocator, cache, log = make(capacity=capacity, events=events)
    mirror = Mirror()
    model = Model()
    reqs: list[ModelReq] = []
    resumable: list[list[int]] = []
    stems = [[rng.randrange(3) for _ in range(rng.randint(0, 6))] for _ in range(4)]

    def gen_seq() -> list[int]:
        return rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randint(1, 6))]

    def reserve(n: int) -> list[int] | None:
        got = allocator.alloc(n)
        if got is None:
            do_evict(n - allocator.available)
            got = allocator.alloc(n)
        return got

    def do_match(seq: list[int]) -> TreeNode:
        m = cache.match_prefix(seq)
        assert m.slots == model.match(seq)
        assert node_path(m.node) == seq[: len(m.slots)]  # the node covers exactly the match
        return m.node

    def do_evict(n: int) -> None:
        before = dict(model.cached)
        freed = cache.evict(n)
        after = {p: v[0] for p, v in contents(cache).items()}
        gone = set(before) - set(after)
        assert set(after) <= set(before)
        assert freed == len(gone)
        assert freed >= n or cache.evictable_size == 0
        for p in gone:
            assert model.lock_count(p) == 0, "evicted a locked prefix"
        for p in after:
            assert len(p) == 1 or p[:-1] in after, "left a hole in the tree"
        if gone:
            remaining_unlocked = [model.stamp[p] for p in after if model.lock_count(p) == 0]
            assert max(model.stamp[p] for p in gone) <= min(remaining_unlocked, default=10**9)
        for p in gone:
            del model.cached[p]
            del model.stamp[p]

    def finish(req: ModelReq) -> None:
        seq = req.tokens[: len(req.slots)]
        k = cache.insert(seq, req.slots)
        assert k == model.insert(seq, req.slots)
        assert k >= req.matched
        allocator.free(req.slots[req.matched:k])
        cache.dec_lock_ref(req.node)
        model.locked.remove(tuple(req.tokens[: req.matched]))
        reqs.remove(req)
        if rng.random() < 0.5:
            resumable.append(req.tokens)  # retracted: resumes later from its cached prefix

    def verify() -> None:
        tree = contents(cache)
        assert {p: v[0] for p, v in tree.items()} == model.cached
        # LRU stamps: the tree's order is the model's order
        pairs = sorted({(model.stamp[p], v[1]) for p, v in tree.items()})
        for (ma, ta), (mb, tb) in zip(pairs, pairs[1:]):
            assert ma < mb and ta < tb
        protected = 0
        for p, v in tree.items():
            locks = model.lock_count(p)
            assert v[2] == locks
            protected += locks > 0
        assert cache.protected_size == protected
        assert cache.evictable_size == len(tree) - protected
        assert cache.total_size() == len(tree)
        # every slot is owned by exactly one of: free list, tree, a request
        allocator.check()
        free = allocator.free_slots()
        held = [s for r in reqs for s in r.slots[r.matched:]]
        owned = free + list(model.cached.values()) + held
        assert len(owned) == capacity
        assert set(owned) == set(range(1, capacity + 1))
        cache.check()
        if events:
            for event in log:
                mirror.apply(event)
            log.clear()
            assert_mirror_matches(mirror, cache)

    for _ in range(ops):
        op = rng.random()
        if op < 0.25 and len(reqs) < 6:  # admit a request
            prompt = resumable.pop(rng.randrange(len(resumable))) if (
                resumable and rng.random() < 0.5) else gen_seq()
            node = do_match(prompt[:-1])
            cache.inc_lock_ref(node)
            prefix_len = model.match_len(prompt[:-1])
            model.locked.append(tuple(prompt[:prefix_len]))
            tree_slots = [model.cached[tuple(prompt[: i + 1])] for i in range(prefix_len)]
            new = reserve(len(prompt) - prefix_len)
            req = ModelReq(list(prompt), tree_slots, prefix_len, node)
            reqs.append(req)
            if new is None:  # cannot fit now: give up (nothing computed)
                finish(req)
            else:
                req.slots += new
                req.tokens.append(rng.randrange(3))  # sampled
        elif op < 0.55 and reqs:  # a decode step of one request
            req = rng.choice(reqs)
            new = reserve(1)
            if new is None:
                finish(req)  # retract
            else:
                req.slots += new
                req.tokens.append(rng.randrange(3))
        elif op < 0.75 and reqs:  # finish / abort / retract
            finish(rng.choice(reqs))
        elif op < 0.88:  # a bare lookup (splits, touches)
            do_match(gen_seq())
        elif op < 0.98:
            do_evict(rng.randint(1, capacity // 3))
        elif not reqs:
            total = cache.total_size()
            assert cache.reset() == total
            assert allocator.available == capacity
            model.cached.clear()
            model.stamp.clear()
        verify()
    while reqs:
        finish(reqs[0])
        verify()
    assert allocator.available + cache.total_size() == capacity
    assert cache.protected_size == 0


@pytest.mark.parametrize("seed", range(6))
def test_randomized_against_model(seed: int) -> None:
    run_randomized(seed, ops=3000, events=seed % 2 == 0)


# ---------------------------------------------------------------------- scheduler pattern


@dataclass
class SimReq:
    tokens: list[int]
    max_new: int
    generated: int = 0
    slots: list[int] = field(default_factory=list)
    cached: int = 0
    node: TreeNode | None = None


def simulate(disable: bool, seed: int) -> dict[str, int]:
    capacity = 512
    allocator = TokenAllocator(capacity, debug=True)
    mirror = Mirror()
    cache = RadixCache(allocator, on_event=mirror.apply, disable=disable)
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    waiting = deque(
        SimReq(systems[i % 4] + [rng.randrange(50_000) for _ in range(rng.randint(1, 30))],
               max_new=rng.randint(1, 40))
        for i in range(32)
    )
    running: list[SimReq] = []
    stats = {"evicted": 0, "retracted": 0, "hit_tokens": 0, "finished": 0}

    def reserve(n: int) -> list[int] | None:
        got = allocator.alloc(n)
        if got is None:
            stats["evicted"] += cache.evict(n - allocator.available)
            got = allocator.alloc(n)
        return got

    def release(req: SimReq) -> None:
        k = cache.insert(req.tokens[: len(req.slots)], req.slots)
        allocator.free(req.slots[req.cached:k])
        assert req.node is not None
        cache.dec_lock_ref(req.node)
        req.slots, req.node, req.cached = [], None, 0

    def held() -> int:
        return sum(len(r.slots) - r.cached for r in running)

    steps = 0
    while waiting or running:
        steps += 1
        assert steps < 5000, "no progress"
        # admit while memory allows (keep one slot per running request for its decode)
        while waiting and len(running) < 32:
            req = waiting[0]
            m = cache.match_prefix(req.tokens[:-1])
            cache.inc_lock_ref(m.node)
            need = len(req.tokens) - len(m.slots)
            if running and allocator.available + cache.evictable_size - len(running) < need:
                cache.dec_lock_ref(m.node)
                break
            new = reserve(need)
            if new is None:
                cache.dec_lock_ref(m.node)
                break
            waiting.popleft()
            stats["hit_tokens"] += len(m.slots)
            req.slots, req.cached, req.node = m.slots + new, len(m.slots), m.node
            req.tokens.append(rng.randrange(50_000))  # prefill samples a token
            req.generated += 1
            running.append(req)
        # decode
        for req in list(running):
            if req not in running:
                continue  # retracted earlier in this step
            if req.generated >= req.max_new:
                release(req)
                running.remove(req)
                stats["finished"] += 1
                continue
            new = reserve(1)
            while new is None:
                victim = running.pop()  # retract the newest
                release(victim)
                waiting.appendleft(victim)
                stats["retracted"] += 1
                if victim is req:
                    break
                new = reserve(1)
            if new is not None:
                req.slots += new
                req.tokens.append(rng.randrange(50_000))
                req.generated += 1
        allocator.check()
        cache.check()
        assert allocator.available + cache.total_size() + held() == capacity
        assert_mirror_matches(mirror, cache)

    assert stats["finished"] == 32
    assert allocator.available + cache.total_size() == capacity
    assert cache.protected_size == 0
    total = cache.total_size()
    assert cache.reset() == total
    assert allocator.available == capacity
    assert sorted(allocator.free_slots()) == list(range(1, capacity + 1))
    return stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scheduler_pattern_under_memory_pressure(seed: int) -> None:
    stats = simulate(disable=False, seed=seed)
    assert stats["hit_tokens"] > 0
    assert stats["evicted"] > 0
    assert stats["retracted"] > 0


def test_scheduler_pattern_with_cache_disabled() -> None:
    stats = simulate(disable=True, seed=0)
    assert stats["hit_tokens"] == 0 and stats["evicted"] == 0


# ---------------------------------------------------------------------- speed


def test_hot_path_cost_does_not_grow_with_tree_size() -> None:
    allocator = TokenAllocator(200_000)
    cache = RadixCache(allocator)
    rng = random.Random(0)
    system = [rng.randrange(50_000) for _ in range(2000)]
    for _ in range(2000):  # a big tree: 2000 leaves under a long shared prefix
        put(cache, allocator, system + [rng.randrange(50_000) for _ in range(20)])
    start = time.perf_counter()
    for _ in range(200):
        seq = system + [rng.randrange(50_000) for _ in range(20)]
        m = cache.match_prefix(seq[:-1])
        cache.inc_lock_ref(m.node)
        cache.evict(20)
        new = allocator.alloc(len(seq) - len(m.slots))
        assert new is not None
        k = cache.insert(seq, m.slots + new)
        allocator.free((m.slots + new)[len(m.slots):k])
        cache.dec_lock_ref(m.node)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"200 request cycles took {elapsed:.2f}s"
    cache.check()
