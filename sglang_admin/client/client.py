"""Typed clients of the SglangScheduler service, sync (:class:`Client`) and async
(:class:`AsyncClient`), and a multi-target fan-out (:class:`FanOut`, :func:`fan_out`).

The methods return the proto messages of ``sglang_admin.pb.common_pb2`` as they come off
the wire. Failed calls raise ``grpc.RpcError`` (``code()``/``details()``); a profile
download whose bytes do not match the server's digest raises :class:`DownloadError`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, Generic, NamedTuple, TypeVar

import grpc
import grpc.aio
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc

T = TypeVar("T")

SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
DEFAULT_TARGET = "127.0.0.1:30000"
SKIPPED = "SKIPPED"
# The server may send messages up to 64 MiB (its send limit); accept them.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 64 << 20)]

Metadata = tuple[tuple[str, str], ...]


class ClientError(Exception):
    """A call succeeded on the wire but its answer is unusable; ``code`` names the kind."""

    code = "CLIENT_ERROR"


class DownloadError(ClientError):
    """A downloaded file is inconsistent: bad name, out-of-order chunk or digest mismatch."""

    code = "DATA_LOSS"


@dataclass(frozen=True)
class GenerateResult:
    """The tokens of one Generate call and its final message."""

    tokens: list[int]
    complete: pb.GenerateComplete


# ---------------------------------------------------------------------- shared helpers


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def channel_credentials(
    tls_ca: str | None, tls_cert: str | None, tls_key: str | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials when any TLS file is given (``tls_cert`` and ``tls_key`` together,
    for mutual TLS); ``None`` means plaintext."""
    if not (tls_ca or tls_cert or tls_key):
        return None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca),
        private_key=_read(tls_key),
        certificate_chain=_read(tls_cert),
    )


def _metadata(api_key: str | None) -> Metadata:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def full_rpc_name(rpc: str) -> tuple[str, str]:
    """``"Service/Method"`` as (full service name, method); a service name without a
    package is taken to be in the SglangScheduler's package."""
    service, sep, method = rpc.strip("/").rpartition("/")
    if not sep or not service or not method:
        raise ValueError(f"RPC name must look like Service/Method, got {rpc!r}")
    if "." not in service:
        service = f"{SERVICE.rpartition('.')[0]}.{service}"
    return service, method


