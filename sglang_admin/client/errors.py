"""The client's own exceptions (failed calls raise ``grpc.RpcError`` as they come)."""

from __future__ import annotations


class ClientError(Exception):
    """A call succeeded on the wire but its answer is unusable; ``code`` names the kind."""

    code = "CLIENT_ERROR"


class DownloadError(ClientError):
    """A downloaded file is inconsistent: bad name, out-of-order chunk or digest mismatch."""

    code = "DATA_LOSS"
