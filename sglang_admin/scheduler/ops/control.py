"""The rank's own control messages: its state, the cancel of an admin call, shutdown.

Every control message has one handler, in the ops module of its domain (generation, cache,
weights, weight sync, LoRA; profiling's in scheduler/profiling/control.py), registered with
``@handles(MessageType)`` (scheduler/ops/registry.py). A handler gets the
:class:`~sglang_admin.scheduler.rank.loop.Rank` it runs on and the message; it answers an
admin message exactly once, now (``rank.reply``), when a future resolves
(``rank.reply_when_done``), or from a callback that the rank's
:class:`~sglang_admin.scheduler.ops.quiesce.Quiesce` runs once the rank is drained. Adding an
op: the recipe is in CONTRIBUTING.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_admin.messages import CancelAdminReq, ShutdownReq, StateReq
from sglang_admin.scheduler.ops.registry import handles

if TYPE_CHECKING:
    from sglang_admin.scheduler.rank.loop import Rank


@handles(StateReq)
def on_state(rank: Rank, msg: StateReq) -> None:
    rank.reply(msg, True, "", rank.state())


@handles(CancelAdminReq)
def on_cancel(rank: Rank, msg: CancelAdminReq) -> None:
    """The server ended admin call ``rid`` without this rank's answer: an op still waiting
    for it (a flush or weight update waiting for idle) is dropped; admission resumes."""
    if rank.quiesce.cancel(msg.rid):
        rank.publish_state(force=True)


@handles(ShutdownReq)
def on_shutdown(rank: Rank, msg: ShutdownReq) -> None:
    rank.running = False