def generate_request(
    input_ids: Sequence[int],
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    stream: bool = False,
    *,
    request_id: str = "",
    ignore_eos: bool = False,
    data_parallel_rank: int | None = None,
    sampling_params: pb.SamplingParams | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; ``sampling_params`` (when given) is the base that the other
    sampling arguments override."""
    params = pb.SamplingParams()
    if sampling_params is not None:
        params.CopyFrom(sampling_params)
    params.temperature = temperature
    if max_new_tokens is not None:
        params.max_new_tokens = max_new_tokens
    if ignore_eos:
        params.ignore_eos = True
    req = pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=list(input_ids)),
        sampling_params=params,
        stream=stream,
    )
    if data_parallel_rank is not None:
        req.data_parallel_rank = data_parallel_rank
    return req


def start_profile_request(
    *,
    output_dir: str | None = None,
    start_step: int | None = None,
    num_steps: int | None = None,
    activities: Sequence[str] = (),
    with_stack: bool | None = None,
    record_shapes: bool | None = None,
    profile_by_stage: bool = False,
    merge_profiles: bool | None = None,
    profile_prefix: str | None = None,
    profile_stages: Sequence[str] = (),
) -> pb.StartProfileRequest:
    """A StartProfileRequest with only the given optional fields set."""
    optional: dict[str, Any] = {
        "output_dir": output_dir,
        "start_step": start_step,
        "num_steps": num_steps,
        "with_stack": with_stack,
        "record_shapes": record_shapes,
        "merge_profiles": merge_profiles,
        "profile_prefix": profile_prefix,
    }
    return pb.StartProfileRequest(
        activities=list(activities),
        profile_by_stage=profile_by_stage,
        profile_stages=list(profile_stages),
        **{k: v for k, v in optional.items() if v is not None},
    )


def _collect(responses: Sequence[pb.GenerateResponse], stream: bool) -> GenerateResult:
    """Tokens of a finished call: the chunks' tokens when streaming, else the final ids."""
    tokens: list[int] = []
    complete: pb.GenerateComplete | None = None
    for resp in responses:
        if resp.HasField("chunk"):
            tokens.extend(resp.chunk.token_ids)
        elif resp.HasField("complete"):
            complete = resp.complete
    if complete is None:
        raise ClientError("Generate ended without a GenerateComplete")
    return GenerateResult(tokens if stream else list(complete.output_ids), complete)


class _ProfileWriter:
    """Writes DownloadProfile chunks under one directory, checking each file's offsets
    and sha256; a file is renamed into place only once its digest matched."""

    def __init__(self, dest_dir: str | os.PathLike[str]) -> None:
        self.dest = Path(dest_dir)
        self.written: list[Path] = []
        self._name: str | None = None
        self._file: Any = None
        self._hash = hashlib.sha256()
        self._size = 0

    def _path(self, name: str) -> Path:
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts:
            raise DownloadError(f"refusing unsafe file name {name!r}")
        return self.dest.joinpath(*rel.parts)

    def add(self, chunk: pb.ProfileFileChunk) -> None:
        """Append one chunk; on a file's last chunk verify and publish it."""
        if self._name != chunk.file_name:
            if self._name is not None:
                raise DownloadError(f"{self._name}: ended without its last chunk")
            path = self._path(chunk.file_name)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._name = chunk.file_name
            self._file = open(f"{path}.part", "wb")  # noqa: SIM115 - closed at the last chunk
            self._hash = hashlib.sha256()
            self._size = 0
        if chunk.offset != self._size:
            raise DownloadError(
                f"{chunk.file_name}: chunk at offset {chunk.offset}, expected {self._size}"
            )
        self._file.write(chunk.data)
        self._hash.update(chunk.data)
        self._size += len(chunk.data)
        if chunk.last:
            self._finish_file(chunk.sha256)

    def _finish_file(self, expected: str) -> None:
        assert self._name is not None
        path = self._path(self._name)
        self._file.close()
        digest = self._hash.hexdigest()
        if expected.lower() != digest:
            os.unlink(f"{path}.part")
            raise DownloadError(
                f"{self._name}: sha256 {digest} does not match the server's {expected or '(none)'}"
            )
        os.replace(f"{path}.part", path)
        self.written.append(path)
        self._name = None
        self._file = None

    def close(self) -> list[Path]:
        """The files written; raises if the stream stopped in the middle of a file."""
        if self._name is not None:
            self._file.close()
            os.unlink(f"{self._path(self._name)}.part")
            raise DownloadError(f"{self._name}: stream ended before its last chunk")
        return self.written


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Metadata | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _ClientCallDetails(_CallDetails, grpc.ClientCallDetails):
    """Concrete ``grpc.ClientCallDetails``."""


class _StreamDefaults(grpc.StreamStreamClientInterceptor):
    """Adds a deadline and metadata to stream-stream calls made by code that takes neither
    (the reflection descriptor database)."""

    def __init__(self, timeout: float | None, metadata: Metadata) -> None:
        self.timeout = timeout
        self.metadata = metadata

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
        request_iterator: Iterator[Any],
    ) -> Any:
        d = client_call_details
        details = _ClientCallDetails(
            d.method,
            d.timeout if d.timeout is not None else self.timeout,
            tuple(d.metadata or ()) + self.metadata,
            d.credentials,
            d.wait_for_ready,
            d.compression,
        )
        return continuation(details, request_iterator)


def _list_services(channel: grpc.Channel, timeout: float | None, metadata: Metadata) -> dict[str, list[str]]:
    """Service name -> method names, through server reflection. A service the server lists
    but cannot describe maps to an empty list."""
    db = ProtoReflectionDescriptorDatabase(
        grpc.intercept_channel(channel, _StreamDefaults(timeout, metadata))
    )
    pool = descriptor_pool.DescriptorPool(db)
    out: dict[str, list[str]] = {}
    for name in sorted(db.get_services()):
        try:
            service = pool.FindServiceByName(name)
        except KeyError:
            out[name] = []
        else:
            out[name] = [m.name for m in service.methods]
    return out


def offers(services: dict[str, list[str]], rpc: str) -> bool:
    """Whether a reflection listing offers ``Service/Method``. A listed service whose
    methods are unknown (no descriptor) counts as offering it."""
    service, method = full_rpc_name(rpc)
    if service not in services:
        return False
    methods = services[service]
    return not methods or method in methods


# ---------------------------------------------------------------------- sync client


