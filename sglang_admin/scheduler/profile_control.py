"""Rank-side handlers of StartProfile and StopProfile (the Profiler does the work).

Profiling is spread over several modules; their map is in ``scheduler/profile_export.py``'s
docstring.
"""

from __future__ import annotations

from sglang_admin.messages import StartProfileReq, StopProfileReq
from sglang_admin.scheduler.control import Rank


def on_start(rank: Rank, msg: StartProfileReq) -> None:
    ok, text = rank.profiler.start(msg)
    rank.reply(msg, ok, text)


def on_stop(rank: Rank, msg: StopProfileReq) -> None:
    """The traces are written by the profiler's export thread: the loop keeps serving and
    answers once they are on disk."""
    rank.reply_when_done(msg, rank.profiler.request_stop())


HANDLERS = {StartProfileReq: on_start, StopProfileReq: on_stop}
