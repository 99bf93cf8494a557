"""Profiles across the TP ranks of a replica (--tp-size > 1): every TP rank records its own
trace, named ``{id}-TP-{tp}[-DP-{dp}]`` as SGLang names them.

TP rank 0's StartProfile and StopProfile go to its followers first (:func:`start_on_followers`,
:func:`stop_on_followers`). A follower's :class:`FollowerProfiler` counts the same forward
steps as rank 0's profiler (each step rank 0 broadcasts, counted once however often a step
is resent, with the stage its batch has), so start_step, num_steps, the per-stage sessions and the step cap end on the same step
everywhere. StopProfile answers once rank 0's files are written and every follower has
handed over its own (the follower's export runs on its export thread, as rank 0's does).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from sglang_admin.messages import ProfileStopResult, StartProfileReq
from sglang_admin.model.step_io import SeqInput
from sglang_admin.scheduler.profiling.profiler import Profiler
from sglang_admin.scheduler.tp.weights import Followers

logger = logging.getLogger(__name__)

PROFILE_START, PROFILE_STOP, PROFILE_COLLECT = "profile-start", "profile-stop", "profile-collect"
PROFILE_COMMANDS = frozenset({PROFILE_START, PROFILE_STOP, PROFILE_COLLECT})
EXPORT_WAIT_S = 600.0  # a follower's traces are written by then, or the stop reports it


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
            for tp_rank, (their_ok, why, their) in enumerate(theirs, start=1):
                if isinstance(their, ProfileStopResult):
                    files.extend(their.files)
                if ok and not their_ok:
                    ok, text = False, f"TP rank {tp_rank}: {why}"
            profile_id = found.profile_id if isinstance(found, ProfileStopResult) else ""
            self._answer = ok, text, ProfileStopResult(files, profile_id)
        return self._answer


def stop_on_followers(followers: Followers, own: Future) -> Future:
    """The followers stop too; the Future of the replica's (ok, text, every TP rank's files)."""
    followers.send(PROFILE_STOP)
    return _JoinedStop(own, followers)


class FollowerProfiler:
    """A follower's profiler, driven by rank 0's commands and its steps."""

    def __init__(self, profiler: Profiler) -> None:
        self.profiler = profiler
        self.stopping: Future | None = None  # the last StopProfile's files

    def handle(self, command: tuple, gather: Any) -> None:
        """One of :data:`PROFILE_COMMANDS`; ``gather`` hands this rank's answer to rank 0."""
        kind = command[0]
        if kind == PROFILE_START:
            gather(self.profiler.start(command[1]))
        elif kind == PROFILE_STOP:
            self.stopping = self.profiler.request_stop()
        elif kind == PROFILE_COLLECT:
            gather(self._stopped())

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