class Client:
    """Blocking client of one worker.

    ``api_key`` is sent as ``authorization: Bearer KEY`` (use the admin key for the admin
    RPCs when the server has one); any of ``tls_ca``/``tls_cert``/``tls_key`` (PEM files)
    selects TLS; ``timeout`` is the per-call deadline in seconds (``None``: none).
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
        self.target = target
        self.timeout = timeout
        self.metadata = _metadata(api_key)
        creds = channel_credentials(tls_ca, tls_cert, tls_key)
        if creds is None:
            self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self._services: dict[str, list[str]] | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def _kw(self) -> dict[str, Any]:
        return {"timeout": self.timeout, "metadata": self.metadata}

    def health(self) -> pb.HealthCheckResponse:
        """SglangScheduler.HealthCheck: a round trip to every scheduler rank."""
        return self.stub.HealthCheck(pb.HealthCheckRequest(), **self._kw())

    def health_v1(self, service: str = "") -> str:
        """grpc.health.v1 status name (``SERVING``, ``NOT_SERVING``, ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), **self._kw())
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def model_info(self) -> pb.GetModelInfoResponse:
        """GetModelInfo."""
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._kw())

    def server_info(self) -> pb.GetServerInfoResponse:
        """GetServerInfo."""
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), **self._kw())

    def loads(self, include: Sequence[str] = (), dp_rank: int | None = None) -> pb.GetLoadsResponse:
        """GetLoads for the ``include`` sections (server default: core), one rank or all."""
        req = pb.GetLoadsRequest(include=list(include))
        if dp_rank is not None:
            req.dp_rank = dp_rank
        return self.stub.GetLoads(req, **self._kw())

    def flush_cache(self, timeout_s: float = 0.0) -> pb.FlushCacheResponse:
        """FlushCache; ``timeout_s`` > 0 waits that long for every rank to go idle."""
        return self.stub.FlushCache(pb.FlushCacheRequest(timeout_s=timeout_s), **self._kw())

    def start_profile(self, **fields: Any) -> pb.ProfileResponse:
        """StartProfile; ``fields`` are :func:`start_profile_request`'s arguments."""
        return self.stub.StartProfile(start_profile_request(**fields), **self._kw())

    def stop_profile(self) -> pb.ProfileResponse:
        """StopProfile: answers once every rank has written its traces."""
        return self.stub.StopProfile(pb.StopProfileRequest(), **self._kw())

    def download_profile(self, dest_dir: str | os.PathLike[str], *, profile_id: str = "") -> list[Path]:
        """DownloadProfile into ``dest_dir``; returns the files written, each verified
        against the sha256 on its last chunk (:class:`DownloadError` otherwise)."""
        writer = _ProfileWriter(dest_dir)
        for chunk in self.stub.DownloadProfile(
            pb.DownloadProfileRequest(profile_id=profile_id), **self._kw()
        ):
            writer.add(chunk)
        return writer.close()

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        stream: bool = False,
        **kwargs: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Generate: the responses as they arrive (chunks when ``stream``, then one
        complete). ``kwargs`` are :func:`generate_request`'s keyword arguments."""
        req = generate_request(input_ids, max_new_tokens, temperature, stream, **kwargs)
        return self.stub.Generate(req, **self._kw())

    def generate_tokens(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        stream: bool = False,
        **kwargs: Any,
    ) -> GenerateResult:
        """Run Generate to the end: the generated tokens and the GenerateComplete."""
        responses = list(self.generate(input_ids, max_new_tokens, temperature, stream, **kwargs))
        return _collect(responses, stream)

    def abort(self, request_id: str, reason: str = "") -> pb.AbortResponse:
        """Abort an in-flight request."""
        return self.stub.Abort(pb.AbortRequest(request_id=request_id, reason=reason), **self._kw())

    def services(self) -> dict[str, list[str]]:
        """Every service the server offers with its method names (server reflection)."""
        return _list_services(self.channel, self.timeout, self.metadata)

    def offers(self, rpc: str) -> bool:
        """Whether the server offers ``Service/Method`` (reflection, cached per client)."""
        if self._services is None:
            self._services = self.services()
        return offers(self._services, rpc)


# ---------------------------------------------------------------------- async client


