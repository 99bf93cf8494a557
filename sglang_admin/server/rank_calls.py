"""Admin calls over the server's link to the ranks (mixed into Communicator).

One message to every rank under a fresh request id; the call waits for exactly one reply per
rank, matched by that id. A reply for a call that already gave up finds no waiter and is
dropped (and logged), so it can never be taken by the next call. Concurrent identical
read-only calls share one in-flight request (``shared``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sglang_admin.messages import AdminReply, CancelAdminReq, encode


@dataclass(frozen=True)
class RankFailure:
    """Why one rank gave no answer to an admin call: ``kind`` is ``timeout`` (it did not
    answer in time), ``dead`` (its process is gone) or ``down`` (the server is stopping)."""

    kind: Literal["timeout", "dead", "down"]
    message: str


class _AdminCall:
    """One admin call's wait: the ranks asked, their replies so far, and the future the
    waiting call awaits (resolved by the last reply, a failure or the timeout; an Event
    under wait_for took an extra task and two more loop iterations)."""

    __slots__ = ("ranks", "replies", "done")

    def __init__(self, ranks: tuple[int, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.ranks = ranks
        self.replies: dict[int, AdminReply] = {}
        self.done: asyncio.Future = loop.create_future()

    def finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class RankCalls:
    """Communicator's admin calls to the ranks (mixed into Communicator: the attributes are
    its, set in its ``__init__``)."""

    def new_admin_id(self) -> str:
        """A request id for an admin call, unique for this server's lifetime."""
        return f"admin-{next(self._admin_seq)}"

    async def call_ranks(
        self,
        make: Callable[[str], Any],
        timeout: float,
        ranks: tuple[int, ...] | None = None,
        rid: str | None = None,
    ) -> tuple[dict[int, AdminReply], dict[int, RankFailure]]:
        """Send make(rid) to every rank and wait for one reply each, at most `timeout` s.

        `rid` (from :meth:`new_admin_id`) lets the caller log the id before the call.
        Returns (replies by rank, failures by rank): a rank that died, or did not answer in
        time, is a :class:`RankFailure` of that kind. Every rank that was sent the request
        and has not answered when the wait ends (timeout, or the calling task cancelled) is
        sent a :class:`CancelAdminReq`, so that nothing stays pending there for a caller
        that left.
        """
        ranks = tuple(range(self.args.dp_size)) if ranks is None else ranks
        rid = rid or self.new_admin_id()
        loop = asyncio.get_running_loop()
        call = _AdminCall(ranks, loop)
        self.calls[rid] = call
        failures: dict[int, RankFailure] = {}
        sent: list[int] = []
        try:
            data = encode(make(rid))
            for rank in ranks:
                failure = self._unreachable(rank)
                if failure is not None:
                    failures[rank] = failure
                else:
                    await self._send(rank, data)
                    sent.append(rank)
            if len(failures) < len(ranks):
                timer = loop.call_later(timeout, call.finish)
                try:
                    await call.done
                finally:
                    timer.cancel()
        finally:
            self.calls.pop(rid, None)
            for rank in sent:
                if rank not in call.replies and rank not in self.dead_ranks:
                    self._send_nowait(rank, CancelAdminReq(rid))
        for rank in ranks:
            if rank not in call.replies and rank not in failures:
                failures[rank] = self._unreachable(rank) or RankFailure(
                    "timeout", f"rank {rank} did not answer within {timeout:.1f}s"
                )
        return call.replies, failures

    def _unreachable(self, rank: int) -> RankFailure | None:
        """Why a call cannot reach ``rank`` (its process died, the server is going down)."""
        if rank in self.dead_ranks:
            return RankFailure("dead", f"rank {rank} is unavailable ({self.dead_ranks[rank]})")
        if self.down_reason is not None:
            return RankFailure("down", f"rank {rank} is unavailable ({self.down_reason})")
        return None

    async def shared(self, key: str, make_call: Callable[[], Any]) -> Any:
        """Coalesce concurrent identical read-only calls onto one in-flight request.

        The first caller makes the request in its own task (a task per request cost two
        loop iterations on every call); callers that arrive meanwhile share its outcome, and
        make the request themselves should that first caller be cancelled.
        """
        if not self.args.coalesce_reads:
            return await make_call()
        while (fut := self._shared_reads.get(key)) is not None:
            ok, value = await asyncio.shield(fut)
            if ok:
                return value
            if value is not None:
                raise value
        fut = asyncio.get_running_loop().create_future()
        self._shared_reads[key] = fut
        try:
            result = await make_call()
        except Exception as exc:
            fut.set_result((False, exc))
            raise
        except BaseException:  # cancelled: the callers sharing it retry by themselves
            fut.set_result((False, None))
            raise
        finally:
            if self._shared_reads.get(key) is fut:
                del self._shared_reads[key]
        fut.set_result((True, result))
        return result
