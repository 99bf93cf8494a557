"""Server interceptors: authentication, exceptions to statuses, access log."""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from sglang_admin.server.admin import admin_methods
from sglang_admin.server.errors import Serialized, ServiceError
from sglang_admin.server.servicer import SglangSchedulerServicer
from sglang_admin.tracing import carrier_from_metadata, trace_id_of

logger = logging.getLogger(__name__)

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
# RPCs that change the server's state for everyone, as the servicer marks them
# (@admin_rpc): with --admin-api-key set, only that key opens them (SGLang's ADMIN_OPTIONAL
# level); with only --api-key, that key does.
ADMIN_METHODS = admin_methods(SglangSchedulerServicer, SERVICE)
# Health and reflection stay open (probes and tools must not need a secret).
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_METHODS = frozenset({f"/{SERVICE}/HealthCheck"})
# Abort carries an admin op (abort_all) in a non-admin RPC: with both keys set it takes
# either key here, and the service asks for the admin key when abort_all is set.
EITHER_KEY_METHODS = frozenset({f"/{SERVICE}/Abort"})


def _wrap(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable,
    wrap_stream: Callable,
    deserializer: Callable | None = None,
) -> Any:
    """Rebuild a method handler with its behaviour (and optionally its request
    deserializer) wrapped."""
    deserializer = deserializer or handler.request_deserializer
    serializer = passing_serialized(handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            wrap_unary(handler.unary_unary),
            request_deserializer=deserializer,
            response_serializer=serializer,
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream),
            request_deserializer=deserializer,
            response_serializer=serializer,
        )
    return handler  # streaming requests: none in this service


