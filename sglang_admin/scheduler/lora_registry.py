"""Which LoRA adapters a rank holds, who uses them, and which one to evict (no torch here).

Every loaded adapter owns one of ``--max-loaded-loras`` slots of the model's stacked
buffers, and a *cache namespace*: a number, new at every load, that the scheduler mixes
into the radix cache keys (:func:`cache_key`), so the same tokens under two adapters (or
under an adapter unloaded and loaded again with other weights) never share KV.

A request acquires its adapter when it is queued and releases it when it ends. An adapter
in use is never evicted; an unload of it waits (new requests for it are refused meanwhile)
and completes when its last user ends. Loading into a full registry evicts the least
recently used adapter that is neither pinned nor in use. As in SGLang, pinned adapters may
take every slot but one, so unpinned adapters always have a slot to take turns in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from sglang_admin.constants import LORA_NAMESPACE_SHIFT


def cache_key(tokens: list[int], namespace: int) -> list[int]:
    """The radix cache key of a token sequence under a namespace (0: the base model)."""
    if not namespace:
        return tokens
    high = namespace << LORA_NAMESPACE_SHIFT
    return [t | high for t in tokens]


class PinRefused(ValueError):
    """A pinned load that would leave no slot for unpinned adapters (SGLang's starvation rule)."""


class LoraUnavailable(Exception):
    """A request names an adapter this rank cannot run it with (the message says why)."""


@dataclass
class Adapter:
    """One loaded adapter."""

    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool
    slot: int
    namespace: int
    users: int = 0
    last_used: int = 0
    unloading: list[Future] = field(default_factory=list)  # unloads waiting for the users


class LoraRegistry:
    """Slots, users and LRU order of one rank's adapters."""

    def __init__(self, slots: int, on_free: Callable[[Adapter], None]) -> None:
        self.slots = slots
        self.on_free = on_free  # called when an adapter leaves (its slot may be zeroed)
        self.by_id: dict[str, Adapter] = {}
        self._clock = itertools.count(1)
        self._namespaces = itertools.count(1)

    # ------------------------------------------------------------------ lookups

    def find(self, lora_id: str = "", lora_name: str = "") -> Adapter | None:
        """The adapter with that id (or, without an id, the one with that name)."""
        if lora_id:
            return self.by_id.get(lora_id)
        return next((a for a in self.by_id.values() if a.lora_name == lora_name), None)

    def adapters(self) -> list[Adapter]:
        """Loaded adapters in load order."""
        return list(self.by_id.values())

    @property
    def used(self) -> int:
        return len(self.by_id)

    @property
    def pinned(self) -> int:
        """How many loaded adapters are pinned."""
        return sum(1 for a in self.by_id.values() if a.pinned)

    # ------------------------------------------------------------------ requests

    def acquire(self, lora_id: str) -> Adapter:
        """A request starts using the adapter; raises LoraUnavailable."""
        adapter = self.by_id.get(lora_id)
        if adapter is None:
            raise LoraUnavailable(f"lora_id {lora_id!r} is not loaded")
        if adapter.unloading:
            raise LoraUnavailable(f"lora_id {lora_id!r} is being unloaded")
        adapter.users += 1
        adapter.last_used = next(self._clock)
        return adapter

    def release(self, lora_id: str) -> None:
        """A request that used the adapter ended; a waiting unload completes at zero users."""
        adapter = self.by_id.get(lora_id)
        if adapter is None:
            return
        adapter.users = max(0, adapter.users - 1)
        if adapter.users == 0 and adapter.unloading:
            self._remove(adapter)
            for fut in adapter.unloading:
                fut.set_result(adapter)

    # ------------------------------------------------------------------ load / unload

    def plan_load(self, lora_id: str, lora_name: str, pinned: bool = False
                  ) -> tuple[int, list[Adapter]]:
        """The slot a new adapter goes to and the adapters to evict first (in LRU order).

        Raises ValueError when the id or name is taken, when every slot holds a pinned
        or busy adapter, and :class:`PinRefused` when a pinned adapter would leave no slot
        for unpinned ones.
        """
        if lora_id in self.by_id:
            raise ValueError(f"lora_id {lora_id!r} is already loaded")
        if any(a.lora_name == lora_name for a in self.by_id.values()):
            raise ValueError(f"an adapter named {lora_name!r} is already loaded")
        if pinned and self.pinned + 1 >= self.slots:
            raise PinRefused(
                f"Failed to load LoRA adapter {lora_name} as a pinned adapter. It is not "
                "allowed to pin all slots in the LoRA memory pool to avoid starvation for "
                "unpinned adapters and base models. Please increase your `--max-loaded-loras` "
                "or load it as unpinned LoRA adapters."
                f" ({self.pinned} of {self.slots} slots hold pinned adapters)"
            )
        taken = {a.slot for a in self.by_id.values()}
        free = [s for s in range(self.slots) if s not in taken]
        if free:
            return free[0], []
        candidates = sorted(
            (a for a in self.by_id.values() if not a.pinned and not a.users and not a.unloading),
            key=lambda a: a.last_used,
        )
        if not candidates:
            raise ValueError(
                f"all {self.slots} LoRA slots (--max-loaded-loras) hold pinned or in-use "
                "adapters; unload one first"
            )
        return candidates[0].slot, candidates[:1]

    def evict(self, adapters: Sequence[Adapter]) -> None:
        for adapter in adapters:
            self._remove(adapter)

    def add(self, lora_id: str, lora_name: str, lora_path: str, pinned: bool, slot: int
            ) -> Adapter:
        """Record an adapter written into `slot`; it counts as just used."""
        adapter = Adapter(lora_id, lora_name, lora_path, pinned, slot,
                          next(self._namespaces), last_used=next(self._clock))
        self.by_id[lora_id] = adapter
        return adapter

    def unload(self, adapter: Adapter) -> Future:
        """Resolves (to the adapter) once it is unloaded: now when unused, else at its last
        user's end. New requests for it are refused from now on."""
        fut: Future = Future()
        if adapter.users == 0 and not adapter.unloading:
            self._remove(adapter)
            fut.set_result(adapter)
        else:
            adapter.unloading.append(fut)
        return fut

    def _remove(self, adapter: Adapter) -> None:
        if self.by_id.get(adapter.lora_id) is adapter:
            del self.by_id[adapter.lora_id]
            self.on_free(adapter)
