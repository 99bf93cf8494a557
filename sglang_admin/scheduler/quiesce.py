"""The one owner of admission in a rank: hold new work, wait for the running work to drain.

Ops that need a drained rank (a cache flush, a weight update) ask :meth:`Quiesce.when_drained`.
While any such op waits, the scheduler admits nothing new; requests that arrive meanwhile
queue behind it (a writer lock that every request holds as a reader, as SGLang's
update_weights does). Once no request runs, the ops run in arrival order; one whose deadline
passes, or whose caller cancels, gives up and admission re-opens unless another op waits.
A pause (PauseGeneration) counts as drained at once: what it keeps is held, not running.

No torch here; the scheduler is driven through its ``admission_paused`` and its queues.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sglang_admin.scheduler.scheduler import Scheduler


@dataclass
class _Waiter:
    rid: str
    deadline: float  # time.monotonic()
    run: Callable[[], None]  # called once the rank is drained
    give_up: Callable[[str], None]  # called with the reason at the deadline or on cancel


class Quiesce:
    """Ops waiting for a drained rank, and the admission hold they imply."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.waiters: list[_Waiter] = []

    @property
    def drained(self) -> bool:
        """No request is running (queued ones hold no KV), or a pause holds them all."""
        return not self.scheduler.running or self.scheduler.paused is not None

    @property
    def pending(self) -> bool:
        return bool(self.waiters)

    def when_drained(
        self,
        rid: str,
        timeout_s: float,
        run: Callable[[], None],
        give_up: Callable[[str], None],
    ) -> None:
        """Run ``run`` once the rank is drained (now, when it is); ``give_up(reason)`` after
        ``timeout_s`` seconds or on :meth:`cancel`. Admission stays closed meanwhile."""
        if not self.waiters and self.drained:
            run()
            return
        self.waiters.append(_Waiter(rid, time.monotonic() + timeout_s, run, give_up))
        self.scheduler.admission_paused = True

    def cancel(self, rid: str, reason: str = "cancelled by its caller") -> bool:
        """Drop the waiting op ``rid`` (its caller is gone); False when none waits."""
        for waiter in self.waiters:
            if waiter.rid == rid:
                self.waiters.remove(waiter)
                self._reopen()
                waiter.give_up(reason)
                return True
        return False

    def poll(self) -> None:
        """Once per loop iteration: run the ops whose time came, expire the late ones."""
        if not self.waiters:
            return
        now = time.monotonic()
        for waiter in [w for w in self.waiters if w.deadline < now]:
            self.waiters.remove(waiter)
            waiter.give_up("Timed out waiting for idle state.")
        while self.waiters and self.drained:
            self.waiters.pop(0).run()
        self._reopen()

    def _reopen(self) -> None:
        if not self.waiters:
            self.scheduler.admission_paused = False