def passing_serialized(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """``serialize``, except that a :class:`Serialized` response goes out as it is."""
    if serialize is None or getattr(serialize, "passes_serialized", False):
        return serialize

    def serializer(response: Any) -> bytes:
        if type(response) is Serialized:
            return response.data
        return serialize(response)

    serializer.passes_serialized = True  # type: ignore[attr-defined]
    return serializer


class MalformedRequest:
    """What a request body that does not decode becomes: the call then ends with
    INVALID_ARGUMENT (grpc would answer UNKNOWN "Unexpected DecodeError")."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def tolerant_deserializer(method: str, deserialize: Callable[[bytes], Any] | None) -> Callable:
    """`deserialize`, but a body that does not decode gives a :class:`MalformedRequest`."""

    def decode(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and anything else it raises
            name = method.rsplit("/", 1)[-1]
            return MalformedRequest(
                f"malformed {name} request: {len(data)} bytes that do not decode as its "
                f"protobuf message ({type(exc).__name__}: {exc})"
            )

    return decode


async def _stream(fn: Callable, request: Any, context: grpc.aio.ServicerContext) -> Any:
    """Iterate a server-streaming behaviour, whether an async generator or a coroutine
    (one that only raises or aborts, or writes with context.write)."""
    result = fn(request, context)
    if inspect.isawaitable(result):
        result = await result
    if result is not None:
        async for item in result:
            yield item


def _abort_handler(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that refuses the call without reading its request (no deserializer)."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """SGLang's rules for gRPC.

    - ``--api-key``: every RPC but health and reflection needs
      ``authorization: Bearer KEY``.
    - ``--admin-api-key``: the admin RPCs (:data:`ADMIN_METHODS`) need that key, and only
      it; with only ``--api-key`` set, the API key opens them too. With only
      ``--admin-api-key`` set, the other RPCs are open.

    A missing or wrong key ends the call with UNAUTHENTICATED before the servicer runs or
    the request is even deserialized. Keys are compared in constant time (as SHA-256
    digests, so not even their length leaks) and never logged.
    """

    def __init__(self, api_key: str | None, admin_api_key: str | None) -> None:
        self._api = _digest(api_key.encode()) if api_key else None
        self._admin = _digest(admin_api_key.encode()) if admin_api_key else None

    def required(self, method: str) -> tuple[tuple[bytes, ...], str]:
        """The digests of the keys `method` accepts (none: open) and their name."""
        if method in OPEN_METHODS or method.startswith(OPEN_PREFIXES):
            return (), ""
        if method in ADMIN_METHODS and self._admin is not None:
            return (self._admin,), "admin API key"
        if method in EITHER_KEY_METHODS and self._admin is not None and self._api is not None:
            return (self._api, self._admin), "API key"
        return ((self._api,) if self._api is not None else ()), "API key"

    @staticmethod
    def bearer_token(metadata: Any) -> str | None:
        """The token of the call's ``authorization: Bearer <token>`` (None: absent)."""
        value = None
        for key, item in metadata or ():
            if key == "authorization":
                value = item.decode("latin-1") if isinstance(item, bytes) else str(item)
        if value is None:
            return None
        scheme, _, token = value.partition(" ")
        return token if scheme.lower() == "bearer" and token else ""

    def check_admin(self, metadata: Any) -> str | None:
        """The admin rule for an admin op that travels in a non-admin RPC (Abort's
        abort_all): None when the call may proceed, else the reason it may not."""
        return self.check(next(iter(sorted(ADMIN_METHODS))), metadata)

    def check(self, method: str, metadata: Any) -> str | None:
        """None when the call may proceed, else the reason it may not."""
        accepted, name = self.required(method)
        if not accepted:
            return None
        token = self.bearer_token(metadata)
        if token is None:
            return f"missing 'authorization: Bearer <{name}>' metadata"
        digest = _digest(token.encode("utf-8", "surrogateescape"))
        # every accepted key is compared, so the time taken says nothing about which matched
        if not any([hmac.compare_digest(digest, expected) for expected in accepted]):
            return f"invalid {name}" + (
                " (this admin RPC accepts only the admin API key)"
                if name == "admin API key"
                else ""
            )
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        reason = self.check(details.method, details.invocation_metadata)
        if reason is None:
            return await continuation(details)
        logger.info("refused %s: %s", details.method, reason)
        return _abort_handler(grpc.StatusCode.UNAUTHENTICATED, reason)


def error_wrapped(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` (of ``method``) with ServiceError turned into its status, any other
    exception into INTERNAL, and a request body that does not decode into INVALID_ARGUMENT
    naming the method."""

    def wrap_unary(fn: Callable) -> Callable:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            try:
                return await fn(request, context)
            except ServiceError as exc:
                await context.abort(exc.code, exc.message)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                logger.exception("%s failed", method)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

        return call

    def wrap_stream(fn: Callable) -> Callable:
        # what the behaviour returns is iterated here, not through _stream: one generator
        # less on every message of every stream (Generate's chunks)
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            try:
                items = fn(request, context)
                if inspect.isawaitable(items):  # a coroutine that raises or context.write()s
                    items = await items
                if items is None:
                    return
                async for item in items:
                    yield item
            except ServiceError as exc:
                await context.abort(exc.code, exc.message)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                logger.exception("%s failed", method)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

        return call

    return _wrap(
        handler, wrap_unary, wrap_stream,
        tolerant_deserializer(method, handler.request_deserializer),
    )


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """:func:`error_wrapped` as an interceptor, for a server whose handlers were not
    registered through :class:`ErrorHandlingRegistry` (which costs nothing per call: a
    grpc.aio server with any interceptor runs an interceptor chain on every call)."""

    def __init__(self) -> None:
        # method -> (its handler, the wrapped handler): wrapped once, not on every call
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = error_wrapped(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


class _ErrorHandlingGeneric(grpc.GenericRpcHandler):
    """A generic handler whose method handlers come out :func:`error_wrapped` (once each)."""

    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self.inner = inner
        self.wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self.inner.service(details)
        if handler is None:
            return None
        method = details.method
        cached = self.wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self.wrapped[method] = (handler, error_wrapped(method, handler))
        return cached[1]


class ErrorHandlingRegistry:
    """What generated ``add_XServicer_to_server`` functions register on: the server, with
    every handler :func:`error_wrapped` as it is registered, so that error handling takes
    no interceptor (and no interceptor chain on every call)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        self.server.add_generic_rpc_handlers(tuple(_ErrorHandlingGeneric(h) for h in handlers))

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.server.add_registered_method_handlers(
            service,
            {name: error_wrapped(f"/{service}/{name}", h) for name, h in handlers.items()},
        )


class AccessLogInterceptor(grpc.aio.ServerInterceptor):
    """One log line per call: method, status, duration and the caller's trace id."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        trace_id = trace_id_of(carrier_from_metadata(details.invocation_metadata))
        suffix = f" trace_id={trace_id}" if trace_id else ""

        def done(t0: float, context: grpc.aio.ServicerContext) -> None:
            code = context.code() if hasattr(context, "code") else None
            logger.info(
                "rpc %s status=%s %.1fms%s", method, getattr(code, "name", code) or "OK",
                (time.perf_counter() - t0) * 1e3, suffix,
            )

        def wrap_unary(fn: Callable) -> Callable:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(request, context)
                finally:
                    done(t0, context)

            return call

        def wrap_stream(fn: Callable) -> Callable:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                t0 = time.perf_counter()
                try:
                    async for item in _stream(fn, request, context):
                        yield item
                finally:
                    done(t0, context)

            return call

        return _wrap(handler, wrap_unary, wrap_stream)
