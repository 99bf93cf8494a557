"""The blocking :class:`Client`, derived from :class:`AsyncClient` rather than written twice.

A ``Client`` owns a private event loop running in a daemon thread and an ``AsyncClient``
created on that loop. Every public coroutine method of ``AsyncClient`` becomes a blocking
method of the same name, signature and docstring; every async-generator method (a
server-streaming RPC such as ``generate``) becomes a method returning a plain iterator.
Because the loop is the client's own, a ``Client`` works the same from a plain thread and
from code already running inside an event loop (it then blocks that loop while it waits).
Deadlines, metadata, TLS and errors are the ``AsyncClient``'s: a failed call raises the
``grpc.RpcError`` (``grpc.aio.AioRpcError``) it raised on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

from sglang_admin.client.client import DEFAULT_TARGET, AsyncClient
from sglang_admin.client.reflection import Metadata

T = TypeVar("T")
C = TypeVar("C", bound=type)

_END = object()


class ClientClosedError(RuntimeError):
    """A blocking call on a :class:`Client` that was already closed."""


class _LoopThread:
    """An event loop running forever in a daemon thread, fed coroutines from others."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.closed = False
        # Held while checking `closed` and handing a coroutine to the loop, so nothing is
        # handed over after stop() took its snapshot of the loop's tasks.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result; an interrupt of the waiting
        thread (KeyboardInterrupt, ...) cancels it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking Client method was called on the client's own loop")
        with self._lock:
            if self.closed:
                coro.close()
                raise ClientClosedError("the client is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def stop(self, last: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Refuse new work, run ``last()``, cancel what is still running, then stop and
        close the loop. On the loop's own thread (a client collected there) it only
        schedules all that."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if threading.current_thread() is self._thread:
                task = self.loop.create_task(_finish(last))
                task.add_done_callback(lambda _: self.loop.stop())
                return
            future = asyncio.run_coroutine_threadsafe(_finish(last), self.loop)
        try:
            future.result()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


async def _finish(last: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """``last()``, then every other task on this loop cancelled and awaited."""
    try:
        await last()
    finally:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.get_running_loop().shutdown_asyncgens()


async def _next(stream: AsyncIterator[T]) -> T | object:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return _END


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def _open(target: str, options: dict[str, Any]) -> AsyncClient:
    """An AsyncClient created on the running loop (its channel binds to that loop)."""
    return AsyncClient(target, **options)


def _blocking_twin(name: str, method: Callable[..., Any]) -> Callable[..., Any] | None:
    """The blocking form of one AsyncClient method, or None when it is not a call."""
    signature = inspect.signature(method)
    returns = signature.return_annotation
    if inspect.isasyncgenfunction(method):
        if isinstance(returns, str):
            returns = returns.replace("AsyncIterator", "Iterator", 1)

        def twin(self: Client, *args: Any, **kwargs: Any) -> Any:
            return self._iterate(getattr(self._client, name)(*args, **kwargs))

    elif inspect.iscoroutinefunction(method):

        def twin(self: Client, *args: Any, **kwargs: Any) -> Any:
            return self._loop.run(getattr(self._client, name)(*args, **kwargs))

    else:
        return None
    functools.update_wrapper(twin, method)
    del twin.__wrapped__  # type: ignore[attr-defined]  # the signature below is the truth
    twin.__qualname__ = f"Client.{name}"
    twin.__module__ = __name__
    twin.__signature__ = signature.replace(return_annotation=returns)  # type: ignore[attr-defined]
    twin.__annotations__ = {**method.__annotations__, "return": returns}
    return twin


def _mirrors(source: type) -> Callable[[C], C]:
    """Class decorator: give the class a blocking twin of every public coroutine or
    async-generator method of ``source`` (its bases' included) that it does not define
    itself."""

    def derive(cls: C) -> C:
        members = {}
        for base in reversed(source.__mro__[:-1]):  # its bases' methods too, overridden last
            members.update(vars(base))
        for name, member in members.items():
            if name.startswith("_") or name in vars(cls):
                continue
            twin = _blocking_twin(name, member)
            if twin is not None:
                setattr(cls, name, twin)
        return cls

    return derive


@_mirrors(AsyncClient)
class Client:
    """Blocking client of one worker: every :class:`AsyncClient` method, blocking
    (``generate`` returns an iterator; leaving it early, or closing it, cancels the call).

    Takes the same arguments as :class:`AsyncClient`. Safe to call from several threads
    and from inside a running event loop. :meth:`close` (or leaving the ``with`` block)
    cancels calls still in flight and stops the client's loop thread.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self._loop = _LoopThread(f"sglang-admin-client {target}")
        options = {"api_key": api_key, "tls_ca": tls_ca, "tls_cert": tls_cert,
                   "tls_key": tls_key, "timeout": timeout}
        try:
            self._client = self._loop.run(_open(target, options))
        except BaseException:
            self._loop.stop(_nothing)
            raise
        # close() at the latest when the client is garbage-collected or the process exits
        self._finalizer = weakref.finalize(self, self._loop.stop, self._client.close)

    @property
    def target(self) -> str:
        """The worker's ``host:port``."""
        return self._client.target

    @property
    def timeout(self) -> float | None:
        """The per-call deadline in seconds (``None``: none)."""
        return self._client.timeout

    @property
    def metadata(self) -> Metadata:
        """The metadata every call carries (the ``authorization`` header)."""
        return self._client.metadata

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._loop.closed

    def call(self, fn: Callable[[AsyncClient], Awaitable[T]]) -> T:
        """Run ``fn(async_client)`` on the client's loop and return its result: any call
        the methods do not cover, e.g. ``client.call(lambda c: c.stub.Embed(req))``."""

        async def run() -> T:
            return await fn(self._client)

        return self._loop.run(run())

    def _iterate(self, stream: AsyncIterator[T]) -> Iterator[T]:
        """A blocking iterator over an async one that lives on the client's loop."""
        try:
            while True:
                item = self._loop.run(_next(stream))
                if item is _END:
                    return
                yield item  # type: ignore[misc]
        finally:
            with contextlib.suppress(ClientClosedError):  # close() already ended the call
                self._loop.run(_aclose(stream))

    def close(self) -> None:
        """Close the channel (in-flight calls are cancelled) and stop the loop thread;
        calling it again does nothing. A client never closed is closed when collected."""
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _nothing() -> None:
    """The last step of a loop whose client never opened."""
