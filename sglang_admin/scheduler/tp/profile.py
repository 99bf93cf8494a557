"""Profiles across the TP ranks of a replica (--tp-size > 1): every TP rank records its own
trace, named ``{id}-TP-{tp}[-DP-{dp}]`` as SGLang names them.

TP rank 0's StartProfile and StopProfile go to its followers first (:func:`start_on_followers`,
:func:`stop_on_followers`). A follower's :class:`FollowerProfiler` counts the same forward
steps as rank 0's profiler (each step rank 0 broadcasts, counted once however often a step
is resent, with the stage its batch has), so start_step, num_steps, the per-stage sessions and the step cap end on the same step
everywhere. StopProfile answers once rank 0's files are written and every follower has
handed over its own (the follower's export runs on its export thread, as rank 0's does).
Across nodes (--nnodes > 1) a follower on another node sends its traces to node 0 with
that answer; a profile that ends by itself (num_steps, the step cap) has no StopProfile,
so once rank 0's own traces are written its loop asks those followers for theirs
(:func:`remote_trace_shipment`), and reports ``exporting`` until they are beside its own.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from sglang_admin.messages import ProfileStopResult, StartProfileReq
from sglang_admin.model.step_io import SeqInput

if TYPE_CHECKING:
    from sglang_admin.scheduler.profiling.profiler import Profiler
    from sglang_admin.scheduler.tp.weights import Followers

logger = logging.getLogger(__name__)

PROFILE_START, PROFILE_STOP, PROFILE_COLLECT = "profile-start", "profile-stop", "profile-collect"
PROFILE_SHIP = "profile-ship"  # a profile ended by itself: the remote traces, to node 0
PROFILE_COMMANDS = frozenset({PROFILE_START, PROFILE_STOP, PROFILE_COLLECT, PROFILE_SHIP})
EXPORT_WAIT_S = 600.0  # a follower's traces are written by then, or the stop reports it
SHIP_MAX_BYTES = 512 << 20  # a remote follower's traces sent to node 0, at most this much
_TRACE_NAME = re.compile(r"^[\w.+-]+\.trace\.json\.gz$")


def step_stage(seqs: list[SeqInput]) -> str:
    """The stage of a step's batch, as the scheduler's Batch.is_decode decides it."""
    decode = all(len(s.token_ids) == 1 and s.prefix_len > 0 for s in seqs)
    return "decode" if decode else "prefill"


def start_on_followers(followers: Followers, msg: StartProfileReq, ok: bool,
                       text: str) -> tuple[bool, str]:
    """Rank 0 started (or refused) ``msg`` with (ok, text): the followers do the same, and
    the replica's answer is rank 0's unless a follower refused."""
    followers.send(PROFILE_START, msg)
    for tp_rank, (their_ok, why) in enumerate(followers.gather((ok, text))[1:], start=1):
        if ok and not their_ok:
            return False, f"TP rank {tp_rank}: {why}"
    return ok, text


class _JoinedStop(Future):
    """Rank 0's stop, answered with every follower's files once rank 0's are written (read
    on the rank loop's thread, where the followers are asked)."""

    def __init__(self, own: Future, followers: Followers) -> None:
        super().__init__()
        self._followers = followers
        self._answer: tuple[bool, str, Any] | None = None
        own.add_done_callback(self._settle)

    def _settle(self, own: Future) -> None:
        try:
            self.set_result(own.result())
        except BaseException as exc:  # noqa: BLE001 - delivered to the loop, never lost
            self.set_result((False, f"{type(exc).__name__}: {exc}", None))

    def result(self, timeout: float | None = None) -> tuple[bool, str, Any]:
        if self._answer is None:
            ok, text, found = super().result(timeout)
            self._followers.send(PROFILE_COLLECT)
            theirs = self._followers.gather(None)[1:]
            files = list(found.files) if isinstance(found, ProfileStopResult) else []
            here = os.path.dirname(files[0]) if files else ""
            for tp_rank, answer in enumerate(theirs, start=1):
                their_ok, why, their = answer[:3]
                if isinstance(their, ProfileStopResult):
                    files.extend(their.files)
                if len(answer) > 3 and here:  # a follower on another node: its traces
                    problem = _store_shipped(here, answer[3])
                    if problem:
                        their_ok, why = False, problem
                if ok and not their_ok:
                    ok, text = False, f"TP rank {tp_rank}: {why}"
            profile_id = found.profile_id if isinstance(found, ProfileStopResult) else ""
            self._answer = ok, text, ProfileStopResult(files, profile_id)
        return self._answer


