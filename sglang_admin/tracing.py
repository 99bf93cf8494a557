"""W3C trace-context helpers on top of the OpenTelemetry API (a no-op without an SDK)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

TRACER_NAME = "sglang_admin"
_TRACE_KEYS = ("traceparent", "tracestate")
_tracer: trace.Tracer | None = None


def _get_tracer() -> trace.Tracer:
    """The tracer, made once: looking it up per span reads the environment every time. Made
    before an SDK is installed, it is a proxy that follows the provider installed later."""
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer(TRACER_NAME)
    return _tracer


_sdk_installed = False
# A provider named by the environment is installed by the API on first use.
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def _recording() -> bool:
    """Whether an SDK tracer provider is installed (once installed, it stays). Without one,
    a span under no caller's context does nothing, so it is not made at all."""
    global _sdk_installed
    if not _sdk_installed:
        # Until a provider is set, get_tracer_provider() looks the environment up on every
        # call (a KeyError raised and caught, on every admin call): skipped while the API
        # holds no provider and the environment names none. (Should the API's module
        # variable ever go, the default sends every call down the public path.)
        if not _PROVIDER_FROM_ENV and getattr(trace, "_TRACER_PROVIDER", True) is None:
            return False
        _sdk_installed = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return _sdk_installed


def carrier_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """The W3C trace headers found in gRPC invocation metadata."""
    out: dict[str, str] = {}
    for key, value in metadata or ():
        if key in _TRACE_KEYS and isinstance(value, str):
            out[key] = value
    return out


def trace_id_of(carrier: dict[str, str] | None) -> str:
    """The 32-hex trace id of a carrier's traceparent, or "" when it has none (or it is bad)."""
    parent = (carrier or {}).get("traceparent", "")
    parts = parent.split("-")
    if len(parts) >= 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
        try:
            int(parts[1], 16)
        except ValueError:
            return ""
        return parts[1].lower()
    return ""


class _NoSpan:
    """What :func:`server_span` is when there is nothing to trace: a fresh empty carrier,
    no generator (most calls of an untraced server)."""

    __slots__ = ()

    def __enter__(self) -> dict[str, str]:
        return {}

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


def server_span(
    name: str, carrier: dict[str, str], /, **attributes: Any
) -> AbstractContextManager[dict[str, str]]:
    """Open a server span as a child of the caller's context; yield the carrier to forward.

    The forwarded carrier holds the span's own context when an SDK records it, else the
    caller's headers unchanged, so the scheduler always sees the caller's trace id.
    """
    if not carrier and not _recording():
        return _NO_SPAN
    return _server_span(name, carrier, attributes)


@contextmanager
def _server_span(
    name: str, carrier: dict[str, str], attributes: dict[str, Any]
) -> Iterator[dict[str, str]]:
    parent_ctx = propagate.extract(carrier)
    with _get_tracer().start_as_current_span(
        name, context=parent_ctx, kind=trace.SpanKind.SERVER, attributes=attributes
    ) as span:
        forward: dict[str, str] = {}
        if span.get_span_context().is_valid:
            propagate.inject(forward)
        else:
            forward = dict(carrier)
        yield forward


class _NoChildSpan:
    """What :func:`child_span` is when there is nothing to trace: no generator."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_CHILD_SPAN = _NoChildSpan()


def child_span(
    name: str, carrier: dict[str, str], /, **attributes: Any
) -> AbstractContextManager[None]:
    """A span in the scheduler process, child of the context the server forwarded."""
    if not carrier and not _recording():
        return _NO_CHILD_SPAN
    return _child_span(name, carrier, attributes)


@contextmanager
def _child_span(name: str, carrier: dict[str, str], attributes: dict[str, Any]) -> Iterator[None]:
    ctx = propagate.extract(carrier) if carrier else otel_context.get_current()
    with _get_tracer().start_as_current_span(name, context=ctx, attributes=attributes):
        yield
