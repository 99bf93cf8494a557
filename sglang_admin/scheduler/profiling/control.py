"""Rank-side handlers of StartProfile and StopProfile (the Profiler does the work).

Profiling is spread over several modules; their map is in ``scheduler/profiling/export.py``'s
docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_admin.messages import StartProfileReq, StopProfileReq
from sglang_admin.scheduler.ops.registry import handles
from sglang_admin.scheduler.tp.profile import start_on_followers, stop_on_followers
from sglang_admin.scheduler.tp.weights import followers_of

if TYPE_CHECKING:
    from sglang_admin.scheduler.rank.loop import Rank


@handles(StartProfileReq)
def on_start(rank: Rank, msg: StartProfileReq) -> None:
    ok, text = rank.profiler.start(msg)
    followers = followers_of(rank.runner)
    if followers is not None:  # --tp-size > 1: every TP rank records its own trace
        ok, text = start_on_followers(followers, msg, ok, text)
    rank.reply(msg, ok, text)


@handles(StopProfileReq)
def on_stop(rank: Rank, msg: StopProfileReq) -> None:
    """The traces are written by the profiler's export thread: the loop keeps serving and
    answers once they are on disk."""
    stopped = rank.profiler.request_stop()
    followers = followers_of(rank.runner)
    if followers is not None:  # the answer lists every TP rank's files
        stopped = stop_on_followers(followers, stopped)
    rank.reply_when_done(msg, stopped)
