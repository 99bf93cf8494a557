"""TokenAllocator: the KV pool's slot free list."""

from __future__ import annotations

import random

import pytest

from sglang_admin.scheduler.kv_pool import TokenAllocator


def test_fresh_pool_hands_out_1_to_capacity_never_0() -> None:
    a = TokenAllocator(8)
    assert a.capacity == 8
    assert a.available == 8
    assert a.alloc(3) == [1, 2, 3]
    assert a.available == 5
    rest = a.alloc(5)
    assert rest is not None and sorted(rest) == [4, 5, 6, 7, 8]
    assert a.available == 0
    assert a.alloc(1) is None
    assert a.alloc(0) == []


def test_alloc_failure_takes_nothing() -> None:
    a = TokenAllocator(4)
    assert a.alloc(2) is not None
    before = a.free_slots()
    assert a.alloc(3) is None
    assert a.free_slots() == before
    assert a.available == 2


def test_free_then_reuse() -> None:
    a = TokenAllocator(4)
    s = a.alloc(4)
    assert s is not None
    a.free(s[1:3])
    assert a.available == 2
    again = a.alloc(2)
    assert again is not None and sorted(again) == sorted(s[1:3])
    a.free([])
    assert a.available == 0


def test_negative_alloc_and_capacity_rejected() -> None:
    with pytest.raises(ValueError):
        TokenAllocator(-1)
    with pytest.raises(ValueError):
        TokenAllocator(4).alloc(-1)


def test_zero_capacity() -> None:
    a = TokenAllocator(0)
    assert a.available == 0
    assert a.alloc(0) == []
    assert a.alloc(1) is None
    a.check()


def test_reset_is_exactly_start_up_state() -> None:
    fresh = TokenAllocator(32).free_slots()
    a = TokenAllocator(32)
    rng = random.Random(0)
    held: list[int] = []
    for _ in range(200):
        if held and rng.random() < 0.5:
            k = rng.randint(1, len(held))
            a.free(held[:k])
            del held[:k]
        else:
            s = a.alloc(rng.randint(0, 5))
            if s is not None:
                held += s
    a.reset()
    assert a.available == 32
    assert a.free_slots() == fresh
    assert a.alloc(32) == list(range(1, 33))


def test_check_detects_double_free() -> None:
    a = TokenAllocator(4)
    s = a.alloc(2)
    assert s is not None
    a.free(s)
    a.check()
    a.free(s[:1])  # not checked on the hot path...
    with pytest.raises(RuntimeError, match="double free"):
        a.check()  # ...but caught by the debug check


def test_check_detects_out_of_range_slot() -> None:
    a = TokenAllocator(4)
    a.alloc(4)
    a.free([0])
    with pytest.raises(RuntimeError, match="outside"):
        a.check()


def test_debug_mode_rejects_double_free_and_bad_slots_at_the_call() -> None:
    a = TokenAllocator(4, debug=True)
    s = a.alloc(3)
    assert s == [1, 2, 3]
    a.free([2])
    with pytest.raises(ValueError, match="double free of slot 2"):
        a.free([2])
    with pytest.raises(ValueError, match="double free of slot 4"):
        a.free([4])  # never allocated
    with pytest.raises(ValueError, match="outside"):
        a.free([0])
    with pytest.raises(ValueError, match="outside"):
        a.free([5])
    a.free([1, 3])
    assert a.available == 4
    a.check()
    a.reset()
    assert a.alloc(4) == [1, 2, 3, 4]
    a.free([1, 2, 3, 4])


def test_debug_mode_rejected_free_changes_nothing() -> None:
    a = TokenAllocator(4, debug=True)
    s = a.alloc(3)
    assert s == [1, 2, 3]
    with pytest.raises(ValueError, match="double free of slot 3"):
        a.free([1, 3, 3])  # the same slot twice in one call
    assert a.available == 1
    a.free([1, 3])  # the failed call marked nothing free
    a.free([2])
    assert a.available == 4
    a.check()
