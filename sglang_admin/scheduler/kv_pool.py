"""Slot allocator of the KV cache pool.

The pool itself (the key/value tensors) lives in the model runner; the scheduler only
hands out slot indices, so this module is pure Python and never imports torch.
"""

from __future__ import annotations


class TokenAllocator:
    """Free list of KV pool slots 1..capacity.

    Slot 0 is the model's padding slot and is never handed out.

    `alloc` and `free` cost O(number of slots moved). Freed slots are handed out again first
    (LIFO). The free list is not checked for double frees on the hot path: call `check()` in
    tests, or build the allocator with `debug=True` to make `free` reject a slot that is
    already free or out of range (O(len(slots)) extra work per call).
    """

    def __init__(self, capacity: int, debug: bool = False) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity: int = capacity
        self._debug = debug
        self._free: list[int] = []
        self._is_free = bytearray()  # only maintained when debug is on
        # The start-up free list. Entries below the free list's low-water mark since the last
        # reset were never taken, so reset() restores only the ones above it: a FlushCache
        # costs O(slots used), not a millisecond to list 64K slots.
        self._initial: list[int] = list(range(capacity, 0, -1))
        self._low = 0
        self.reset()

    @property
    def available(self) -> int:
        """Number of free slots."""
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free slots; None (and nothing taken) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        free = self._free
        if n > len(free):
            return None
        if n == 0:
            return []
        if n == 1 and not self._debug:  # a decode step's slot, for every running request
            out = [free.pop()]
            if len(free) < self._low:
                self._low = len(free)
            return out
        out = free[-n:]
        del free[-n:]
        if len(free) < self._low:
            self._low = len(free)
        out.reverse()  # a fresh pool hands out 1, 2, 3, ...
        if self._debug:
            for slot in out:
                self._is_free[slot] = 0
        return out

    def free(self, slots: list[int]) -> None:
        """Return slots to the pool. The caller must own them (see `check` for double frees)."""
        if self._debug:
            self._debug_mark_free(slots)
        self._free.extend(slots)

    def _debug_mark_free(self, slots: list[int]) -> None:
        """Mark slots free in the debug bitmap; on a bad slot undo the marks and raise."""
        is_free = self._is_free
        for i, slot in enumerate(slots):
            error = None
            if not 1 <= slot <= self.capacity:
                error = f"slot {slot} is outside the pool 1..{self.capacity}"
            elif is_free[slot]:
                error = f"double free of slot {slot}"
            if error is not None:
                for done in slots[:i]:
                    is_free[done] = 0
                raise ValueError(error)
            is_free[slot] = 1

    def reset(self) -> None:
        """Free every slot: the allocator is exactly as it was at start-up."""
        low = self._low
        del self._free[low:]
        self._free.extend(self._initial[low:])
        self._low = self.capacity
        if self._debug:
            self._is_free = bytearray(b"\x00" + b"\x01" * self.capacity)

    def free_slots(self) -> list[int]:
        """A copy of the free list (debugging and tests)."""
        return list(self._free)

    def check(self) -> None:
        """Debug check, O(capacity): raise RuntimeError if a slot is free twice or out of range."""
        seen = bytearray(self.capacity + 1)
        for slot in self._free:
            if not 1 <= slot <= self.capacity:
                raise RuntimeError(f"free list holds slot {slot} outside 1..{self.capacity}")
            if seen[slot]:
                raise RuntimeError(f"slot {slot} is on the free list twice (double free)")
            seen[slot] = 1
