"""Admission of Generate calls: hold what the scheduler can queue, refuse the rest at once.

grpc core keeps the calls that the application has not picked up yet in a per-method
backlog. By default it drops calls from that backlog when it holds more than 1000 of them
(at random between 1000 and 3000, all past 3000; ``grpc.server.max_pending_requests`` and
``..._hard_limit``) and when one waited there longer than 30 s
(``grpc.server_max_unrequested_time_in_server``); a dropped call reaches the client as
CANCELLED "CANCELLED", never reaches the servicer and leaves nothing in the log. A burst of
a few thousand streams at once fills that backlog faster than one asyncio loop empties it.
:func:`core_options` turns both drops off, so every call reaches the application, and
:class:`GenerateAdmission` decides there, first thing in Generate: a call is admitted while
fewer than ``--max-inflight-generate`` Generate calls are in flight, otherwise it ends at
once with RESOURCE_EXHAUSTED and a message that says why. Other RPCs (health, loads, the
admin ops) are not counted and have their own backlog in grpc core, so they keep answering.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from sglang_admin.config import ServerArgs
from sglang_admin.server.errors import ServiceError

logger = logging.getLogger(__name__)

# The derived limit per rank: BATCHES_IN_FLIGHT full batches (--max-running-requests each),
# i.e. the running one and three queued behind it, and never more calls than the KV pool
# holds at MIN_TOKENS_PER_CALL tokens each. A deeper queue only adds latency: the last call
# admitted already waits three batches' decode time for its first token,
# and the tokens of more calls in flight slow the server's one event loop for every RPC
# (2-core figures in docs/bursts.md: at 16 batches HealthCheck took up to 7 s in a burst).
BATCHES_IN_FLIGHT = 4
MIN_TOKENS_PER_CALL = 32
# grpc core must never drop a call that the application has not picked up yet: the backlog
# limits are out of reach and a call may wait there for an hour (the loop picks calls up in
# milliseconds; admission answers each at once).
CORE_BACKLOG_LIMIT = 1 << 30
CORE_UNREQUESTED_S = 3600
REFUSAL_LOG_INTERVAL_S = 10.0


def core_options() -> list[tuple[str, int]]:
    """grpc server options that hand every incoming call to the application."""
    return [
        ("grpc.server.max_pending_requests", CORE_BACKLOG_LIMIT),
        ("grpc.server.max_pending_requests_hard_limit", CORE_BACKLOG_LIMIT),
        ("grpc.server_max_unrequested_time_in_server", CORE_UNREQUESTED_S),
    ]


def derived_limit(max_running_requests: int, pool_tokens: int, dp_size: int) -> int:
    """The default limit of Generate calls in flight on a worker of ``dp_size`` ranks whose
    KV pool holds ``pool_tokens`` tokens per rank (0: not known yet)."""
    per_rank = BATCHES_IN_FLIGHT * max_running_requests
    if pool_tokens > 0:
        per_rank = min(per_rank, pool_tokens // MIN_TOKENS_PER_CALL)
    return dp_size * max(max_running_requests, per_rank)


class GenerateAdmission:
    """Counts the Generate calls in flight and refuses those past the limit.

    ``pool_tokens`` returns the KV pool size per rank once the ranks reported it (0 before);
    the limit is ``args.max_inflight_generate`` when set, else :func:`derived_limit`.
    """

    def __init__(self, args: ServerArgs, pool_tokens: Callable[[], int]) -> None:
        self.args = args
        self._pool_tokens = pool_tokens
        self.in_flight = 0
        self.refused = 0  # since the start
        self._refused_unlogged = 0
        self._last_log = 0.0

    @property
    def limit(self) -> int:
        """The most Generate calls in flight at once."""
        if self.args.max_inflight_generate:
            return self.args.max_inflight_generate
        return derived_limit(self.args.max_running_requests, self._pool_tokens(),
                             self.args.dp_size)

    def _why(self, limit: int) -> str:
        source = ("--max-inflight-generate" if self.args.max_inflight_generate else
                  "derived from --max-running-requests and the KV pool; "
                  "set --max-inflight-generate to change it")
        return (f"worker busy: {self.in_flight} Generate calls in flight, the limit is {limit} "
                f"({source}); retry later or on another worker")

    def _refuse(self, limit: int) -> ServiceError:
        self.refused += 1
        self._refused_unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= REFUSAL_LOG_INTERVAL_S:
            logger.warning("refused %d Generate call(s) with RESOURCE_EXHAUSTED: %d in flight, "
                           "limit %d", self._refused_unlogged, self.in_flight, limit)
            self._refused_unlogged = 0
            self._last_log = now
        return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, self._why(limit))

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Hold a place for one Generate call for the ``with`` block, or raise
        ServiceError(RESOURCE_EXHAUSTED) at once when none is free."""
        limit = self.limit
        if self.in_flight >= limit:
            raise self._refuse(limit)
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
