"""Radix tree prefix cache over token ids (page size 1), modelled on SGLang's RadixCache.

Each node holds a segment of tokens (`key`) and the KV pool slots that hold their KV
(`value`, same length). A node's full token path is the concatenation of the keys from the
root down to it. The tree owns the slots of every node and frees them through the
allocator on eviction and reset.

Locks: `inc_lock_ref(node)` adds one to the lock count of node and of every ancestor, so a
node's `lock_ref` is the number of locks held on it or below it; a node with lock_ref > 0
is "protected" and never evicted.

LRU: a logical clock ticks once per `match_prefix`/`insert` call and stamps every node of
the touched path. A parent is therefore never older than its children, and evicting the
oldest unlocked leaf first (cascading to parents that become leaves) evicts in LRU order.
Evictable leaves sit in a lazy heap (stale entries are skipped when popped and compacted
away now and then), so no call walks the whole tree except `reset` and `check`.

Events (only when `on_event` is set; nothing is computed otherwise), for a router that
mirrors the cache:

- ``["stored", block_hash, parent_block_hash_or_None, token_ids]``: a node segment was
  added; `token_ids` is the segment (the node's key), the parent is None for a child of
  the root.
- ``["removed", [block_hash, ...]]``: segments were evicted (one event per `evict` call).
- ``["cleared"]``: `reset` emptied the tree.

`block_hash` is `path_hash(full token path of the node)`: a signed int64 that depends only
on the tokens from the root to the end of the segment, not on how the path is cut into
segments. When a node is split (a match or insert ends inside it) the cache emits
``["removed", [h]]`` for the old segment, then ``["stored", h_upper, parent, upper_tokens]``
and ``["stored", h, h_upper, lower_tokens]``: the lower half keeps the old hash (same path
end), so the children of the old node keep a valid parent hash.

Token lists passed in events are never mutated by the cache afterwards; the receiver must
not mutate them either.
"""

from __future__ import annotations

import hashlib
import heapq
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_admin.scheduler.kv_pool import TokenAllocator

EventCallback = Callable[[list], None]

# The lazy heap is compacted when it grows past max(_MIN_HEAP_LIMIT, 2 * live entries).
_MIN_HEAP_LIMIT = 1024


