"""One scheduler rank as a process: its signals, its sockets to the server, its heartbeat,
its Rank built and run, and a one-line reason sent to the server when it cannot start."""

from __future__ import annotations

import logging
import signal
import sys

import zmq

from sglang_admin.config import ServerArgs
from sglang_admin.logging_utils import setup_logging
from sglang_admin.messages import FailedMsg, encode
from sglang_admin.scheduler.ops.registry import HANDLERS, Handler
from sglang_admin.scheduler.rank.heartbeat import HeartbeatThread
from sglang_admin.scheduler.rank.lifetime import die_with_parent
from sglang_admin.scheduler.rank.loop import Rank

logger = logging.getLogger(__name__)


def handler_table() -> dict[type, Handler]:
    """Message type -> the rank's handler: every ops module registers its handlers with
    ``@handles`` (scheduler/ops/registry.py) when it is imported."""
    from sglang_admin.scheduler.ops import (  # noqa: F401 - imported for their handlers
        cache_control,
        control,
        generation_control,
        lora_control,
        weight_control,
        weight_sync_control,
    )
    from sglang_admin.scheduler.profiling import control as profile_control  # noqa: F401

    return dict(HANDLERS)


def run_scheduler(args: ServerArgs, rank: int, parent_pid: int) -> None:
    """Entry point of a scheduler process (spawned by the server)."""
    die_with_parent()
    # The server decides when we stop: a terminal's Ctrl-C (SIGINT to the process group) or
    # a supervisor that signals the whole group (systemd's KillMode=control-group sends
    # SIGTERM to every process) must not cut the streams the server is draining. The server
    # sends ShutdownReq; PR_SET_PDEATHSIG covers a server that dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(args.log_level, prefix=f"rank{rank}")
    ctx = zmq.Context(1)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(args.scheduler_addr(rank))
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(args.server_addr)
    try:
        loop = Rank(args, rank, inbox, outbox, parent_pid, handler_table())
    except Exception as exc:  # report a one-line reason to the server, then exit
        logger.error("rank %d failed to start: %s: %s", rank, type(exc).__name__, exc)
        logger.debug("rank %d start-up traceback", rank, exc_info=True)
        outbox.send(encode(FailedMsg(rank, f"{type(exc).__name__}: {exc}")))
        outbox.close(linger=2000)
        sys.exit(1)
    heartbeat = HeartbeatThread(ctx, args, rank, loop)
    heartbeat.start()
    try:
        loop.run()
        if loop.tensor_parallel is not None:  # a clean stop: the TP followers stop too
            loop.runner.stop_followers()
    finally:
        heartbeat.stop()
        loop.weight_sync.close()  # leave the trainers' process groups
        if loop.scheduler.grammar_queue is not None:
            loop.scheduler.grammar_queue.shutdown()
    # The loop ends on ShutdownReq (sent as the server closes its inbox) or when the server
    # is gone: nobody is left to read pending outputs, so do not linger on them.
    outbox.close(linger=0)
    inbox.close(linger=0)
    ctx.term()
