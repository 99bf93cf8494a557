"""The KV memory of a rank's requests: match and lock a cached prefix, reserve slots for
a step, share a prefilled prefix, hand a request's KV to the radix cache when it ends."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang_admin.scheduler.embedding import reusable_prefix
from sglang_admin.scheduler.kv_pool import TokenAllocator
from sglang_admin.scheduler.lora_registry import cache_key
from sglang_admin.scheduler.radix_cache import RadixCache

if TYPE_CHECKING:
    from sglang_admin.scheduler.request import Req


class RequestMemory:
    """The slot pool, the radix cache over it and the rows of the request-to-token table."""

    def __init__(
        self, token_capacity: int, rows: int, disable_cache: bool = False,
        on_kv_event: Callable[[Any], None] | None = None, pools_every_token: bool = False,
    ) -> None:
        self.rows = rows
        self.pools_every_token = pools_every_token  # an embedding model pooling CLS or MEAN
        self.allocator = TokenAllocator(token_capacity)
        self.cache = RadixCache(self.allocator, on_event=on_kv_event, disable=disable_cache)
        self.free_rows: list[int] = list(range(rows - 1, -1, -1))

    @property
    def used_tokens(self) -> int:
        """Slots held by requests: the pool less what is free and what the cache may evict."""
        return self.allocator.capacity - self.allocator.available - self.cache.evictable_size

    def admit(self, req: Req, headroom: int, may_wait: bool) -> bool:
        """Match the request's cached prefix, lock it and give the request a table row;
        False when no row is free, or when its uncached tokens do not fit beside
        ``headroom`` slots and it ``may_wait`` for running requests to free memory."""
        seq = req.fill_ids
        match = self.cache.match_prefix(cache_key(seq[:-1], req.lora.namespace))
        reuse = reusable_prefix(req.embed, len(match.slots), self.pools_every_token)
        start = req.logprob.logprob_start_len
        if start >= 0 and not req.output_ids:
            # prompt logprobs need the logits from position logprob_start_len - 1 on
            reuse = min(reuse, max(start - 1, 0))
        need = len(seq) - reuse
        fits = self.allocator.available + self.cache.evictable_size - headroom >= need
        if (not fits and may_wait) or not self.free_rows:
            return False
        self.cache.inc_lock_ref(match.node)
        req.last_node = match.node
        req.slots = list(match.slots[:reuse])
        req.kv_len = req.cached_len = reuse
        req.req_idx = self.free_rows.pop()
        req.table_synced = 0
        return True

    def reserve(self, req: Req, n: int) -> bool:
        """Allocate KV slots for the request's next n tokens, evicting cache if needed."""
        slots = self.allocator.alloc(n)
        if slots is None:
            self.cache.evict(n - self.allocator.available)
            slots = self.allocator.alloc(n)
            if slots is None:
                return False
        req.slots.extend(slots)
        return True

    def release(self, req: Req, keep: bool = True) -> None:
        """Hand the computed KV to the radix cache (``keep``; else free it, as SGLang's
        ``release_kv_cache(is_insert=False)``), free the rest, unlock, free the row. What
        the tree held before (the prefix the request matched or shared) stays cached."""
        kv = req.kv_len
        computed = req.slots[:kv]
        if self.cache.disable or not keep:
            self.allocator.free(req.slots[req.cached_len :])
        else:
            already = self.cache.insert(cache_key(req.fill_ids[:kv], req.lora.namespace),
                                        computed)
            if already > req.cached_len:
                self.allocator.free(computed[req.cached_len : already])
            self.allocator.free(req.slots[kv:])  # reserved but never computed
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
            req.last_node = None
        self.free_rows.append(req.req_idx)
        req.req_idx = -1
        req.slots = []
        req.cached_len = req.kv_len = req.table_synced = 0

    def share_prefilled(self, req: Req) -> None:
        """Share a prefilled prefix at once (as SGLang's cache_unfinished_req): insert the
        computed KV into the tree, adopt the tree's slots and move the lock down to it, so
        requests admitted in later steps reuse it while this one still runs."""
        if self.cache.disable:
            return
        kv = req.kv_len
        seq = cache_key(req.fill_ids[:kv], req.lora.namespace)
        already = self.cache.insert(seq, req.slots[:kv])
        if already > req.cached_len:
            # Someone inserted part of this prefix meanwhile: free our duplicate slots and
            # use the tree's (same tokens at the same positions, so the same KV).
            self.allocator.free(req.slots[req.cached_len : already])
        match = self.cache.match_prefix(seq)
        self.cache.inc_lock_ref(match.node)
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        req.last_node = match.node
        if already > req.cached_len:
            req.table_synced = min(req.table_synced, req.cached_len)
        req.slots[:kv] = match.slots
        req.cached_len = kv

    def reset(self) -> int:
        """Empty the radix cache and the pool, free every row; tokens freed. Nothing may
        hold KV."""
        freed = self.cache.reset()
        self.allocator.reset()
        self.free_rows = list(range(self.rows - 1, -1, -1))
        return freed
