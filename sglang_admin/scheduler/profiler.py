"""torch.profiler sessions of one rank, with SGLang's start/stop semantics.

One profile at a time per rank. A profile is started by a :class:`StartProfileReq` and is
``armed`` (waiting for its ``start_step``), then ``running``, then back to ``idle`` when
StopProfile arrives or when it stops by itself after ``num_steps`` forward steps.

- The rank loop calls :meth:`Profiler.before_step` and :meth:`Profiler.after_step` around
  every forward pass with the batch's stage ("prefill" or "decode"); the profiler counts
  forward steps itself (step numbers start at 1, as the rank's ``forward_steps``).
- Every transition happens on a forward step or on a message, so the loop may block on its
  inbox while no batch runs (``needs_ticks`` is False): an armed profile starts at the next
  forward step that reaches ``start_step``, whenever that comes.
- ``profile_by_stage``: prefill (EXTEND) and decode (DECODE) batches get a session each,
  ``num_steps`` steps of their own stage each. A stage's session opens at its first batch;
  when the other stage's first batch comes while it still runs, it ends there (as SGLang
  does, so both stages always get a trace); batches of a finished stage that run inside the
  other stage's session are recorded in that session but not counted.
- A session writes ``{stem}-TP-0[-DP-{rank}][-{STAGE}].trace.json.gz`` (``stem`` is the
  profile id, or ``{prefix}-{profile id}``; the DP part only when dp_size > 1), and, for MEM
  on CUDA, a memory snapshot ``{stem}-TP-0[-DP-{rank}]-memory[-{STAGE}].pickle``.
- Size cap (``max_bytes``, this rank's share of the profile's cap): checked after each file
  is written. A file that takes the rank's total over the cap is deleted, the profile stops
  there, and the reason is returned by StopProfile (or logged when it stopped by itself).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

ALREADY_RUNNING = "Profiling is already in progress. Call /stop_profile first."
NOT_RUNNING = "Profiling is not in progress. Call /start_profile first."
ACTIVITIES = ("CPU", "GPU", "CUDA", "MEM")
DEFAULT_ACTIVITIES = ("CPU", "GPU")
# Our stage names -> SGLang's ForwardMode names used in file names.
STAGE_NAMES = {"prefill": "EXTEND", "decode": "DECODE"}
STAGE_ALIASES = {"prefill": "prefill", "extend": "prefill", "decode": "decode"}
MEM_HISTORY_MAX_ENTRIES = 100_000


def _release_memory() -> None:
    """Give the memory of a finished trace back to the system: the profiler's event lists
    and the JSON built at export are freed, but glibc keeps the pages in its arenas, which
    over many sessions reads as a leak in the rank's RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def is_inside(path: str, root: str) -> bool:
    """True when ``path`` resolved with symlinks lies inside ``root`` resolved the same way."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, real_root]) == real_root


def file_base(profile_id: str, prefix: str, rank: int, dp_size: int) -> str:
    """File name base of one rank's files: ``[{prefix}-]{id}-TP-0[-DP-{rank}]``."""
    stem = f"{prefix}-{profile_id}" if prefix else profile_id
    return f"{stem}-TP-0" + (f"-DP-{rank}" if dp_size > 1 else "")


@dataclass
class _Session:
    """One running torch.profiler session (one trace file)."""

    stage: str | None  # None: the whole profile; else "prefill" | "decode"
    prof: Any  # torch.profiler.profile or None (MEM only)
    mem_history: bool
    steps: int = 0


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


