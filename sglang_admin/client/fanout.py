"""One :class:`AsyncClient` call on many workers at once (:class:`FanOut`, :func:`fan_out`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import grpc

from sglang_admin.client.client import AsyncClient
from sglang_admin.client.errors import ClientError
from sglang_admin.client.reflection import full_rpc_name

T = TypeVar("T")

SKIPPED = "SKIPPED"


@dataclass
class TargetResult(Generic[T]):
    """The outcome of one call on one target: ``value`` when ``ok``, else ``code`` (a gRPC
    status name, ``SKIPPED``, or the client-side error's code) and ``error``."""

    target: str
    value: T | None = None
    code: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The call returned a value."""
        return self.code is None

    @property
    def skipped(self) -> bool:
        """The target does not offer the RPC, so it was not called."""
        return self.code == SKIPPED


def _failure(target: str, exc: Exception) -> TargetResult[Any]:
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return TargetResult(target, code=getattr(code, "name", "UNKNOWN"), error=details or "")
    code = exc.code if isinstance(exc, ClientError) else ClientError.code
    return TargetResult(target, code=code, error=f"{type(exc).__name__}: {exc}")


class FanOut:
    """Runs one call against many targets concurrently, one :class:`AsyncClient` per
    target (kept for the FanOut's life, with its reflection listing cached). The keyword
    arguments are :class:`AsyncClient`'s, the same for every target.

    Use as ``async with FanOut(targets, api_key=...) as fan: await fan.call(fn, rpc)``.
    """

    def __init__(
        self,
        targets: Sequence[str],
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.targets = list(dict.fromkeys(targets))
        self.api_key = api_key
        self.tls_ca = tls_ca
        self.tls_cert = tls_cert
        self.tls_key = tls_key
        self.timeout = timeout
        self.clients: dict[str, AsyncClient] = {}

    async def __aenter__(self) -> FanOut:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every client."""
        await asyncio.gather(*(c.close() for c in self.clients.values()))
        self.clients.clear()

    def client(self, target: str) -> AsyncClient:
        """The target's client (created on first use)."""
        if target not in self.clients:
            self.clients[target] = AsyncClient(
                target, api_key=self.api_key, tls_ca=self.tls_ca, tls_cert=self.tls_cert,
                tls_key=self.tls_key, timeout=self.timeout,
            )
        return self.clients[target]

    async def _one(
        self, target: str, fn: Callable[[AsyncClient], Awaitable[T]], rpc: str | None
    ) -> TargetResult[T]:
        try:
            client = self.client(target)
            if rpc is not None:
                try:
                    offered = await client.offers(rpc)
                except grpc.RpcError as exc:
                    # A server without reflection: no way to tell, so just call.
                    if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    offered = True
                if not offered:
                    service, method = full_rpc_name(rpc)
                    return TargetResult(
                        target, code=SKIPPED,
                        error=f"skipped: {target} does not offer {service}/{method}",
                    )
            return TargetResult(target, value=await fn(client))
        except Exception as exc:  # noqa: BLE001 - every failure is reported per target
            return _failure(target, exc)

    async def call(
        self, fn: Callable[[AsyncClient], Awaitable[T]], rpc: str | None = None
    ) -> list[TargetResult[T]]:
        """``fn(client)`` on every target at once; results in target order. With ``rpc``
        (``"Service/Method"``), a target whose reflection lacks it is skipped."""
        if rpc is not None:
            full_rpc_name(rpc)  # a malformed name is the caller's error, not a target's
        return list(await asyncio.gather(*(self._one(t, fn, rpc) for t in self.targets)))


async def fan_out(
    targets: Sequence[str],
    fn: Callable[[AsyncClient], Awaitable[T]],
    rpc: str | None = None,
    *,
    api_key: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    timeout: float | None = None,
) -> list[TargetResult[T]]:
    """One :meth:`FanOut.call` on a fresh :class:`FanOut` (same keyword arguments), closed
    afterwards."""
    async with FanOut(
        targets, api_key=api_key, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
        timeout=timeout,
    ) as fan:
        return await fan.call(fn, rpc)
