"""The rank's decode-step timing: laps land in the phase they belong to, decode steps only."""

from __future__ import annotations

import time

import pytest

from sglang_admin.model.runner import ForwardTimes
from sglang_admin.scheduler.profiling.step_timing import PHASES, StepTimer


def test_a_decode_step_splits_into_its_phases() -> None:
    timer = StepTimer()
    timer.start()
    time.sleep(0.01)
    timer.lap("schedule")
    time.sleep(0.05)  # the forward_step call: 30 ms model, 10 ms sampling, the rest prepare
    timer.forward(ForwardTimes(model=0.03, sample=0.01))
    time.sleep(0.01)
    timer.lap("postprocess")
    timer.commit(decode=True)
    t = timer.totals
    assert timer.decode_steps == 1
    assert set(t) == set(PHASES)
    assert t["model"] == 0.03 and t["sample"] == 0.01
    assert t["schedule"] >= 0.01 and t["postprocess"] >= 0.01
    assert t["prepare"] >= 0.01 - 1e-3  # 50 ms of call minus 40 ms of model and sampling
    assert t["output"] == 0.0
    assert timer.serving_share() == pytest.approx(1 - 0.03 / sum(t.values()))


def test_prefill_steps_are_not_counted_and_laps_reset() -> None:
    timer = StepTimer()
    timer.start()
    timer.forward(ForwardTimes(model=1.0, sample=0.0))
    timer.commit(decode=False)
    assert timer.decode_steps == 0 and timer.totals["model"] == 0.0
    assert timer.serving_share() == 0.0
    timer.start()
    timer.forward(ForwardTimes(model=0.002, sample=0.0))
    timer.commit(decode=True)
    assert timer.totals["model"] == 0.002  # the prefill step's laps did not carry over
