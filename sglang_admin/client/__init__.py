"""Clients of the SglangScheduler service: :class:`Client` (blocking), :class:`AsyncClient`
(grpc.aio) and :class:`FanOut`/:func:`fan_out` (one call on many workers at once)."""

from sglang_admin.client.client import (
    DEFAULT_TARGET,
    SKIPPED,
    AsyncClient,
    Client,
    ClientError,
    DownloadError,
    FanOut,
    GenerateResult,
    TargetResult,
    fan_out,
)

__all__ = [
    "DEFAULT_TARGET",
    "SKIPPED",
    "AsyncClient",
    "Client",
    "ClientError",
    "DownloadError",
    "FanOut",
    "GenerateResult",
    "TargetResult",
    "fan_out",
]
