"""torch.profiler sessions of one rank, with SGLang's start/stop semantics.

One profile at a time per rank. A profile is started by a :class:`StartProfileReq` and is
``armed`` (waiting for its ``start_step``), then ``running``, then back to ``idle`` when
StopProfile arrives or when it stops by itself after ``num_steps`` forward steps.

- The rank loop calls :meth:`Profiler.before_step` and :meth:`Profiler.after_step` around
  every forward pass with the batch's stage ("prefill" or "decode"); the profiler counts
  forward steps itself (step numbers start at 1, as the rank's ``forward_steps``).
- Every transition happens on a forward step or on a message, so the loop may block on its
  inbox while no batch runs: an armed profile starts at the next forward step that reaches
  ``start_step``, whenever that comes.
- ``profile_by_stage``: prefill (EXTEND) and decode (DECODE) batches get a session each,
  ``num_steps`` steps of their own stage each. A stage's session opens at its first batch;
  when the other stage's first batch comes while it still runs, it ends there (as SGLang
  does, so both stages always get a trace); batches of a finished stage that run inside the
  other stage's session are recorded in that session but not counted.
- A session writes ``{stem}-TP-{tp}[-DP-{rank}][-{STAGE}].trace.json.gz`` (``stem`` is the
  profile id, or ``{prefix}-{profile id}``; the DP part only when dp_size > 1; ``tp`` is 0
  but on a TP follower, scheduler/tp/worker.py), and, for MEM on CUDA, a memory snapshot
  ``{stem}-TP-{tp}[-DP-{rank}]-memory[-{STAGE}].pickle``.
- Size cap (``max_bytes``, this rank's share of the profile's cap): checked after each file
  is written. A file that takes the rank's total over the cap is deleted, the profile stops
  there, and the reason is returned by StopProfile (or logged when it stopped by itself).
- Step cap (``max_steps``, the server's ``--profile-max-steps``): a running profile that
  has recorded that many forward steps stops by itself; the reason is logged and returned
  by the next StopProfile, with the files.
- Export off the loop: a session is stopped on the loop's thread (torch requires it), and
  its trace is written by the export thread of ``scheduler/profiling/export.py`` (which says
  why forked children write and join the traces); StopProfile's answer is a Future that
  resolves once the files are on disk, so the rank keeps serving meanwhile.

This module is the state machine (when sessions start, segment and stop); where the rest of
profiling lives, end to end, is listed in ``scheduler/profiling/export.py``'s docstring.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_admin.config import is_inside
from sglang_admin.constants import (
    DEFAULT_PROFILE_ACTIVITIES,
    PROFILE_STAGE_NAMES,
    profile_file_base,
)
from sglang_admin.messages import PROFILE_STOPPED_BY_ITSELF, ProfileStopResult
from sglang_admin.scheduler import late_imports
from sglang_admin.scheduler.profiling.export import (
    ProfileRun,
    TraceExporter,
    free_session,
    part_path,
    remove_files,
)

logger = logging.getLogger(__name__)

ALREADY_RUNNING = "Profiling is already in progress. Call /stop_profile first."
NOT_RUNNING = "Profiling is not in progress. Call /start_profile first."
MEM_HISTORY_MAX_ENTRIES = 100_000
# A session's torch.profiler is stopped and restarted every this many forward steps: stopping
# costs the loop thread time in proportion to what was recorded (torch post-processes the
# events there, about twice the recorded steps' own time), so a segment bounds that pause.
# The segments' traces are written as they end and joined into the session's one file.
# 16: with stacks and shapes on a loaded 2-core CPU, a 32-step segment's stop took the loop
# 3.2-4.1 s, past HealthCheck's 3 s per rank; freeing a segment's events is bounded the same.
# On CUDA a session is one segment: restarting the profiler restarts CUPTI, which takes long
# and leaves a hole in the GPU timeline at each restart; a CUDA step records few host events,
# and --profile-max-steps bounds them.
SEGMENT_STEPS = 16


@dataclass
class _Session:
    """One running torch.profiler session (one trace file, recorded in segments)."""

    stage: str | None  # None: the whole profile; else "prefill" | "decode"
    prof: Any  # torch.profiler.profile of the current segment, or None (MEM only)
    mem_history: bool
    steps: int = 0  # counted steps (num_steps)
    segment_steps: int = 0  # steps recorded by the current segment
    parts: list[str] = field(default_factory=list)  # earlier segments' trace files


@dataclass
class _Config:
    """What a StartProfileReq asked for, resolved against this rank's device."""

    profile_id: str
    output_dir: str
    base: str
    torch_activities: list[Any]
    with_stack: bool
    record_shapes: bool
    profile_memory: bool
    mem_history: bool
    num_steps: int
    by_stage: bool
    stages: tuple[str, ...]
    max_bytes: int
    notes: list[str] = field(default_factory=list)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class Profiler:
    """The profiler of one rank: start/stop requests and the per-step hooks.

    Traces are exported by a background thread of the rank, so the rank keeps serving
    while a large trace is written: :meth:`request_stop` and :meth:`after_step` stop the
    torch.profiler session on the loop's thread (torch requires it) and return a
    :class:`~concurrent.futures.Future` that resolves once the files are on disk.
    ``max_steps`` (0: none) caps a running profile's forward steps: reaching it stops the
    profile by itself, with a message that is logged and returned by the next StopProfile.
    """

    def __init__(
        self, rank: int, device: str, max_steps: int = 0, segment_steps: int | None = None,
        tp_rank: int = 0,
    ) -> None:
        self.rank = rank
        self.tp_rank = tp_rank  # --tp-size > 1: a TP follower's profiler names its files
        self.device = device
        self.max_steps = max_steps
        if segment_steps is None:  # 0: one segment per session
            segment_steps = 0 if device.startswith("cuda") else SEGMENT_STEPS
        self.segment_steps = segment_steps
        self.state = "idle"  # idle | armed | running
        self.forward_ct = 0
        self.start_at = 0
        self.config: _Config | None = None
        self.session: _Session | None = None
        self.stages_done: set[str] = set()
        self.run: ProfileRun | None = None
        self.auto_stopped: tuple[ProfileRun, str] | None = None  # for the next StopProfile
        self.export = TraceExporter(rank)

    @property
    def has_cuda(self) -> bool:
        return self.device.startswith("cuda") and torch.cuda.is_available()

    @property
    def profile_id(self) -> str:
        return self.config.profile_id if self.config else ""

    @property
    def reported_state(self) -> str:
        """The state a rank reports: ``exporting`` while traces are still being written
        after the profile ended (its files are not all on disk yet)."""
        if self.state == "idle" and self.export.pending_jobs:
            return "exporting"
        return self.state

    # ------------------------------------------------------------------ requests

    def start(self, req: Any) -> tuple[bool, str]:
        """Arm or start a profile for a StartProfileReq; (success, message). A profile that
        is armed but not recording yet is replaced by the new one (as SGLang)."""
        if self.state == "running":
            return False, ALREADY_RUNNING
        try:
            config = self._configure(req)
        except ValueError as exc:
            return False, str(exc)
        self.config = config
        self.session = None
        self.stages_done = set()
        self.run = ProfileRun(config.profile_id, config.output_dir, config.max_bytes)
        self.auto_stopped = None
        notes = "; ".join(config.notes)
        suffix = f" ({notes})" if notes else ""
        start_step = req.start_step or 0
        if start_step:
            self.start_at = max(start_step, self.forward_ct + 1)
            self.state = "armed"
            logger.info(
                "profile %s armed for forward step %d (rank at step %d); output %s",
                config.profile_id, self.start_at, self.forward_ct, config.output_dir,
            )
            return True, f"Profiling armed for forward step {self.start_at}{suffix}"
        self._begin()
        return True, f"Profiling started{suffix}"

    def stop(self) -> tuple[bool, str, ProfileStopResult]:
        """Stop the profile and wait for its files; (success, message, files and id)."""
        return self.request_stop().result()

    def request_stop(self) -> Future:
        """Stop the profile now; the Future resolves to (success, message,
        ProfileStopResult) once its files are written (by the export thread)."""
        if self.state == "idle" or self.config is None or self.run is None:
            if self.auto_stopped is not None:  # stopped by itself: say why, once
                run, why = self.auto_stopped
                self.auto_stopped = None
                return self.export.submit(self.export.result, run, why)
            return _done((False, NOT_RUNNING, ProfileStopResult()))
        run = self.run
        if self.state == "armed":
            text = (
                f"Profiling stopped before it started (armed for forward step "
                f"{self.start_at}, rank at step {self.forward_ct}): no trace written"
            )
            self._end()
            return _done((True, text, ProfileStopResult([], run.profile_id)))
        if self.session is not None:
            self._finish_session()
        self._end()
        return self.export.submit(self.export.result, run, "Profiling stopped")

    # ------------------------------------------------------------------ step hooks

    def before_step(self, stage: str) -> None:
        """Count a forward step; start an armed profile or a stage's session."""
        self.forward_ct += 1
        if self.state == "armed" and self.forward_ct >= self.start_at:
            self._begin()
        if self.state != "running" or self.config is None or self.run is None:
            return
        if self.export.failed(self.run):  # an export hit the size cap (or failed): the profile stops here
            logger.warning("profile %s: %s", self.profile_id, "; ".join(self.run.errors))
            self._end()
            return
        self.run.steps += 1
        if self.config.by_stage and stage in self.config.stages and stage not in self.stages_done:
            if self.session is not None and self.session.stage != stage:
                self._finish_session()  # the other stage's session ends here
            if self.state == "running" and self.session is None:
                self.session = self._open(stage)
        if self.session is not None:
            self.session.segment_steps += 1
            if self.session.stage is None or self.session.stage == stage:
                self.session.steps += 1

    def after_step(self, stage: str) -> Future | None:
        """End a session that reached num_steps, or the profile at the max_steps cap.

        Returns a Future of the profile's files when the profile ended by itself here."""
        session, config, run = self.session, self.config, self.run
        if self.state != "running" or config is None or run is None:
            return None
        if self.max_steps and run.steps >= self.max_steps:
            why = (
                f"{PROFILE_STOPPED_BY_ITSELF}: it reached the cap of {self.max_steps} forward "
                "steps (--profile-max-steps)"
            )
            logger.warning("profile %s: %s", config.profile_id, why)
            if session is not None:
                self._finish_session()
            self._end()
            self.auto_stopped = (run, why)
            return self.export.submit(lambda: self.export.result(run, why)[2].files)
        if session is None or not config.num_steps or session.steps < config.num_steps:
            if (session is not None and session.prof is not None and self.segment_steps
                    and session.segment_steps >= self.segment_steps):
                self._next_segment(session)
            return None
        self._finish_session()
        if self.state == "idle":
            return self.export.submit(self.export.files_when_done, run)
        return None

    # ------------------------------------------------------------------ internals

    def _configure(self, req: Any) -> _Config:
        """Resolve a request (checked by the server's plan_start) for this rank; the output
        directory's confinement is checked again here, where it is created: a symlink
        swapped in since the server's check must not redirect the traces. ValueError names
        what is wrong."""
        names = list(req.activities or DEFAULT_PROFILE_ACTIVITIES)
        stages = list(dict.fromkeys(req.profile_stages or ("prefill", "decode")))
        root = req.profile_root
        if root and not is_inside(req.output_dir, root):
            raise ValueError(f"output_dir {req.output_dir!r} is outside the profile root {root!r}")
        try:
            os.makedirs(req.output_dir, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create output_dir {req.output_dir!r}: {exc}") from None
        if root and not is_inside(req.output_dir, root):  # a symlink swapped in meanwhile
            raise ValueError(f"output_dir {req.output_dir!r} is outside the profile root {root!r}")

        notes: list[str] = []
        activities: list[Any] = []
        if "CPU" in names:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        if "GPU" in names or "CUDA" in names:
            if self.has_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            else:
                notes.append("GPU activity left out: no CUDA device")
        mem_history = "MEM" in names and self.has_cuda
        profile_memory = "MEM" in names and not self.has_cuda
        if profile_memory:
            notes.append("MEM without CUDA: memory events recorded in the trace, no snapshot")
        if not activities and not mem_history:
            activities.append(torch.profiler.ProfilerActivity.CPU)
            notes.append("recording CPU activity instead")
        return _Config(
            profile_id=req.profile_id,
            output_dir=req.output_dir,
            base=profile_file_base(req.profile_id, req.profile_prefix, self.rank, req.dp_size,
                                   self.tp_rank),
            torch_activities=activities,
            with_stack=req.with_stack,
            record_shapes=req.record_shapes,
            profile_memory=profile_memory,
            mem_history=mem_history,
            num_steps=req.num_steps or 0,
            by_stage=bool(req.profile_by_stage or req.profile_stages),
            stages=tuple(stages),
            max_bytes=req.max_bytes,
            notes=notes,
        )

    def _begin(self) -> None:
        """The profile runs from now: one session now, or one per stage at its batches."""
        assert self.config is not None
        self.state = "running"
        logger.info(
            "profiling starts at forward step %d; traces will be saved to %s (profile id %s)",
            self.forward_ct + 1, self.config.output_dir, self.config.profile_id,
        )
        if not self.config.by_stage:
            self.session = self._open(None)

    def _open(self, stage: str | None) -> _Session:
        assert self.config is not None
        c = self.config
        prof = self._start_torch_profiler() if c.torch_activities else None
        if c.mem_history:
            torch.cuda.memory._record_memory_history(max_entries=MEM_HISTORY_MAX_ENTRIES)
        return _Session(stage, prof, c.mem_history)

    def _start_torch_profiler(self) -> Any:
        assert self.config is not None
        c = self.config
        # torch.profiler's start imports torch._dynamo: the rank's late-imports thread does
        # that after READY; wait for all it imports (no import on the loop, none traced)
        late_imports.wait_until_imported()
        prof = torch.profiler.profile(
            activities=c.torch_activities,
            with_stack=c.with_stack,
            record_shapes=c.record_shapes,
            profile_memory=c.profile_memory,
        )
        prof.start()
        return prof

    def _trace_path(self, stage: str | None) -> str:
        assert self.config is not None
        suffix = f"-{PROFILE_STAGE_NAMES[stage]}" if stage else ""
        return os.path.join(self.config.output_dir, f"{self.config.base}{suffix}.trace.json.gz")

    def _next_segment(self, session: _Session) -> None:
        """End the session's current segment (its export queued) and record a new one."""
        assert self.run is not None
        final = self._trace_path(session.stage)
        part = part_path(final, len(session.parts))
        try:
            session.prof.stop()
            self.export.submit(self.export.export_part, self.run, session.prof, part)
            session.parts.append(part)
            session.prof = self._start_torch_profiler()
        except Exception as exc:  # noqa: BLE001 - a failed restart must not kill the rank
            logger.exception("profile %s: starting a new segment failed", self.profile_id)
            self.export.record_error(self.run, f"profiling failed: {type(exc).__name__}: {exc}")
            session.prof = None
        session.segment_steps = 0

    def _finish_session(self) -> None:
        """Stop the running session (on this thread, as torch requires) and queue the export
        of its files; ends the profile when it was the last session."""
        assert self.config is not None and self.session is not None and self.run is not None
        c, session, run = self.config, self.session, self.run
        self.session = None
        suffix = f"-{PROFILE_STAGE_NAMES[session.stage]}" if session.stage else ""
        t0 = time.perf_counter()
        snapshot: str | None = None
        try:
            if session.prof is not None:
                session.prof.stop()
            if session.mem_history:  # the allocator's history as of now, so not deferred
                snapshot = os.path.join(c.output_dir, f"{c.base}-memory{suffix}.pickle")
                torch.cuda.memory._dump_snapshot(snapshot)
                torch.cuda.memory._record_memory_history(enabled=None)
        except Exception as exc:  # a failed stop must not kill the rank
            logger.exception("profile %s: stopping the session failed", c.profile_id)
            self.export.record_error(run, f"export failed: {type(exc).__name__}: {exc}")
        logger.info("profile %s%s: %d step(s) stopped in %.2fs; exporting in the background",
                    c.profile_id, suffix, session.steps, time.perf_counter() - t0)
        prof, session.prof = session.prof, None
        self.export.submit(self.export.export, run, prof, self._trace_path(session.stage),
                           list(session.parts), snapshot)
        if session.stage is not None:
            self.stages_done.add(session.stage)
        if session.stage is None or self.stages_done >= set(c.stages):
            self._end()

    def _end(self) -> None:
        """Back to idle; a session still open (a cap stop) is closed without export."""
        if self.session is not None:
            session, self.session = self.session, None
            if session.prof is not None:
                session.prof.stop()
                free_session(session.prof)
            if session.mem_history:
                torch.cuda.memory._record_memory_history(enabled=None)
            if session.parts:  # segments written so far: removed once written
                self.export.submit(remove_files, list(session.parts))
        if self.state != "idle":
            logger.info("profile %s ended after %d step(s)", self.profile_id,
                        self.run.steps if self.run else 0)
        self.state = "idle"
