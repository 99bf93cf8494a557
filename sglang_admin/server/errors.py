"""What the server's handlers answer besides a message: a refusal with its gRPC status
(:class:`ServiceError`, turned into the call's status by the interceptor) or a response
already serialized (:class:`Serialized`)."""

from __future__ import annotations

import grpc

MAX_REQUEST_ID_CHARS = 512  # echoed in every response and log line


class Serialized:
    """A response already in its wire form (``data``): the server's handlers send it as it
    is (see ``interceptors.passing_serialized``). An answer whose bulk never changes keeps
    that part serialized once and appends what does change (protobuf merges concatenated
    messages)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class ServiceError(Exception):
    """A refusal with a gRPC status code and a message for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)
