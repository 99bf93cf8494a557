"""The entry points of the processes the server spawns (scheduler ranks, TP followers).

A spawned process imports the module of its target before it runs it: kept here, away from
``server/launch.py``, a rank does not import grpc and the server's modules it never uses
(~0.5 s of CPU per rank start), and the server process does not import the scheduler (and
with it torch: ``tests/unit/test_server_imports.py``)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_admin.config import ServerArgs


def run_rank(args: ServerArgs, rank: int, parent_pid: int) -> None:
    """A rank process's entry point: the scheduler (and with it torch) is imported there,
    never in the server's process, which would carry torch's ~190 MiB for nothing. A rank
    that stopped exits without the interpreter's teardown (scheduler/rank/lifetime.py)."""
    from sglang_admin.scheduler.rank.lifetime import run_then_exit
    from sglang_admin.scheduler.rank.process import run_scheduler

    run_then_exit(functools.partial(run_scheduler, args, rank, parent_pid))


def run_tp_follower(args: ServerArgs, dp_rank: int, tp_rank: int, parent_pid: int) -> None:
    """A TP follower's entry point (--tp-size > 1; scheduler/tp/worker.py)."""
    from sglang_admin.scheduler.rank.lifetime import run_then_exit
    from sglang_admin.scheduler.tp.worker import run_follower

    run_then_exit(functools.partial(run_follower, args, dp_rank, tp_rank, parent_pid))
