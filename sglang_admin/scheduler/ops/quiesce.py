"""The one owner of admission in a rank: hold new work, wait for the running work to drain.

Ops that need a drained rank (a cache flush, a weight update) ask :meth:`Quiesce.when_drained`.
While any such op waits, the scheduler admits nothing new; requests that arrive meanwhile
queue behind it (a writer lock that every request holds as a reader, as SGLang's
update_weights does). Once no request runs, the ops run in arrival order; one whose deadline
passes gives up, one whose caller is gone is dropped, and admission re-opens unless another
op waits or a hold remains. A hold (:meth:`hold`, e.g. released memory) closes admission
until it is lifted. A pause (PauseGeneration) counts as drained at once: what it keeps is
held, not running.

No torch here; the scheduler is driven through its ``admission_paused`` and its queues.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sglang_admin.scheduler.scheduler import Scheduler

TIMED_OUT = "Timed out waiting for idle state."


@dataclass
class _Waiter:
    rid: str
    op: str
    deadline: float  # time.monotonic()
    run: Callable[[], None]  # called once the rank is drained
    give_up: Callable[[str], None]  # called with the reason at the deadline


class Quiesce:
    """Ops waiting for a drained rank, the holds on admission, and what they imply."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.waiters: list[_Waiter] = []
        self.holds: set[str] = set()

    @property
    def drained(self) -> bool:
        """No request is running (queued ones hold no KV), or a pause holds them all."""
        return not self.scheduler.running or self.scheduler.paused is not None

    @property
    def pending(self) -> bool:
        return bool(self.waiters)

    def waiting(self, op: str) -> bool:
        """Whether an op of that name waits for the rank to drain."""
        return bool(self.waiters) and any(w.op == op for w in self.waiters)

    def when_drained(
        self,
        rid: str,
        op: str,
        timeout_s: float,
        run: Callable[[], None],
        give_up: Callable[[str], None],
    ) -> None:
        """Run ``run`` once the rank is drained (now, when it is and nothing waits before
        it); ``give_up(reason)`` after ``timeout_s`` seconds. Admission stays closed
        meanwhile."""
        if not self.waiters and self.drained:
            run()
            return
        self.waiters.append(_Waiter(rid, op, time.monotonic() + timeout_s, run, give_up))
        self._update()

    def cancel(self, rid: str) -> bool:
        """Drop the waiting op ``rid`` silently (its caller is gone); False when none."""
        before = len(self.waiters)
        self.waiters = [w for w in self.waiters if w.rid != rid]
        self._update()
        return len(self.waiters) < before

    def hold(self, reason: str) -> None:
        """Admit nothing until :meth:`lift` of the same reason."""
        self.holds.add(reason)
        self._update()

    def lift(self, reason: str) -> None:
        self.holds.discard(reason)
        self._update()

    def poll(self) -> None:
        """Once per loop iteration: run the ops whose time came, expire the late ones."""
        if not self.waiters:
            return
        now = time.monotonic()
        for waiter in [w for w in self.waiters if w.deadline < now]:
            self.waiters.remove(waiter)
            waiter.give_up(TIMED_OUT)
        while self.waiters and self.drained:
            self.waiters.pop(0).run()
        self._update()

    def _update(self) -> None:
        self.scheduler.admission_paused = bool(self.waiters or self.holds)
