"""Release and resume misuse is refused as SGLang refuses it, and changes nothing: a release
of a released tag, a resume of a tag that is not released (scheduler/ops/memory_tags.py and the
rank's handlers in scheduler/ops/weight_control.py, driven through the rank's loop)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sglang_admin.messages import AdminReply, ReleaseMemoryReq, ResumeMemoryReq
from sglang_admin.scheduler.ops.memory_tags import release_refusal, resume_refusal
from tests.unit.test_rank_loop import Wires


def test_refusals_name_the_tags_that_are_misused() -> None:
    assert release_refusal(set(), ["kv_cache", "weights"]) is None
    assert release_refusal({"kv_cache"}, ["kv_cache"]) == (
        "kv_cache is already released; resume it before releasing it again")
    assert release_refusal({"kv_cache"}, ["weights"]) is None
    assert resume_refusal({"kv_cache"}, ["kv_cache"]) is None
    assert resume_refusal(set(), ["kv_cache"]) == (
        "kv_cache is not currently released (released now: nothing)")
    assert resume_refusal({"kv_cache"}, ["kv_cache", "weights"]) == (
        "weights is not currently released (released now: kv_cache)")
    assert resume_refusal(set(), ["kv_cache", "weights"]).startswith(
        "kv_cache, weights are not currently released")


@pytest.fixture
def wires() -> Iterator[Wires]:
    w = Wires()
    yield w
    w.close()


def _ask(wires: Wires, msg: object) -> AdminReply:
    wires.send(msg)
    wires.loop.drain_inbox(block=False)
    replies = [m for m in wires.received() if isinstance(m, AdminReply)]
    assert len(replies) == 1
    return replies[0]


def test_misuse_is_refused_and_the_served_state_stays(wires: Wires) -> None:
    runner = wires.loop.runner
    wires.received()  # the ready message

    reply = _ask(wires, ResumeMemoryReq("m1", ["kv_cache"]))  # nothing released
    assert not reply.success and reply.message == (
        "kv_cache is not currently released (released now: nothing)")
    assert not runner.kv_cache_released and not runner.weights_released

    assert _ask(wires, ReleaseMemoryReq("m2", ["kv_cache"])).success
    assert runner.kv_cache_released

    reply = _ask(wires, ReleaseMemoryReq("m3", ["kv_cache"]))  # twice
    assert not reply.success and reply.message.startswith("kv_cache is already released")
    reply = _ask(wires, ReleaseMemoryReq("m4", ["kv_cache", "weights"]))  # refused as a whole
    assert not reply.success and not runner.weights_released

    reply = _ask(wires, ResumeMemoryReq("m5", ["weights"]))  # only kv_cache is released
    assert not reply.success and reply.message == (
        "weights is not currently released (released now: kv_cache)")
    assert runner.kv_cache_released and not runner.weights_released

    assert _ask(wires, ResumeMemoryReq("m6", ["kv_cache"])).success
    assert not runner.kv_cache_released
    assert not wires.loop.quiesce.holds  # admission is no longer held


def test_a_resume_that_runs_out_of_memory_is_answered_and_the_rank_serves_on(
        wires: Wires, monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocation that fails while resuming (CUDA out of memory) is a failed answer, the
    memory stays released as it was, and a later resume works: before, the error escaped
    the handler and ended the rank."""
    import torch

    runner = wires.loop.runner
    wires.received()
    assert _ask(wires, ReleaseMemoryReq("r1", ["kv_cache", "weights"])).success

    def no_room(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runner, "_allocate_kv", no_room)
    reply = _ask(wires, ResumeMemoryReq("r2", ["kv_cache"]))
    assert not reply.success
    assert reply.message.startswith("resuming kv_cache (")
    assert "ran out of memory: CUDA out of memory" in reply.message
    assert runner.kv_cache_released and runner.weights_released

    allocate = runner.model.allocate_parameters

    def half_then_no_room(device: torch.device) -> None:
        runner.model.to_empty(device=device)  # part of the weights got storage
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.undo()  # the KV pool fits again; the weights do not
    monkeypatch.setattr(runner.model, "allocate_parameters", half_then_no_room)
    reply = _ask(wires, ResumeMemoryReq("r3", ["kv_cache", "weights"]))
    assert not reply.success and reply.message.startswith("resuming weights (")
    assert not runner.kv_cache_released  # what fitted was resumed
    assert runner.weights_released  # every weight released again, none half-allocated
    assert all(p.is_meta for p in runner.model.parameters())

    monkeypatch.setattr(runner.model, "allocate_parameters", allocate)
    reply = _ask(wires, ResumeMemoryReq("r4", ["weights"]))
    assert reply.success, reply.message
    assert not runner.weights_released
