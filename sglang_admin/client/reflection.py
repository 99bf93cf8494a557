"""Server reflection from the client side: which services and methods a worker offers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from sglang_admin.pb import common_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name

Metadata = tuple[tuple[str, str], ...]


def full_rpc_name(rpc: str) -> tuple[str, str]:
    """``"Service/Method"`` as (full service name, method); a service name without a
    package is taken to be in the SglangScheduler's package."""
    service, sep, method = rpc.strip("/").rpartition("/")
    if not sep or not service or not method:
        raise ValueError(f"RPC name must look like Service/Method, got {rpc!r}")
    if "." not in service:
        service = f"{SERVICE.rpartition('.')[0]}.{service}"
    return service, method


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


def list_services(
    channel: grpc.Channel, timeout: float | None, metadata: Metadata
) -> dict[str, list[str]]:
    """Service name -> method names, through server reflection over a blocking channel. A
    service the server lists but cannot describe maps to an empty list."""
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