class Profiler:
    """The profiler of one rank: start/stop requests and the per-step hooks."""

    def __init__(self, rank: int, device: str) -> None:
        self.rank = rank
        self.device = device
        self.state = "idle"  # idle | armed | running
        self.forward_ct = 0
        self.start_at = 0
        self.config: _Config | None = None
        self.session: _Session | None = None
        self.stages_done: set[str] = set()
        self.files: list[str] = []
        self.bytes_written = 0
        self.errors: list[str] = []

    @property
    def has_cuda(self) -> bool:
        return self.device.startswith("cuda") and torch.cuda.is_available()

    @property
    def needs_ticks(self) -> bool:
        """Whether the loop must not block while idle: never, see the module docstring."""
        return False

    @property
    def profile_id(self) -> str:
        return self.config.profile_id if self.config else ""

    # ------------------------------------------------------------------ requests

    def start(self, req: Any) -> tuple[bool, str]:
        """Arm or start a profile for a StartProfileReq; (success, message)."""
        if self.state != "idle":
            return False, ALREADY_RUNNING
        try:
            config = self._configure(req)
        except ValueError as exc:
            return False, str(exc)
        self.config = config
        self.session = None
        self.stages_done = set()
        self.files = []
        self.bytes_written = 0
        self.errors = []
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

    def stop(self) -> tuple[bool, str, dict[str, Any]]:
        """Stop the profile, writing its files; (success, message, {files, profile_id})."""
        if self.state == "idle" or self.config is None:
            return False, NOT_RUNNING, {"files": [], "profile_id": ""}
        config = self.config
        if self.state == "armed":
            text = (
                f"Profiling stopped before it started (armed for forward step "
                f"{self.start_at}, rank at step {self.forward_ct}): no trace written"
            )
        else:
            if self.session is not None:
                self._finish_session()
            text = f"Profiling stopped: {len(self.files)} file(s) written to {config.output_dir}"
        self._end()
        data = {"files": list(self.files), "profile_id": config.profile_id}
        if self.errors:
            return False, "; ".join(self.errors), data
        return True, text, data

    # ------------------------------------------------------------------ step hooks

    def before_step(self, stage: str) -> None:
        """Count a forward step; start an armed profile or a stage's session."""
        self.forward_ct += 1
        if self.state == "armed" and self.forward_ct >= self.start_at:
            self._begin()
        if self.state != "running" or self.config is None:
            return
        if self.config.by_stage and stage in self.config.stages and stage not in self.stages_done:
            if self.session is not None and self.session.stage != stage:
                self._finish_session()  # the other stage's session ends here
            if self.state == "running" and self.session is None:
                self.session = self._open(stage)
        if self.session is not None and (
            self.session.stage is None or self.session.stage == stage
        ):
            self.session.steps += 1

    def after_step(self, stage: str) -> list[str] | None:
        """End a session that reached num_steps; the profile's files when it has ended."""
        session, config = self.session, self.config
        if self.state != "running" or session is None or config is None:
            return None
        if not config.num_steps or session.steps < config.num_steps:
            return None
        self._finish_session()
        if self.state == "idle":
            if self.errors:
                logger.warning("profile %s: %s", config.profile_id, "; ".join(self.errors))
            return list(self.files)
        return None

    # ------------------------------------------------------------------ internals

    def _configure(self, req: Any) -> _Config:
        """Check a request and resolve it for this rank; ValueError names what is wrong."""
        for name in ("start_step", "num_steps"):
            value = getattr(req, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        names = [a.upper() for a in (req.activities or DEFAULT_ACTIVITIES)]
        unknown = [a for a in names if a not in ACTIVITIES]
        if unknown:
            raise ValueError(
                f"unknown profiler activity {', '.join(unknown)}; valid: CPU, GPU (CUDA), MEM"
            )
        stages: list[str] = []
        for s in req.profile_stages or ("prefill", "decode"):
            if s.lower() not in STAGE_ALIASES:
                raise ValueError(f"unknown profile stage {s!r}; valid: prefill (extend), decode")
            if STAGE_ALIASES[s.lower()] not in stages:
                stages.append(STAGE_ALIASES[s.lower()])
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
            base=file_base(req.profile_id, req.profile_prefix, self.rank, req.dp_size),
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
        prof = None
        if c.torch_activities:
            prof = torch.profiler.profile(
                activities=c.torch_activities,
                with_stack=c.with_stack,
                record_shapes=c.record_shapes,
                profile_memory=c.profile_memory,
            )
            prof.start()
        if c.mem_history:
            torch.cuda.memory._record_memory_history(max_entries=MEM_HISTORY_MAX_ENTRIES)
        return _Session(stage, prof, c.mem_history)

    def _finish_session(self) -> None:
        """Stop the running session and write its files; ends the profile when done."""
        assert self.config is not None and self.session is not None
        c, session = self.config, self.session
        self.session = None
        suffix = f"-{STAGE_NAMES[session.stage]}" if session.stage else ""
        t0 = time.perf_counter()
        try:
            if session.prof is not None:
                session.prof.stop()
                path = os.path.join(c.output_dir, f"{c.base}{suffix}.trace.json.gz")
                session.prof.export_chrome_trace(path)
                self._account(path)
            if session.mem_history:
                path = os.path.join(c.output_dir, f"{c.base}-memory{suffix}.pickle")
                torch.cuda.memory._dump_snapshot(path)
                torch.cuda.memory._record_memory_history(enabled=None)
                self._account(path)
        except Exception as exc:  # a failed export must not kill the rank
            logger.exception("profile %s: export failed", c.profile_id)
            self.errors.append(f"export failed: {type(exc).__name__}: {exc}")
        session.prof = None
        _release_memory()
        logger.info(
            "profile %s%s: %d step(s) exported in %.2fs",
            c.profile_id, suffix, session.steps, time.perf_counter() - t0,
        )
        if session.stage is not None:
            self.stages_done.add(session.stage)
        if self.errors or session.stage is None or self.stages_done >= set(c.stages):
            self._end()

    def _account(self, path: str) -> None:
        """Count a written file against the cap; over it: remove the file, record why."""
        assert self.config is not None
        size = os.path.getsize(path)
        cap = self.config.max_bytes
        if cap and self.bytes_written + size > cap:
            os.remove(path)
            self.errors.append(
                f"profile size cap reached: {os.path.basename(path)} ({size} bytes) would "
                f"take this rank to {self.bytes_written + size} bytes, over its cap of {cap} "
                "bytes; the file was removed and profiling stopped"
            )
            return
        self.bytes_written += size
        self.files.append(path)

    def _end(self) -> None:
        """Back to idle; a session still open (a cap stop) is closed without export."""
        if self.session is not None:
            session, self.session = self.session, None
            if session.prof is not None:
                session.prof.stop()
            if session.mem_history:
                torch.cuda.memory._record_memory_history(enabled=None)
        if self.state != "idle":
            logger.info("profile %s ended: %d file(s)", self.profile_id, len(self.files))
        self.state = "idle"
