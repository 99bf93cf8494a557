"""What every sidecar route shares: the call context its service method reads, the RPC
auth rule, the services it calls, and the answers (text, JSON, errors) with their status.

A route is a thin edge: it authorizes the request with the rule of the RPC that does the
same thing (``AuthInterceptor.check`` on that RPC's path), turns the body into the RPC's
protobuf request, calls the same service method as the RPC (through an
:class:`HttpCallContext`) and shapes the answer as SGLang's HTTP server does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from aiohttp import web

from sglang_admin.config import ServerArgs
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.interceptors import SERVICE

# One logger for the sidecar (operators grep "sglang_admin.server.sidecar: http ").
logger = logging.getLogger("sglang_admin.server.sidecar")

INTERNAL = "internal error: see the server's log"

# ServiceError's status -> HTTP status; anything else is a 500
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# call metadata -> None (allowed) or why not, for one RPC path: AuthInterceptor.check
AuthCheck = Callable[[str, Any], "str | None"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_FORWARDED = ("authorization", "traceparent", "tracestate")


def rpc(method: str) -> str:
    """The full path of one of the service's RPCs (its auth rule's key)."""
    return f"/{SERVICE}/{method}"


class Unauthorized(Exception):
    """The route's RPC rule refused the request's Authorization header: 401."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class HttpCallContext:
    """The part of a grpc.aio ServicerContext that the service methods read
    (:class:`~sglang_admin.server.admin.CallContext`), for a call that came over HTTP:
    the headers gRPC would carry as metadata (``authorization``, ``traceparent``,
    ``tracestate``: the caller's trace continues into the ranks), and no deadline (SGLang's
    HTTP routes have none; each op's server default applies)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    @classmethod
    def of(cls, request: web.Request) -> HttpCallContext:
        return cls(call_metadata(request))

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None


def call_metadata(request: web.Request) -> tuple[tuple[str, str], ...]:
    """The request's headers that gRPC would carry as call metadata, lower-case keys."""
    return tuple((key, value) for key in _FORWARDED for value in request.headers.getall(key, ()))


class Services(Protocol):
    """The servicer's domain objects the routes call (SglangSchedulerServicer has them)."""

    cache: Any  # CacheAndProfile
    info: Any  # Info
    metrics: Any  # Metrics
    weights: Any  # Weights
    weight_sync: Any  # WeightSync
    lora: Any  # Lora
    generation: Any  # Generation
    admin: Any  # AdminCalls: check_admin_key is the admin rule (for Abort's abort_all)


@dataclass
class Edge:
    """What a route module needs: the server's args, its services and the auth check."""

    args: ServerArgs
    services: Services
    check: AuthCheck | None = None

    def authorize(self, request: web.Request, method: str) -> None:
        """The auth rule of RPC path ``method`` on the request's Authorization header."""
        if self.check is None:
            return
        reason = self.check(method, call_metadata(request))
        if reason is not None:
            logger.info("refused HTTP %s %s: %s", request.method, request.path, reason)
            raise Unauthorized(reason.replace(" metadata", " header"))


@dataclass(frozen=True)
class Route:
    """One path of the sidecar: its methods, its handler, and how its refusals read
    (``json_errors``: SGLang's ``{"success": false, "message"}`` of the admin routes that
    answer JSON; else text, as the profile, flush and info routes)."""

    methods: tuple[str, ...]
    path: str
    handler: Handler
    json_errors: bool = True


# ---------------------------------------------------------------------- answers


def plain(status: int, text: str, headers: dict[str, str] | None = None) -> web.Response:
    """A text/plain answer ending in one newline (SGLang's profile and flush texts)."""
    return web.Response(status=status, text=text if text.endswith("\n") else text + "\n",
                        headers=headers)


def json_answer(data: Any, status: int = 200) -> web.Response:
    """A JSON answer."""
    return web.Response(status=status, text=json.dumps(data), content_type="application/json")


def failure(http_status: int, message: str, /, **extra: Any) -> web.Response:
    """SGLang's failure shape of the admin routes: ``{"success": false, "message": ...}``."""
    return json_answer({"success": False, "message": message, **extra}, http_status)


def outcome(success: bool, message: str, /, **extra: Any) -> web.Response:
    """``{"success", "message", ...}``: 200 when it succeeded, else 400 (SGLang's rule)."""
    return json_answer({"success": success, "message": message, **extra},
                       200 if success else 400)


def status_of(exc: ServiceError) -> int:
    """The HTTP status of a service's refusal."""
    return HTTP_STATUS.get(exc.code, 500)
