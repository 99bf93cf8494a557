"""Rank-side handler of FlushCache, with SGLang's semantics.

The flush runs only on a drained rank: nothing running (queued requests hold no KV; a
pause in ``retract`` mode leaves only queued ones). ``timeout_s <= 0``: one attempt,
"pending requests" when busy. ``timeout_s > 0``: the rank's Quiesce holds admission and
runs the flush once the running requests finish, or gives up at the smaller of
``timeout_s`` and the caller's deadline (the server cancels it at that deadline, so an
abandoned flush never blocks admission for long). One pending flush at a time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sglang_admin.messages import FlushCacheReq, FlushResult
from sglang_admin.scheduler.ops.registry import handles

if TYPE_CHECKING:
    from sglang_admin.scheduler.rank.loop import Rank

# The rank's flush gives up this long after the caller's deadline: the server answers
# DEADLINE_EXCEEDED first and cancels the flush; this only covers a cancel that never came.
FLUSH_DEADLINE_GRACE_S = 0.5
OP = "flush_cache"


@handles(FlushCacheReq)
def on_flush(rank: Rank, msg: FlushCacheReq) -> None:
    if rank.quiesce.waiting(OP):
        rank.reply(msg, False, "Another flush_cache is already in progress.")
        return
    s = rank.scheduler
    drained = not s.running and (not s.waiting or s.paused is not None)
    if drained and not rank.quiesce.pending:  # nothing waits before it: flush now
        flush(rank, msg)
        return
    if drained or msg.timeout_s > 0:
        wait = msg.timeout_s
        if msg.deadline is not None:
            wait = min(wait, msg.deadline - time.time() + FLUSH_DEADLINE_GRACE_S)
        rank.quiesce.when_drained(
            msg.rid, OP, wait, lambda: flush(rank, msg),
            lambda reason: rank.reply(msg, False, reason),
        )
        if rank.quiesce.waiting(OP):  # pending: GetLoads and GetServerInfo show it
            rank.publish_state(force=True)
        return
    rank.reply(msg, False, busy_message(rank))


def busy_message(rank: Rank) -> str:
    s = rank.scheduler
    return ("Cache not flushed because there are pending requests. "
            f"#queue-req: {len(s.waiting)}, #running-req: {len(s.running)}")


def flush(rank: Rank, msg: FlushCacheReq) -> None:
    """Flush now if nothing runs (a pause in place keeps requests running: refused)."""
    if rank.scheduler.running:
        rank.reply(msg, False, busy_message(rank))
        return
    with rank.together():  # "cleared", the state and the answer: one write to the server
        freed = flush_now(rank)
        rank.reply(msg, True, "Cache flushed successfully", FlushResult(freed))


def flush_now(rank: Rank) -> int:
    """Reset the radix cache, the pool and the request table; tokens freed."""
    freed = rank.scheduler.flush()
    rank.runner.reset()
    rank.flush_kv_events()  # "cleared" reaches subscribers before the flush's answer
    # the freed state too (GetLoads shows it once FlushCache returned); the answer goes
    # last, so that the rank's I/O thread, not more of its own work, runs right after it
    rank.publish_state(force=True)
    return freed
