"""Where a rank's decode steps spend their time, phase by phase (no torch here).

A step's wall time splits into the phases below; the rank adds each decode step's split to
running totals that it publishes in its state (``RankState.decode_phase_s``), and GetMetrics
exposes them as ``sglang_admin:decode_step_phase_seconds_total{phase=...}``. ``model`` is the
forward pass and the logits; everything else is the serving overhead around it:

- ``schedule``: picking the batch (Scheduler.schedule),
- ``prepare``: the per-request inputs and the runner's index tensors,
- ``model``: the transformer forward and the logits,
- ``sample``: sampling (penalties, top-k/p, logprobs) and reading the tokens back,
- ``postprocess``: appending tokens, finishing requests (Scheduler.postprocess),
- ``output``: KV events and the message of the step's outputs to the server.
"""

from __future__ import annotations

import time
from typing import Protocol

PHASES = ("schedule", "prepare", "model", "sample", "postprocess", "output")
SERVING_PHASES = tuple(p for p in PHASES if p != "model")


class ForwardTimes(Protocol):
    """The runner's split of its last ``forward_step`` (model/runner.py's ForwardTimes)."""

    @property
    def model(self) -> float: ...

    @property
    def sample(self) -> float: ...


class StepTimer:
    """Laps of the current step, added to the decode totals when the step was a decode."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.decode_steps = 0
        self._laps: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._mark = 0.0

    def start(self) -> None:
        """A new step begins (before scheduling)."""
        for phase in PHASES:
            self._laps[phase] = 0.0
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The time since the last mark belongs to ``phase``."""
        now = time.perf_counter()
        self._laps[phase] += now - self._mark
        self._mark = now

    def skip(self) -> None:
        """The time since the last mark belongs to no phase (e.g. handling the inbox)."""
        self._mark = time.perf_counter()

    def forward(self, times: ForwardTimes) -> None:
        """The time since the last mark was the runner's forward_step, split as it says."""
        now = time.perf_counter()
        elapsed = now - self._mark
        self._mark = now
        self._laps["model"] += times.model
        self._laps["sample"] += times.sample
        self._laps["prepare"] += max(0.0, elapsed - times.model - times.sample)

    def commit(self, decode: bool) -> None:
        """The step is over: count it when it was a decode step (prefill steps differ)."""
        if not decode:
            return
        self.decode_steps += 1
        for phase, seconds in self._laps.items():
            self.totals[phase] += seconds

    def serving_share(self) -> float:
        """Of the decode steps' time so far, the part outside the model (0 before any)."""
        total = sum(self.totals.values())
        return 0.0 if total <= 0 else sum(self.totals[p] for p in SERVING_PHASES) / total