def path_hash(token_path: Sequence[int]) -> int:
    """Stable block hash of a full token path: blake2b-64 of its little-endian int64 encoding.

    Returned as a signed int64. The same on every machine and Python version.
    """
    data = array("q", token_path)
    if sys.byteorder != "little":
        data.byteswap()
    digest = hashlib.blake2b(data.tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class TreeNode:
    """One segment of the radix tree; outside this module, an opaque lock handle."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "block_hash")

    def __init__(
        self, key: list[int], value: list[int], parent: TreeNode | None, last_access: int
    ) -> None:
        self.children: dict[int, TreeNode] = {}  # first token of the child's key -> child
        self.parent = parent  # None for the root and for nodes removed from the tree
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = last_access
        self.block_hash: int | None = None  # set only when events are on

    def __repr__(self) -> str:
        return (
            f"TreeNode(key={self.key!r}, value={self.value!r}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access})"
        )


@dataclass
class MatchResult:
    """Result of `RadixCache.match_prefix`."""

    slots: list[int]  # slots of the longest cached prefix (a fresh list the caller may keep)
    node: TreeNode  # deepest node of that prefix (root when nothing matched); lock it while used


def _common_prefix_len(key: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]`."""
    n = min(len(key), len(tokens) - start)
    if n == len(key):
        if tokens[start : start + n] == key:  # whole segment matches: compared in C
            return n
    elif tokens[start:] == key[:n]:
        return n
    for i in range(1, n):  # key[0] == tokens[start]: that is how the child was found
        if key[i] != tokens[start + i]:
            return i
    return n


class RadixCache:
    """Prefix cache of KV slots keyed by token ids.

    Usage by the scheduler:

    - admit request with prompt P: ``m = cache.match_prefix(P[:-1])``,
      ``cache.inc_lock_ref(m.node)`` (before anything can evict), allocate slots for
      ``P[len(m.slots):]``; the request's slots are ``S = m.slots + new``.
    - finish / abort / retract with KV for tokens T in slots S: ``k = cache.insert(T, S)``,
      ``allocator.free(S[len(m.slots):k])``, ``cache.dec_lock_ref(m.node)``.
    - when ``allocator.alloc`` fails: ``cache.evict(n)`` and retry.

    With ``disable=True`` nothing is ever cached: `match_prefix` returns no slots and the
    root, locks on the root are no-ops, and `insert` frees every slot it is given and
    returns 0, so the same caller pattern frees nothing more and leaks nothing. (A caller
    that checks ``cache.disable`` and frees the slots itself without calling `insert`
    is equally correct.)
    """

    def __init__(
        self,
        allocator: TokenAllocator,
        on_event: EventCallback | None = None,
        disable: bool = False,
    ) -> None:
        self.allocator = allocator
        self.on_event = on_event
        self.disable = disable
        self._root = TreeNode([], [], None, 0)
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._heap: list[tuple[int, int, TreeNode]] = []  # (last_access, seq, leaf)
        self._heap_seq = 0
        self._heap_limit = _MIN_HEAP_LIMIT

    # ------------------------------------------------------------------ sizes

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    def total_size(self) -> int:
        """All tokens (= slots) the tree owns."""
        return self._evictable + self._protected

    @property
    def root(self) -> TreeNode:
        """The root node (empty key; locking it is a no-op)."""
        return self._root

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `token_ids`, with its slots and deepest node.

        Splits the node in which the match ends, so `node` covers exactly the matched
        prefix, and stamps the matched path as most recently used. O(matched length).
        """
        root = self._root
        if self.disable or not token_ids:
            return MatchResult([], root)
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        self._clock += 1
        now = self._clock
        node = root
        slots: list[int] = []
        pos = 0
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            m = _common_prefix_len(child.key, tokens, pos)
            if m < len(child.key):
                child = self._split(child, m, tokens, pos + m)
            child.last_access = now
            slots += child.value
            node = child
            pos += m
        if node is not root and not node.children and node.lock_ref == 0:
            self._push(node)
        return MatchResult(slots, node)

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Cache `token_ids` whose KV sits in `slots` (same length); returns k, the length of
        the prefix that was already cached before this call.

        The tree takes ownership of ``slots[k:]``. The caller keeps ``slots[:k]``: those that
        are the tree's own (the prefix it matched and locked) it just forgets, the others
        duplicate KV the tree already holds and the caller frees them. Stamps the path as
        most recently used. O(len(token_ids)).

        When disabled: frees all `slots` and returns 0.
        """
        n = len(token_ids)
        if len(slots) != n:
            raise ValueError(f"insert: {n} tokens but {len(slots)} slots")
        if self.disable:
            if n:
                self.allocator.free(list(slots))
            return 0
        if n == 0:
            return 0
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        self._clock += 1
        now = self._clock
        node = self._root
        pos = 0
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                value = slots[pos:]
                if not isinstance(value, list):
                    value = list(value)
                leaf = TreeNode(tokens[pos:], value, node, now)
                node.children[tokens[pos]] = leaf
                self._evictable += n - pos
                self._push(leaf)
                if self.on_event is not None:
                    leaf.block_hash = path_hash(tokens)
                    self.on_event(["stored", leaf.block_hash, node.block_hash, leaf.key])
                return pos
            m = _common_prefix_len(child.key, tokens, pos)
            if m < len(child.key):
                child = self._split(child, m, tokens, pos + m)
            child.last_access = now
            node = child
            pos += m
        if not node.children and node.lock_ref == 0:
            self._push(node)
        return n

    def _split(self, child: TreeNode, m: int, tokens: list[int], end: int) -> TreeNode:
        """Cut `child` after its first m tokens; returns the new upper node.

        The lower half stays the same object (a lock handle on it stays valid) and keeps
        its hash; the upper node inherits lock_ref and last_access, so sizes don't change.
        `tokens[:end]` is the full path of the upper node.
        """
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:m], child.value[:m], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        child.key = child.key[m:]
        child.value = child.value[m:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        if self.on_event is not None:
            upper.block_hash = path_hash(tokens[:end])
            self.on_event(["removed", [child.block_hash]])
            self.on_event(["stored", upper.block_hash, parent.block_hash, upper.key])
            self.on_event(["stored", child.block_hash, upper.block_hash, child.key])
        return upper

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect root..node from eviction (reference counted). O(depth)."""
        root = self._root
        if node.parent is None and node is not root:
            raise ValueError("inc_lock_ref on a node that is no longer in the cache")
        while node is not root:
            if node.lock_ref == 0:
                size = len(node.key)
                self._evictable -= size
                self._protected += size
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`. O(depth)."""
        root = self._root
        start = node
        while node is not root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref without a matching inc_lock_ref")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                size = len(node.key)
                self._protected -= size
                self._evictable += size
            node = node.parent  # type: ignore[assignment]
        if start is not root and not start.children and start.lock_ref == 0:
            self._push(start)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves (cascading to parents that become
        leaves) until at least `num_tokens` slots are freed or nothing is evictable.

        Whole nodes are freed, so the result may exceed `num_tokens`. Returns slots freed.
        O(freed nodes * log heap).
        """
        if num_tokens <= 0 or self.disable:
            return 0
        root = self._root
        heap = self._heap
        free = self.allocator.free
        events = self.on_event is not None
        removed: list[int] = []
        freed = 0
        while freed < num_tokens and heap:
            stamp, _, node = heapq.heappop(heap)
            parent = node.parent
            if parent is None or node.children or node.lock_ref or node.last_access != stamp:
                continue  # stale entry
            free(node.value)
            freed += len(node.value)
            del parent.children[node.key[0]]
            node.parent = None
            if events:
                removed.append(node.block_hash)  # type: ignore[arg-type]
            if parent is not root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        self._evictable -= freed
        if removed:
            self.on_event(["removed", removed])  # type: ignore[misc]
        return freed

    def _push(self, node: TreeNode) -> None:
        """Record `node` as a candidate evictable leaf at its current access time."""
        self._heap_seq += 1
        heapq.heappush(self._heap, (node.last_access, self._heap_seq, node))
        if len(self._heap) > self._heap_limit:
            self._compact_heap()

    def _compact_heap(self) -> None:
        """Drop stale and duplicate heap entries (amortised O(1) per push)."""
        live: dict[int, tuple[int, int, TreeNode]] = {}
        for entry in self._heap:
            stamp, _, node = entry
            if (node.parent is not None and not node.children and node.lock_ref == 0
                    and node.last_access == stamp):
                live[id(node)] = entry
        self._heap[:] = live.values()  # in place: evict() may hold a reference
        heapq.heapify(self._heap)
        self._heap_limit = max(_MIN_HEAP_LIMIT, 2 * len(self._heap))

    # ------------------------------------------------------------------ reset / debug

    def reset(self) -> int:
        """Free every slot the tree owns and empty it; returns slots freed.

        Only valid when no lock is held (raises RuntimeError otherwise). Emits ["cleared"].
        """
        if self._protected:
            raise RuntimeError("reset while requests hold locks on the cache")
        freed: list[int] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            freed += node.value
            node.parent = None
            stack.extend(node.children.values())
        self._root.children = {}
        self._heap.clear()
        self._heap_limit = _MIN_HEAP_LIMIT
        self._evictable = 0
        if freed:
            self.allocator.free(freed)
        if self.on_event is not None:
            self.on_event(["cleared"])
        return len(freed)

    def check(self) -> None:
        """Debug check of every invariant, O(tree + heap); raises RuntimeError on a violation."""

        def fail(msg: str) -> None:
            raise RuntimeError(f"radix cache invariant: {msg}")

        evictable = protected = 0
        owned: set[int] = set()
        leaves: list[TreeNode] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                if child.parent is not node:
                    fail(f"bad parent pointer at {child!r}")
                if not child.key or child.key[0] != first:
                    fail(f"child keyed by {first} has key {child.key!r}")
                if len(child.key) != len(child.value):
                    fail(f"key/value lengths differ at {child!r}")
                if node is not self._root and child.last_access > node.last_access:
                    fail(f"child newer than parent at {child!r}")
                child_locks += child.lock_ref
                stack.append(child)
            if node is self._root:
                continue
            if node.lock_ref < child_locks:
                fail(f"lock_ref below the children's at {node!r}")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.append(node)
            for slot in node.value:
                if slot in owned or not 1 <= slot <= self.allocator.capacity:
                    fail(f"slot {slot} owned twice or out of range")
                owned.add(slot)
        if (evictable, protected) != (self._evictable, self._protected):
            fail(f"sizes {(self._evictable, self._protected)} != {(evictable, protected)}")
        in_heap = {id(node) for stamp, _, node in self._heap if node.last_access == stamp}
        for leaf in leaves:
            if id(leaf) not in in_heap:
                fail(f"evictable leaf missing from the LRU heap: {leaf!r}")