def _store_shipped(directory: str, shipped: dict[str, bytes]) -> str:
    """Write a remote follower's traces (``{file name: bytes}``) into ``directory``, where
    this node's own traces of the profile are, so DownloadProfile and a merge find them
    there; "" or why a file was refused. Only a plain trace file name is taken (no path)."""
    for name, data in shipped.items():
        if not (isinstance(name, str) and _TRACE_NAME.match(name) and isinstance(data, bytes)):
            return f"a shipped trace named {name!r} was refused"
        path = os.path.join(directory, name)
        tmp = f"{path}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            return f"its trace {name} could not be written on node 0: {exc.strerror or exc}"
    return ""


def _read_traces(files: list[str]) -> dict[str, bytes] | str:
    """The traces this rank wrote, by file name, to send to node 0; or why not."""
    out: dict[str, bytes] = {}
    total = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                data = f.read(SHIP_MAX_BYTES - total + 1)
        except OSError as exc:
            return f"its trace {path} cannot be read: {exc.strerror or exc}"
        total += len(data)
        if total > SHIP_MAX_BYTES:
            return f"its traces are over {SHIP_MAX_BYTES >> 20} MiB: left on its node"
        out[os.path.basename(path)] = data
    return out


class _ShipAfterAutoStop(Future):
    """Rank 0's profile ended by itself: once its own traces are written (``own``, the
    Future of their paths), the followers on other nodes send theirs, written beside them.
    Read on the rank loop's thread (``answer_deferred``), where the followers are asked;
    the exporter counts it as pending until then."""

    def __init__(self, own: Future, followers: Followers, exporter: Any) -> None:
        super().__init__()
        self._followers = followers
        self._exporter = exporter
        self._answer: tuple[bool, str, Any] | None = None
        exporter.hold()
        own.add_done_callback(self._settle)

    def _settle(self, own: Future) -> None:
        try:
            self.set_result(list(own.result()))
        except BaseException as exc:  # noqa: BLE001 - its own log says why; nothing to put
            self.set_result(exc)      # the remote traces beside

    def result(self, timeout: float | None = None) -> tuple[bool, str, Any]:
        if self._answer is None:
            try:
                self._answer = self._ship(super().result(timeout))
            finally:
                self._exporter.release()
        return self._answer

    def _ship(self, own: list[str] | BaseException) -> tuple[bool, str, Any]:
        self._followers.send(PROFILE_SHIP)
        theirs = self._followers.gather(None)[1:]
        here = os.path.dirname(own[0]) if isinstance(own, list) and own else ""
        problems, stored = [], 0
        for tp_rank, answer in enumerate(theirs, start=1):
            if isinstance(answer, dict):
                problem = (_store_shipped(here, answer) if here else
                           "TP rank 0 wrote no trace of this profile to put its traces beside")
                stored += 0 if problem else len(answer)
            else:
                problem = answer  # None: on node 0, its traces are there already
            if problem:
                problems.append(f"{self._followers.tp.name(tp_rank)}: {problem}")
        text = f"{stored} trace(s) of other nodes written to {here or '(nowhere)'}"
        if problems:
            text += f"; not all: {'; '.join(problems)}"
            logger.warning("profile finished by itself: %s", text)
        else:
            logger.info("profile finished by itself: %s", text)
        return not problems, text, None


