"""Server interceptors: authentication, exceptions to statuses, access log."""

from __future__ import annotations

import hmac
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from sglang_admin.server.convert import ServiceError
from sglang_admin.tracing import carrier_from_metadata, trace_id_of

logger = logging.getLogger(__name__)

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
ADMIN_METHODS = frozenset(
    f"/{SERVICE}/{m}" for m in ("FlushCache", "StartProfile", "StopProfile", "DownloadProfile")
)
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_METHODS = frozenset({f"/{SERVICE}/HealthCheck"})


def _wrap(handler: grpc.RpcMethodHandler, wrap_unary: Callable, wrap_stream: Callable) -> Any:
    """Rebuild a method handler with its behaviour wrapped."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            wrap_unary(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler  # streaming requests: none in this service


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
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """SGLang's rules: --api-key guards every RPC but health and reflection; when
    --admin-api-key is set, only it opens the admin RPCs. Keys compared in constant time."""

    def __init__(self, api_key: str | None, admin_api_key: str | None) -> None:
        self.api_key = api_key.encode() if api_key else None
        self.admin_api_key = admin_api_key.encode() if admin_api_key else None

    def _expected(self, method: str) -> bytes | None:
        if method in OPEN_METHODS or method.startswith(OPEN_PREFIXES):
            return None
        if method in ADMIN_METHODS and self.admin_api_key:
            return self.admin_api_key
        return self.api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        expected = self._expected(details.method)
        if expected is None:
            return await continuation(details)
        given = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                given = value
        if not given:
            return _abort_handler(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing 'authorization: Bearer <key>' metadata",
            )
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), expected):
            kind = "admin API key" if expected is self.admin_api_key else "API key"
            return _abort_handler(grpc.StatusCode.UNAUTHENTICATED, f"invalid {kind}")
        return await continuation(details)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns ServiceError into its status and any other exception into INTERNAL."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method

        def wrap_unary(fn: Callable) -> Callable:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
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
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for item in _stream(fn, request, context):
                        yield item
                except ServiceError as exc:
                    await context.abort(exc.code, exc.message)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    logger.exception("%s failed", method)
                    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

            return call

        return _wrap(handler, wrap_unary, wrap_stream)


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
