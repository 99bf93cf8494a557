"""Writes a rank's finished profiler sessions to disk, off the rank's loop: the export
thread, trace segments and their join, the size cap, and the answer a StopProfile gets.

The state machine that decides when sessions start and stop is ``scheduler/profiling/profiler.py``; it
hands each stopped torch.profiler session here. torch's exporter holds the GIL for its whole
run (a second or more with stacks), so the export thread has it run in a forked child
(``trace_export``): run on the thread itself, it stopped the loop and the heartbeat for as
long. A written session is freed by refcounting (:func:`free_session`), not by a full
collection, which held the GIL ~0.3 s. Segments are joined into the session's one file by a
child process (``trace_join``): the JSON parse holds the GIL for seconds, which on the export
thread stalled the loop (HealthCheck unanswered during a StopProfile under load).

Where profiling lives, end to end: ``server/profiles.py`` (StartProfile's checks and plan,
the profile registry, DownloadProfile), ``server/cache_profile_service.py`` (the RPCs),
``server/trace_merge.py`` (one merged trace of all ranks), ``scheduler/profiling/control.py``
(the rank's handlers), ``scheduler/profiling/profiler.py`` (the per-rank state machine), this module
(writing the files), ``scheduler/profiling/trace_export.py`` and ``scheduler/profiling/trace_join.py`` (the
child processes that write and join traces), and ``sglang_admin/constants.py`` (the file
names both processes agree on).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sglang_admin.messages import ProfileStopResult
from sglang_admin.scheduler.profiling import trace_export, trace_join

logger = logging.getLogger(__name__)


def free_session(prof: Any) -> None:
    """Let refcounting free a stopped session's recorded events as soon as its last
    reference goes: ``torch.profiler.profile`` keeps itself in a reference cycle (its
    ``action_map`` holds its own bound methods), and the full ``gc.collect()`` that frees
    such a cycle holds a rank's GIL for ~0.3 s (its loop and heartbeat stop meanwhile)."""
    action_map = getattr(prof, "action_map", None)
    if isinstance(action_map, dict):
        action_map.clear()


def _release_memory() -> None:
    """Give the memory of finished traces back to the system: their events are freed (see
    :func:`free_session`), but glibc keeps the pages in its arenas, which over many sessions
    reads as a leak in the rank's RSS. (ctypes releases the GIL for the call.)"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def part_path(final: str, index: int) -> str:
    """A hidden plain-JSON file for segment ``index`` of the trace ``final``."""
    head, name = os.path.split(final)
    return os.path.join(head, f".{name.removesuffix('.gz')}.part{index}")


def remove_files(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path)


def join_traces(parts: list[str], out: str) -> None:
    """Join the segments' traces into ``out`` in a child process (see trace_join): parsing
    a segment's JSON holds the GIL for seconds, which would stop this rank's loop thread
    (no step, no HealthCheck answer) for as long."""
    done = subprocess.run(
        [sys.executable, trace_join.__file__, out, *parts],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeError(f"joining {len(parts)} trace segments failed: {tail}")


@dataclass
class ProfileRun:
    """What one profile produced; written by the export thread (under the exporter's lock)."""

    profile_id: str
    output_dir: str
    max_bytes: int  # this rank's share of the profile's size cap (0: none)
    files: list[str] = field(default_factory=list)
    bytes_written: int = 0
    errors: list[str] = field(default_factory=list)
    steps: int = 0  # forward steps recorded while running (the --profile-max-steps cap)


class TraceExporter:
    """The export thread of one rank and the bookkeeping of what it wrote."""

    def __init__(self, rank: int) -> None:
        self.lock = threading.Lock()
        self.pending_jobs = 0  # export-thread jobs queued or running
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"profile-export-{rank}")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) on the export thread, counted in ``pending_jobs``."""
        with self.lock:
            self.pending_jobs += 1

        def job() -> Any:
            try:
                return fn(*args)
            finally:
                with self.lock:
                    self.pending_jobs -= 1

        return self.pool.submit(job)

    def hold(self) -> None:
        """Count work done elsewhere for a finished profile (another node's traces still on
        their way) as pending: the rank reports ``exporting`` until :meth:`release`."""
        with self.lock:
            self.pending_jobs += 1

    def release(self) -> None:
        """The end of what :meth:`hold` counted."""
        with self.lock:
            self.pending_jobs -= 1

    def failed(self, run: ProfileRun) -> bool:
        with self.lock:
            return bool(run.errors)

    def record_error(self, run: ProfileRun, text: str) -> None:
        with self.lock:
            run.errors.append(text)

    def result(self, run: ProfileRun, what: str) -> tuple[bool, str, ProfileStopResult]:
        """(Export thread, after the run's exports) the answer to a StopProfile."""
        with self.lock:
            files, errors = list(run.files), list(run.errors)
        data = ProfileStopResult(files, run.profile_id)
        if errors:
            return False, "; ".join(errors), data
        return True, f"{what}: {len(files)} file(s) written to {run.output_dir}", data

    def files_when_done(self, run: ProfileRun) -> list[str]:
        """(Export thread) the run's files, once what was queued before is written."""
        with self.lock:
            if run.errors:
                logger.warning("profile %s: %s", run.profile_id, "; ".join(run.errors))
            return list(run.files)

    def export_part(self, run: ProfileRun, prof: Any, part: str) -> None:
        """(Export thread) write one finished segment's trace (plain JSON)."""
        try:
            trace_export.export_chrome_trace(prof, part)
        except Exception as exc:  # noqa: BLE001
            logger.exception("profile %s: export failed", run.profile_id)
            self.record_error(run, f"export failed: {type(exc).__name__}: {exc}")
        finally:
            free_session(prof)
            _release_memory()

    def export(
        self, run: ProfileRun, prof: Any, path: str, parts: list[str], snapshot: str | None
    ) -> None:
        """(Export thread) write a stopped session's trace, joining its earlier segments,
        and account its files."""
        t0 = time.perf_counter()
        try:
            if prof is not None and not self.failed(run):
                if parts:
                    last = part_path(path, len(parts))
                    trace_export.export_chrome_trace(prof, last)
                    join_traces([*parts, last], path)
                else:
                    trace_export.export_chrome_trace(prof, path)
                self._account(run, path)
            if snapshot is not None:
                self._account(run, snapshot)
        except Exception as exc:  # a failed export must not kill the rank
            logger.exception("profile %s: export failed", run.profile_id)
            self.record_error(run, f"export failed: {type(exc).__name__}: {exc}")
        finally:
            if prof is not None:
                free_session(prof)
            remove_files([*parts, part_path(path, len(parts))])
            _release_memory()
        logger.info("profile %s: %s written in %.2fs", run.profile_id, os.path.basename(path),
                    time.perf_counter() - t0)

    def _account(self, run: ProfileRun, path: str) -> None:
        """Count a written file against the cap; over it: remove the file, record why."""
        size = os.path.getsize(path)
        cap = run.max_bytes
        with self.lock:
            if cap and run.bytes_written + size > cap:
                os.remove(path)
                run.errors.append(
                    f"profile size cap reached: {os.path.basename(path)} ({size} bytes) would "
                    f"take this rank to {run.bytes_written + size} bytes, over its cap of {cap} "
                    "bytes; the file was removed and profiling stopped"
                )
                return
            run.bytes_written += size
            run.files.append(path)
