"""The rank's LoRA bookkeeping without a model: slots, users, LRU eviction, waiting unloads,
and the adapter-keyed prefix cache of the scheduler."""

from __future__ import annotations

import pytest

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.scheduler.kv_pool import TokenAllocator
from sglang_admin.scheduler.lora_registry import (
    LoraRegistry,
    LoraUnavailable,
    PinRefused,
    cache_key,
)
from sglang_admin.scheduler.radix_cache import RadixCache
from sglang_admin.server.kv_blocks import RankBlockIndex
from tests.unit.test_scheduler import assert_no_leak, drive, make, req


def _registry(slots: int = 2) -> tuple[LoraRegistry, list[int]]:
    freed: list[int] = []
    return LoraRegistry(slots, lambda a: freed.append(a.slot)), freed


def _load(reg: LoraRegistry, lora_id: str, pinned: bool = False) -> None:
    slot, evict = reg.plan_load(lora_id, lora_id, pinned)
    reg.evict(evict)
    reg.add(lora_id, lora_id, f"/{lora_id}", pinned, slot)


def test_lru_eviction_spares_pinned_and_busy_adapters() -> None:
    reg, freed = _registry()
    _load(reg, "a")
    _load(reg, "b")
    reg.release(reg.acquire("a").lora_id)  # a used after b: b is the least recently used
    slot, evict = reg.plan_load("c", "c")
    assert [a.lora_id for a in evict] == ["b"] and slot == reg.find("b").slot
    reg.evict(evict)
    reg.add("c", "c", "/c", False, slot)
    assert freed == [slot]
    reg.acquire("a")  # busy
    reg.find("c").pinned = True
    with pytest.raises(ValueError, match="pinned or in-use"):
        reg.plan_load("d", "d")
    with pytest.raises(ValueError, match="already loaded"):
        reg.plan_load("a", "other")


def test_unload_waits_for_the_last_user_and_refuses_new_ones() -> None:
    reg, freed = _registry()
    _load(reg, "a")
    reg.acquire("a")
    reg.acquire("a")
    done = reg.unload(reg.find("a"))
    assert not done.done()
    with pytest.raises(LoraUnavailable, match="being unloaded"):
        reg.acquire("a")
    reg.release("a")
    assert not done.done() and reg.find("a") is not None
    reg.release("a")
    assert done.done() and reg.find("a") is None and freed == [0]
    with pytest.raises(LoraUnavailable, match="not loaded"):
        reg.acquire("a")


def test_reloaded_adapter_gets_a_new_cache_namespace() -> None:
    reg, _ = _registry()
    _load(reg, "a")
    first = reg.find("a").namespace
    reg.unload(reg.find("a"))
    _load(reg, "a")
    assert reg.find("a").namespace != first
    assert cache_key([1, 2], 0) == [1, 2]
    assert cache_key([1, 2], 3) != cache_key([1, 2], 4)


def test_scheduler_shares_prefixes_within_an_adapter_only() -> None:
    sched, runner = make()
    reg, _ = _registry()
    sched.lora = reg
    _load(reg, "a")
    _load(reg, "b")
    prompt = list(range(10, 40))
    cached = {}
    for rid, lora in (("a1", "a"), ("b1", "b"), ("base", ""), ("a2", "a")):
        sched.add_request(req(rid, prompt, 3, lora_id=lora))
        cached[rid] = drive(sched, runner)["finals"][rid].cached_tokens
    assert cached == {"a1": 0, "b1": 0, "base": 0, "a2": len(prompt) - 1}
    assert all(a.users == 0 for a in reg.adapters())  # every request released its adapter
    assert_no_leak(sched)
    sched.add_request(req("x", prompt, 1, lora_id="zzz"))
    final = drive(sched, runner)["finals"]["x"]
    assert final.error_code == "INVALID_ARGUMENT" and "not loaded" in final.error


def test_kv_events_carry_the_adapter_and_plain_tokens() -> None:
    events: list = []
    cache = RadixCache(TokenAllocator(64), on_event=events.append)
    tokens = list(range(1, 9))
    cache.insert(cache_key(tokens, 5), list(range(1, 9)))
    cache.insert(tokens, list(range(9, 17)))
    index = RankBlockIndex(block_size=4)
    stored = [e.stored for e in index.apply(events) if e.HasField("stored")]
    blocks = [b for s in stored for b in s.blocks]
    assert [list(b.token_ids) for b in blocks] == [[1, 2, 3, 4], [5, 6, 7, 8]] * 2
    assert [b.lora_id if b.HasField("lora_id") else None for b in blocks] == [5, 5, None, None]
    assert len({b.block_hash for b in blocks}) == 4  # same tokens, different blocks


def test_parallel_samples_each_hold_the_adapter_and_share_its_prefix() -> None:
    sched, runner = make()
    reg, _ = _registry(slots=1)
    sched.lora = reg
    _load(reg, "a")
    prompt = list(range(50, 80))
    sched.add_request(GenerateReq("r", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True),
                                  lora_id="a", n=3))
    assert reg.find("a").users == 3  # an unload waits for every sample
    finals: list = []
    for _ in range(1000):
        batch = sched.schedule()
        outs = sched.take_outputs()
        if batch is not None:
            outs += sched.postprocess(batch, runner.run(batch))
        finals += [o for o in outs if o.finish_reason is not None]
        if batch is None and sched.is_idle:
            break
    assert sorted(o.index for o in finals) == [0, 1, 2]
    # the forks matched sample 0's prompt under the same adapter
    assert sorted(o.cached_tokens for o in finals) == [0, len(prompt) - 1, len(prompt) - 1]
    assert reg.find("a").users == 0
    assert_no_leak(sched)
    # an adapter that is not loaded refuses the request once, holding nothing
    sched.add_request(GenerateReq("x", prompt, SamplingParams(max_new_tokens=2), lora_id="zzz",
                                  n=2))
    assert [o.error_code for o in sched.take_outputs()] == ["INVALID_ARGUMENT"]
    assert reg.find("a").users == 0 and sched.is_idle



def test_pinning_is_refused_when_it_would_leave_no_unpinned_slot() -> None:
    """SGLang's rule: pinned adapters may take every slot but one, so unpinned adapters (and
    requests of the base model mixed with them) never starve."""
    reg, _ = _registry(slots=3)
    _load(reg, "p1", pinned=True)
    _load(reg, "u", pinned=False)
    _load(reg, "p2", pinned=True)  # two of three slots pinned: one left for unpinned ones
    with pytest.raises(PinRefused) as err:
        reg.plan_load("p3", "p3", pinned=True)
    assert "It is not allowed to pin all slots" in str(err.value)
    assert "starvation" in str(err.value) and "--max-loaded-loras" in str(err.value)
    assert sorted(a.lora_id for a in reg.adapters()) == ["p1", "p2", "u"]  # nothing moved
    slot, evict = reg.plan_load("u2", "u2")  # unpinned: takes the unpinned one's turn
    assert [a.lora_id for a in evict] == ["u"] and slot == reg.find("u").slot
    one, _ = _registry(slots=1)
    with pytest.raises(PinRefused):  # one slot: nothing may be pinned
        one.plan_load("p", "p", pinned=True)
