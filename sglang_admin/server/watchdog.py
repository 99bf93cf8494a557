"""The watchdog: a rank that stops making progress fails the server, as a dead rank does.

Every rank's heartbeat thread (scheduler/rank/heartbeat.py) beats a few times per
``--watchdog-probe-timeout`` and says whether the rank is inside a forward step (at
--tp-size > 1 every TP follower beats too, and a silent one makes its replica stuck). A
rank is stuck when

- no heartbeat arrived for ``--watchdog-probe-timeout`` seconds: the process is stopped
  (SIGSTOP) or frozen, busy or idle alike; or
- one forward step has lasted more than ``--watchdog-timeout`` seconds (SGLang's flag,
  default 300): a hung device or kernel. A long step that ends in time is never flagged.

A 0 turns either check off. The server's answer to a stuck rank is in server/launch.py:
NOT_SERVING, calls UNAVAILABLE naming the rank, the rank killed, exit 1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from sglang_admin.config import ServerArgs
from sglang_admin.messages import Heartbeat
from sglang_admin.server.communicator import Communicator

# A pass every tenth of the probe timeout, at most this far apart: each pass wakes the
# server's event loop, which on a small machine shows in every call's latency.
MAX_CHECK_INTERVAL_S = 1.0


def stuck_reason(
    args: ServerArgs,
    beat: Heartbeat | None,
    heard_ago: float,
    now: float,
) -> str | None:
    """Why a ready rank counts as stuck, or None.

    ``beat`` is its last heartbeat (None: none yet), ``heard_ago`` the seconds since the
    server last heard from it (heartbeat or ready message), ``now`` the wall time.
    """
    probe = args.watchdog_probe_timeout_s
    if probe and heard_ago > probe:
        return (f"stopped answering: no heartbeat for {heard_ago:.1f}s "
                f"(--watchdog-probe-timeout {probe:g}s; the process is stopped or frozen)")
    limit = args.watchdog_timeout_s
    if limit and beat is not None and beat.step_started:
        in_step = now - beat.step_started
        if in_step > limit:
            return (f"is stuck: one forward step has run for {in_step:.1f}s "
                    f"(--watchdog-timeout {limit:g}s)")
    return None


class Watchdog:
    """Checks every ready rank a few times a second; reports a stuck one once."""

    def __init__(
        self, args: ServerArgs, comm: Communicator, on_stuck: Callable[[int, str], None]
    ) -> None:
        self.args = args
        self.comm = comm
        self.on_stuck = on_stuck
        self.interval = min(MAX_CHECK_INTERVAL_S, max(0.01, args.watchdog_probe_timeout_s / 10))
        self.last_check = time.monotonic()

    def check(self) -> None:
        """One pass over the ranks (those ready and not yet failed). A pass that comes late
        (the server's own loop was held up) is skipped: heartbeats may be waiting unread."""
        mono, now = time.monotonic(), time.time()
        late = mono - self.last_check > max(1.0, self.args.watchdog_probe_timeout_s / 2)
        self.last_check = mono
        if late:
            return
        for rank in sorted(self.comm.ready_ranks):
            if rank in self.comm.dead_ranks:
                continue
            why = stuck_reason(
                self.args, self.comm.heartbeats[rank], mono - self.comm.heard_at[rank], now
            ) or self.follower_stuck(rank, mono)
            if why is not None:
                self.on_stuck(rank, why)

    def follower_stuck(self, rank: int, mono: float) -> str | None:
        """Why a TP follower of replica ``rank`` counts as stuck (no heartbeat for the probe
        timeout: stopped or frozen; the replica's rank 0 then waits in a collective)."""
        for tp_rank in range(1, self.args.tp_size):
            heard = self.comm.follower_heard_at.get((rank, tp_rank))
            if heard is None:
                continue
            why = stuck_reason(self.args, None, mono - heard, 0.0)
            if why is not None:
                return f"(TP rank {tp_rank}) {why}"
        return None

    async def run(self, stop: asyncio.Event) -> None:
        """Check until ``stop`` is set."""
        while not stop.is_set():
            self.check()
            await asyncio.sleep(self.interval)
