"""Clients of the SglangScheduler service: :class:`AsyncClient` (grpc.aio, the one source
of every RPC method), :class:`Client` (its blocking twin, derived from it) and
:class:`FanOut`/:func:`fan_out` (one call on many workers at once). How to add an RPC:
the docstring of :mod:`sglang_admin.client.client`."""

from sglang_admin.client.blocking import Client, ClientClosedError
from sglang_admin.client.client import DEFAULT_TARGET, AsyncClient
from sglang_admin.client.errors import ClientError, DownloadError
from sglang_admin.client.fanout import SKIPPED, FanOut, TargetResult, fan_out
from sglang_admin.client.generate_result import GenerateResult

__all__ = [
    "DEFAULT_TARGET",
    "SKIPPED",
    "AsyncClient",
    "Client",
    "ClientClosedError",
    "ClientError",
    "DownloadError",
    "FanOut",
    "GenerateResult",
    "TargetResult",
    "fan_out",
]
