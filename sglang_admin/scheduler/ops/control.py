"""Rank-side control: every message type has one handler, in the module of its domain.

The rank loop (scheduler/rank/process.py) looks each message's type up in one table built from
the ``HANDLERS`` of this module (state, cancel, shutdown) and of the domain modules:
generation (requests, aborts, pause), cache (flush), profile, weights. A handler gets the :class:`Rank` it runs
on and the message; it answers an admin message exactly once, now (:meth:`Rank.reply`),
when a future resolves (:meth:`Rank.reply_when_done`), or from a callback that the rank's
:class:`~sglang_admin.scheduler.ops.quiesce.Quiesce` runs once the rank is drained.

Adding a rank-side op (a message in messages/types.py and in the codec's registry in
messages/codec.py, a handler in its domain module's ``HANDLERS``; nothing in the loop
changes): the recipe is in CONTRIBUTING.md.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from sglang_admin.config import ServerArgs
from sglang_admin.messages import (
    CancelAdminReq,
    ModelInfo,
    RankState,
    ShutdownReq,
    StateReq,
)
from sglang_admin.scheduler.ops.quiesce import Quiesce
from sglang_admin.scheduler.profiling.profiler import Profiler
from sglang_admin.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from sglang_admin.model.runner import ModelRunner
    from sglang_admin.scheduler.ops.weight_groups import WeightGroups


class Rank(Protocol):
    """What a handler may use of the rank it runs on."""

    rank: int
    args: ServerArgs
    scheduler: Scheduler
    runner: ModelRunner
    profiler: Profiler
    quiesce: Quiesce
    model_info: ModelInfo
    weights_source: str | None  # the checkpoint the live weights came from (None: tensors)
    weights_valid: bool  # False after an update that failed part-way
    released_digest: str | None  # digest of the weights while they are released (else None)
    weight_sync: WeightGroups  # a trainer's process groups
    trace_ids: dict[str, str]  # request id -> its caller's trace id (--log-requests)
    running: bool

    def reply(self, msg: Any, ok: bool, text: str = "", result: Any = None) -> None: ...

    def reply_when_done(self, msg: Any, future: Future) -> None: ...

    def state(self) -> RankState: ...

    def publish_state(self, force: bool = False) -> None: ...

    def flush_kv_events(self) -> None: ...

    def together(self) -> AbstractContextManager[None]:
        """Messages sent inside leave as one ZMQ message (its parts, in order)."""
        ...


Handler = Callable[[Rank, Any], None]


def on_state(rank: Rank, msg: StateReq) -> None:
    rank.reply(msg, True, "", rank.state())


def on_cancel(rank: Rank, msg: CancelAdminReq) -> None:
    """The server ended admin call ``rid`` without this rank's answer: an op still waiting
    for it (a flush or weight update waiting for idle) is dropped; admission resumes."""
    if rank.quiesce.cancel(msg.rid):
        rank.publish_state(force=True)


def on_shutdown(rank: Rank, msg: ShutdownReq) -> None:
    rank.running = False


HANDLERS = {StateReq: on_state, CancelAdminReq: on_cancel, ShutdownReq: on_shutdown}


def op_name(msg: Any) -> str:
    """The op a message asks for, as logged and traced: FlushCacheReq -> flush_cache."""
    return _op_name(type(msg))


@functools.cache
def _op_name(cls: type) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.removesuffix("Req")).lower()