class AsyncClient:
    """grpc.aio client of one worker; the same methods as :class:`Client`, awaitable
    (``generate`` is an async iterator). Create and use it inside one event loop."""

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
        self.target = target
        self.timeout = timeout
        self.metadata = _metadata(api_key)
        self._creds = channel_credentials(tls_ca, tls_cert, tls_key)
        if self._creds is None:
            self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.secure_channel(target, self._creds, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self._services: dict[str, list[str]] | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (in-flight calls are cancelled)."""
        await self.channel.close()

    def _kw(self) -> dict[str, Any]:
        return {"timeout": self.timeout, "metadata": self.metadata}

    async def health(self) -> pb.HealthCheckResponse:
        """SglangScheduler.HealthCheck: a round trip to every scheduler rank."""
        return await self.stub.HealthCheck(pb.HealthCheckRequest(), **self._kw())

    async def health_v1(self, service: str = "") -> str:
        """grpc.health.v1 status name (``SERVING``, ``NOT_SERVING``, ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), **self._kw())
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def model_info(self) -> pb.GetModelInfoResponse:
        """GetModelInfo."""
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._kw())

    async def server_info(self) -> pb.GetServerInfoResponse:
        """GetServerInfo."""
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), **self._kw())

    async def loads(
        self, include: Sequence[str] = (), dp_rank: int | None = None
    ) -> pb.GetLoadsResponse:
        """GetLoads for the ``include`` sections (server default: core), one rank or all."""
        req = pb.GetLoadsRequest(include=list(include))
        if dp_rank is not None:
            req.dp_rank = dp_rank
        return await self.stub.GetLoads(req, **self._kw())

    async def flush_cache(self, timeout_s: float = 0.0) -> pb.FlushCacheResponse:
        """FlushCache; ``timeout_s`` > 0 waits that long for every rank to go idle."""
        return await self.stub.FlushCache(pb.FlushCacheRequest(timeout_s=timeout_s), **self._kw())

    async def start_profile(self, **fields: Any) -> pb.ProfileResponse:
        """StartProfile; ``fields`` are :func:`start_profile_request`'s arguments."""
        return await self.stub.StartProfile(start_profile_request(**fields), **self._kw())

    async def stop_profile(self) -> pb.ProfileResponse:
        """StopProfile: answers once every rank has written its traces."""
        return await self.stub.StopProfile(pb.StopProfileRequest(), **self._kw())

    async def download_profile(
        self, dest_dir: str | os.PathLike[str], *, profile_id: str = ""
    ) -> list[Path]:
        """DownloadProfile into ``dest_dir``; returns the files written, each verified
        against the sha256 on its last chunk (:class:`DownloadError` otherwise)."""
        writer = _ProfileWriter(dest_dir)
        call = self.stub.DownloadProfile(
            pb.DownloadProfileRequest(profile_id=profile_id), **self._kw()
        )
        async for chunk in call:
            writer.add(chunk)
        return writer.close()

    async def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        stream: bool = False,
        **kwargs: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Generate: the responses as they arrive (chunks when ``stream``, then one
        complete). Leaving the loop early cancels the call (the server aborts it)."""
        req = generate_request(input_ids, max_new_tokens, temperature, stream, **kwargs)
        call = self.stub.Generate(req, **self._kw())
        try:
            async for resp in call:
                yield resp
        finally:
            call.cancel()

    async def generate_tokens(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        stream: bool = False,
        **kwargs: Any,
    ) -> GenerateResult:
        """Run Generate to the end: the generated tokens and the GenerateComplete."""
        responses = [
            r async for r in self.generate(input_ids, max_new_tokens, temperature, stream, **kwargs)
        ]
        return _collect(responses, stream)

    async def abort(self, request_id: str, reason: str = "") -> pb.AbortResponse:
        """Abort an in-flight request."""
        return await self.stub.Abort(
            pb.AbortRequest(request_id=request_id, reason=reason), **self._kw()
        )

    async def services(self) -> dict[str, list[str]]:
        """Every service the server offers with its method names (server reflection, run
        in a worker thread over a short-lived blocking channel)."""

        def run() -> dict[str, list[str]]:
            if self._creds is None:
                channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.secure_channel(self.target, self._creds, options=CHANNEL_OPTIONS)
            with channel:
                return _list_services(channel, self.timeout, self.metadata)

        return await asyncio.to_thread(run)

    async def offers(self, rpc: str) -> bool:
        """Whether the server offers ``Service/Method`` (reflection, cached per client)."""
        if self._services is None:
            self._services = await self.services()
        return offers(self._services, rpc)


# ---------------------------------------------------------------------- fan-out


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
    target (kept for the FanOut's life, with its reflection listing cached).

    Use as ``async with FanOut(targets, api_key=...) as fan: await fan.call(fn, rpc)``.
    """

    def __init__(self, targets: Sequence[str], **client_kwargs: Any) -> None:
        self.targets = list(dict.fromkeys(targets))
        self.client_kwargs = client_kwargs
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
            self.clients[target] = AsyncClient(target, **self.client_kwargs)
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
    **client_kwargs: Any,
) -> list[TargetResult[T]]:
    """One :meth:`FanOut.call` on a fresh :class:`FanOut`, closed afterwards."""
    async with FanOut(targets, **client_kwargs) as fan:
        return await fan.call(fn, rpc)
