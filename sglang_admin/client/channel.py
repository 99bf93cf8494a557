"""How a client reaches a server: TLS credentials from PEM files, and the bearer metadata of
an API key."""

from __future__ import annotations

import grpc

from sglang_admin.client.reflection import Metadata


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


def bearer_metadata(api_key: str | None) -> Metadata:
    """``authorization: Bearer KEY`` call metadata, or none without a key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