def remote_trace_shipment(runner: Any, finished: Future, exporter: Any) -> Future | None:
    """TP rank 0's profile ended by itself (``finished``: the Future of its trace paths):
    when followers run on other nodes, the Future that brings their traces beside rank 0's
    once those are written, for the loop's deferred list (nothing to answer: the outcome is
    logged); None when every TP rank is on this node."""
    from sglang_admin.scheduler.tp.weights import followers_of

    followers = followers_of(runner)
    if followers is None:
        return None
    tp = followers.tp
    if tp.ranks_per_node and tp.size > tp.ranks_per_node:
        return _ShipAfterAutoStop(finished, followers, exporter)
    return None


def stop_on_followers(followers: Followers, own: Future) -> Future:
    """The followers stop too; the Future of the replica's (ok, text, every TP rank's files)."""
    followers.send(PROFILE_STOP)
    return _JoinedStop(own, followers)


class FollowerProfiler:
    """A follower's profiler, driven by rank 0's commands and its steps."""

    def __init__(self, profiler: Profiler, ship: bool = False) -> None:
        """``ship``: this rank is on another node than TP rank 0 (--nnodes > 1): its
        traces go to node 0 with its answer, where DownloadProfile reads them."""
        self.profiler = profiler
        self.ship = ship
        self.stopping: Future | None = None  # the last StopProfile's files
        # the paths of each profile that ended by itself, oldest first, until node 0 asks
        self.finished: list[Future] = []

    def handle(self, command: tuple, gather: Any) -> None:
        """One of :data:`PROFILE_COMMANDS`; ``gather`` hands this rank's answer to rank 0."""
        kind = command[0]
        if kind == PROFILE_START:
            gather(self.profiler.start(command[1]))
        elif kind == PROFILE_STOP:
            self.stopping = self.profiler.request_stop()
        elif kind == PROFILE_COLLECT:
            answer = self._stopped()
            if self.ship and isinstance(answer[2], ProfileStopResult):
                traces = _read_traces(answer[2].files)
                if isinstance(traces, str):
                    answer = (False, traces, answer[2])
                else:
                    answer = (*answer, traces)
            gather(answer)
        elif kind == PROFILE_SHIP:
            gather(self._finished_traces())

    def _finished_traces(self) -> dict[str, bytes] | str | None:
        """For :data:`PROFILE_SHIP`: this remote rank's traces of the profile that ended by
        itself, or why not; None on node 0 (nothing to send)."""
        if not self.ship:
            return None
        if not self.finished:
            return "its profile did not end by itself on the step rank 0's did"
        fut = self.finished.pop(0)
        try:
            return _read_traces(list(fut.result(EXPORT_WAIT_S)))
        except FutureTimeout:
            return f"its traces were not written within {EXPORT_WAIT_S:.0f}s"
        except Exception as exc:  # noqa: BLE001 - reported to TP rank 0, which logs it
            return f"{type(exc).__name__}: {exc}"

    def _stopped(self) -> tuple[bool, str, ProfileStopResult | None]:
        fut, self.stopping = self.stopping, None
        if fut is None:
            return False, "no StopProfile reached this rank", None
        try:
            return fut.result(EXPORT_WAIT_S)
        except FutureTimeout:
            return False, f"its traces were not written within {EXPORT_WAIT_S:.0f}s", None
        except Exception as exc:  # noqa: BLE001 - reported to TP rank 0, which answers
            return False, f"{type(exc).__name__}: {exc}", None

    def before_step(self, stage: str) -> None:
        self.profiler.before_step(stage)

    def after_step(self, stage: str) -> None:
        finished = self.profiler.after_step(stage)
        if finished is not None:
            finished.add_done_callback(
                lambda fut: logger.info("profile finished by itself: %s", fut.result()))
            if self.ship:  # node 0 asks for its traces (PROFILE_SHIP)
                self.finished.append(finished)
