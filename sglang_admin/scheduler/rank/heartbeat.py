"""A rank's heartbeat: a thread that tells the server, every fraction of
--watchdog-probe-timeout, that the process is alive and whether it is inside a forward step.

The thread has its own ZMQ socket (sockets are not shared between threads). It keeps
beating while the main thread runs a long step (torch releases the GIL while it computes),
so a slow but progressing step is told apart from a process that stopped (SIGSTOP, a
frozen host): that one sends nothing at all.
"""

from __future__ import annotations

import threading
from typing import Protocol

import zmq

from sglang_admin.config import ServerArgs
from sglang_admin.messages import Heartbeat, encode

MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 1.0


class StepClock(Protocol):
    """What the heartbeat reads of its rank (the main thread writes both)."""

    step_started: float  # wall time the current forward step began; 0 outside a step
    forward_steps: int
    state_confirmed: float  # wall time the loop last checked the state the server has


def beat_interval(args: ServerArgs) -> float:
    """Five beats per probe timeout, within [50 ms, 1 s]."""
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, args.watchdog_probe_timeout_s / 5))


class HeartbeatThread(threading.Thread):
    """Sends :class:`Heartbeat` for ``rank`` until :meth:`stop`."""

    def __init__(self, ctx: zmq.Context, args: ServerArgs, rank: int, clock: StepClock,
                 tp_rank: int = 0) -> None:
        super().__init__(name=f"heartbeat-rank{rank}", daemon=True)
        self.rank = rank
        self.tp_rank = tp_rank  # a TP follower's beats name it (scheduler/tp/worker.py)
        self.clock = clock
        self.interval = beat_interval(args)
        self.stopped = threading.Event()
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 4)  # beats nobody reads are not worth queueing
        self.sock.connect(args.server_addr)

    def run(self) -> None:
        try:
            while not self.stopped.wait(self.interval):
                clock = self.clock
                beat = Heartbeat(self.rank, clock.step_started, clock.forward_steps,
                                 clock.state_confirmed, self.tp_rank)
                try:
                    self.sock.send(encode(beat), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            self.sock.close(linger=0)

    def stop(self) -> None:
        """End the thread and close its socket (before the context is terminated)."""
        self.stopped.set()
        self.join(timeout=2)
