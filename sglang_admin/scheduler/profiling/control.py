"""Rank-side handlers of StartProfile and StopProfile (the Profiler does the work).

Profiling is spread over several modules; their map is in ``scheduler/profiling/export.py``'s
docstring.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from sglang_admin.messages import StartProfileReq, StopProfileReq
from sglang_admin.scheduler import late_imports
from sglang_admin.scheduler.ops.registry import handles
from sglang_admin.scheduler.tp.profile import start_on_followers, stop_on_followers
from sglang_admin.scheduler.tp.weights import followers_of

if TYPE_CHECKING:
    from sglang_admin.scheduler.rank.loop import Rank


@handles(StartProfileReq)
def on_start(rank: Rank, msg: StartProfileReq) -> None:
    """torch.profiler's start needs the rank's late imports: before they are done the start
    waits for them off the loop (the loop keeps serving and answering health probes) and is
    answered once it has run."""
    if late_imports.pending():
        late_imports.start_now()
        rank.deferred.append((msg, _StartWhenImported(rank, msg)))
        return
    ok, text = _start(rank, msg)
    rank.reply(msg, ok, text)


def _start(rank: Rank, msg: StartProfileReq) -> tuple[bool, str]:
    ok, text = rank.profiler.start(msg)
    followers = followers_of(rank.runner)
    if followers is not None:  # --tp-size > 1: every TP rank records its own trace
        ok, text = start_on_followers(followers, msg, ok, text)
    return ok, text


class _StartWhenImported(Future):
    """A StartProfile that came before the late imports were done: started on the loop's
    thread (``answer_deferred`` asks ``done()`` there) once they are."""

    def __init__(self, rank: Rank, msg: StartProfileReq) -> None:
        super().__init__()
        self._rank, self._msg = rank, msg

    def done(self) -> bool:
        if not super().done() and late_imports.imported():
            try:
                ok, text = _start(self._rank, self._msg)
            except Exception as exc:  # noqa: BLE001 - answered as the start's failure
                self.set_exception(exc)
            else:
                self.set_result((ok, text, None))
        return super().done()


@handles(StopProfileReq)
def on_stop(rank: Rank, msg: StopProfileReq) -> None:
    """The traces are written by the profiler's export thread: the loop keeps serving and
    answers once they are on disk."""
    stopped = rank.profiler.request_stop()
    followers = followers_of(rank.runner)
    if followers is not None:  # the answer lists every TP rank's files
        stopped = stop_on_followers(followers, stopped)
    rank.reply_when_done(msg, stopped)
