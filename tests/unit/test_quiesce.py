"""Quiesce: ops wait for running requests to drain, hold new ones, give up on time."""

from __future__ import annotations

import time

from sglang_admin.model.step_io import SeqOutput
from sglang_admin.scheduler.ops.quiesce import Quiesce
from tests.unit.test_scheduler import drive, make, req, solo


def test_an_idle_rank_runs_the_op_at_once() -> None:
    sched, _ = make()
    ran: list[str] = []
    Quiesce(sched).when_drained("a", "op", 5.0, lambda: ran.append("a"), ran.append)
    assert ran == ["a"] and not sched.admission_paused


def test_the_op_waits_for_running_requests_and_holds_new_ones() -> None:
    sched, runner = make()
    quiesce = Quiesce(sched)
    sched.add_request(req("old", [1, 2, 3], 4))
    batch = sched.schedule()
    sched.postprocess(batch, runner.run(batch))  # admitted and running
    events: list[str] = []
    quiesce.when_drained("op", "op", 60.0, lambda: events.append(f"op {sorted(sched.by_rid)}"),
                         events.append)
    assert sched.admission_paused and events == []
    sched.add_request(req("new", [4, 5], 3))
    while "old" in sched.by_rid:
        batch = sched.schedule()
        assert all(sp.req.rid == "old" for sp in batch.spans)  # "new" is held
        sched.postprocess(batch, runner.run(batch))
        quiesce.poll()
    assert events == ["op ['new']"]  # ran once "old" finished, before "new" started
    assert not sched.admission_paused
    assert drive(sched, runner)["tokens"]["new"] == solo([4, 5], 3)


def test_a_late_or_cancelled_op_gives_up_and_admission_reopens() -> None:
    sched, _ = make()
    quiesce = Quiesce(sched)
    sched.add_request(req("old", [1, 2, 3], 40))
    sched.postprocess(sched.schedule(), [SeqOutput(7)])
    reasons: list[str] = []
    quiesce.when_drained("late", "op", 0.0, lambda: reasons.append("ran"), reasons.append)
    quiesce.when_drained("gone", "flush", 60.0, lambda: reasons.append("ran"), reasons.append)
    time.sleep(0.01)
    quiesce.poll()
    assert reasons == ["Timed out waiting for idle state."] and sched.admission_paused
    assert quiesce.waiting("flush") and not quiesce.waiting("op")
    assert quiesce.cancel("gone") and not quiesce.cancel("gone")
    assert reasons == ["Timed out waiting for idle state."]  # a cancelled op is dropped silently
    assert not sched.admission_paused


def test_a_hold_closes_admission_until_lifted() -> None:
    sched, runner = make()
    quiesce = Quiesce(sched)
    quiesce.hold("memory released")
    sched.add_request(req("r", [1, 2], 2))
    assert sched.schedule() is None and sched.admission_paused
    quiesce.lift("memory released")
    assert drive(sched, runner)["tokens"]["r"] == solo([1, 2], 2)


def test_a_pause_counts_as_drained() -> None:
    sched, _ = make()
    sched.add_request(req("held", [1, 2, 3], 40))
    sched.postprocess(sched.schedule(), [SeqOutput(7)])
    sched.pause("in_place")
    ran: list[str] = []
    Quiesce(sched).when_drained("op", "op", 5.0, lambda: ran.append("op"), ran.append)
    assert ran == ["op"] and sched.running
