"""Admin RPCs declared once: the fan-out to every rank and the policy around it.

An admin RPC is a servicer method marked :func:`admin_rpc` (the auth interceptor reads the
mark: with ``--admin-api-key`` only that key opens it) whose body checks its request, calls
:meth:`AdminCalls.fan_out` with the message every rank gets, and turns the
:class:`FanOut` into its response. ``fan_out`` owns what every admin op does the same way:
the readiness check, the server span with the caller's trace context, an ``admin-N`` id
logged in the server and the ranks, the effective deadline, one reply per rank matched by
that id, and the status policy (a rank that did not answer: DEADLINE_EXCEEDED; no rank
could be reached: UNAVAILABLE). Everything else is a per-rank result in the response.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc

from sglang_admin.config import ServerArgs
from sglang_admin.messages import AdminReply, TraceCarrier
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.communicator import Communicator, RankFailure
from sglang_admin.server.errors import ServiceError
from sglang_admin.tracing import carrier_from_metadata, server_span, trace_id_of

# The request log (--log-requests) keeps the servicer's logger name, which operators grep
# ("sglang_admin.server.servicer: generate rid=..."), whichever module writes the line.
request_log = logging.getLogger("sglang_admin.server.servicer")

DEADLINE_MARGIN_S = 0.25
_ADMIN_MARK = "_sglang_admin_rpc"
F = TypeVar("F", bound=Callable[..., Any])


_SPAN_NAMES: dict[str, str] = {}  # op -> its span's name (flush_cache -> FlushCache)


def span_name_of(op: str) -> str:
    """The server span's name for an admin op: ``flush_cache`` -> ``FlushCache``."""
    name = _SPAN_NAMES.get(op)
    if name is None:
        name = _SPAN_NAMES[op] = "".join(part.title() for part in op.split("_"))
    return name


def admin_rpc(method: F) -> F:
    """Mark a servicer method as an admin RPC (it changes the server for everyone)."""
    setattr(method, _ADMIN_MARK, True)
    return method


def admin_methods(servicer: type, service_name: str) -> frozenset[str]:
    """The full method paths (``/package.Service/Method``) of a servicer's admin RPCs."""
    return frozenset(
        f"/{service_name}/{name}"
        for name, member in inspect.getmembers(servicer, inspect.isfunction)
        if getattr(member, _ADMIN_MARK, False)
    )


class CallContext(Protocol):
    """What the admin path reads of a call: a grpc.aio ServicerContext, or the HTTP
    sidecar's :class:`~sglang_admin.server.sidecar.HttpCallContext` (its routes call
    the same service methods as the RPCs)."""

    def invocation_metadata(self) -> Any:
        """(key, value) pairs: ``authorization``, ``traceparent``, ``tracestate``, ..."""

    def time_remaining(self) -> float | None:
        """Seconds left of the caller's deadline (None: none)."""


def effective_timeout(context: CallContext, server_default: float) -> float:
    """The smaller of the op's server default and the caller's remaining deadline, less a
    margin so that the server's answer (naming the ranks that did not answer) reaches the
    caller before its own deadline fires."""
    remaining = context.time_remaining()
    if remaining is None:
        return server_default
    margin = min(DEADLINE_MARGIN_S, remaining * 0.1)
    return max(0.0, min(remaining - margin, server_default))


def rank_failure_text(failures: dict[int, str], dp_size: int = 0) -> str:
    """The one wording of ranks' failures: ``rank 0: why | rank 1: why``, or the reason
    alone when every one of the ``dp_size`` ranks failed for the same reason (so that
    SGLang's own messages, e.g. "Profiling is not in progress...", come through as is)."""
    if len(failures) == dp_size and len(set(failures.values())) == 1:
        return next(iter(failures.values()))
    return " | ".join(
        why if why.startswith(f"rank {rank} ") else f"rank {rank}: {why}"
        for rank, why in sorted(failures.items())
    )


@dataclass
class FanOut:
    """What every rank answered to one admin op (or why it did not)."""

    dp_size: int
    replies: dict[int, AdminReply]
    failures: dict[int, RankFailure]
    # Every rank answered, with success. Worked out once, as the FanOut is made (read by
    # every call; a cached_property takes a lock on its first read).
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        self.ok = not self.failures and all(r.success for r in self.replies.values())

    def result(self, rank: int) -> Any:
        """The typed result a rank sent with its reply (None when it sent none)."""
        reply = self.replies.get(rank)
        return reply.result if reply is not None else None

    def rank_results(self) -> list[pb.RankResult]:
        """One RankResult per rank, in rank order; the response fills in op specifics."""
        return [pb.RankResult(dp_rank=rank, success=ok, message=text)
                for rank, ok, text in self.outcomes()]

    def outcomes(self) -> list[tuple[int, bool, str]]:
        """(rank, success, message) of every rank, in rank order."""
        out = []
        for rank in range(self.dp_size):
            reply = self.replies.get(rank)
            if reply is not None:
                out.append((rank, reply.success, reply.message))
            else:
                failure = self.failures.get(rank)
                out.append((rank, False, failure.message if failure else "no answer"))
        return out

    def failure_message(self) -> str:
        """Every failed rank and why, in the one wording of :func:`rank_failure_text`."""
        failed = {r: reply.message for r, reply in self.replies.items() if not reply.success}
        failed.update({r: f.message for r, f in self.failures.items()})
        return rank_failure_text(failed, self.dp_size)

    def message(self, success: str) -> str:
        return success if self.ok else self.failure_message()

    def raise_if_unanswered(self) -> None:
        """A rank that did not answer in time fails the call with DEADLINE_EXCEEDED; no rank
        reachable at all, with UNAVAILABLE. Other failures stay per-rank results."""
        late = {r: f.message for r, f in self.failures.items() if f.kind == "timeout"}
        if late:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, rank_failure_text(late))
        if self.failures and not self.replies:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                rank_failure_text({r: f.message for r, f in self.failures.items()}),
            )


MakeMessage = Callable[[str, float, TraceCarrier], Any]


class AdminCalls:
    """Runs admin ops over every rank for the servicer."""

    def __init__(self, args: ServerArgs, comm: Communicator) -> None:
        self.args = args
        self.comm = comm
        # The auth interceptor's admin rule (set by launch when keys are configured), for
        # admin ops that travel inside a non-admin RPC: metadata -> None or why not.
        self.check_admin_key: Callable[[Any], str | None] = lambda metadata: None

    def require_admin_key(self, context: grpc.aio.ServicerContext) -> None:
        """UNAUTHENTICATED unless the call carries the key that opens the admin RPCs."""
        reason = self.check_admin_key(context.invocation_metadata())
        if reason is not None:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, reason)

    def require_ready(self) -> None:
        """UNAVAILABLE while the model loads or once a rank is gone."""
        if self.comm.dead_ranks:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "scheduler unavailable: "
                + "; ".join(f"rank {r} {why}" for r, why in self.comm.dead_ranks.items()),
            )
        if not self.comm.ready.is_set():
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "server is starting: model loading")

    def log(self, op: str, rid: str, carrier: TraceCarrier, **fields: Any) -> None:
        """One line per op with --log-requests, carrying the caller's trace id."""
        if not self.args.log_requests:
            return
        trace_id = trace_id_of(carrier)
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        request_log.info(
            "%s rid=%s%s%s", op, rid, f" {extra}" if extra else "",
            f" trace_id={trace_id}" if trace_id else "",
        )

    async def fan_out(
        self,
        context: CallContext,
        op: str,
        make: MakeMessage,
        server_default: float,
        /,
        raise_unanswered: bool = True,
        **log_fields: Any,
    ) -> FanOut:
        """Send ``make(rid, deadline, trace)`` to every rank; wait for every reply.

        ``server_default`` is the op's own time limit in seconds; the caller's deadline
        wins when it is nearer. Raises DEADLINE_EXCEEDED / UNAVAILABLE as
        :meth:`FanOut.raise_if_unanswered` says (unless ``raise_unanswered`` is False: the
        caller records what the ranks that answered did, then raises); every other outcome
        is in the FanOut.
        """
        self.require_ready()
        carrier = carrier_from_metadata(context.invocation_metadata())
        with self.comm.metrics.admin_call(op) as outcome:  # sglang_admin:admin_calls
            with server_span(span_name_of(op), carrier, **log_fields) as forward:
                rid = self.comm.new_admin_id()
                if self.args.log_requests:
                    self.log(op, rid, carrier, **log_fields)
                wait = effective_timeout(context, server_default)
                deadline = time.time() + wait
                replies, failures = await self.comm.call_ranks(
                    lambda admin_id: make(admin_id, deadline, forward), wait, rid=rid
                )
            out = FanOut(self.args.dp_size, replies, failures)
            outcome(out.ok)
            if raise_unanswered:
                out.raise_if_unanswered()
        return out
