"""The rank's handlers, registered by the message they handle: ``@handles(FlushCacheReq)`` on a
function ``(rank, msg) -> None`` of an ops module puts it in :data:`HANDLERS`, which the rank
process reads once every ops module is imported (scheduler/rank/process.py)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

Handler = Callable[[Any, Any], None]  # (the Rank it runs on, the message)
H = TypeVar("H", bound=Handler)

HANDLERS: dict[type, Handler] = {}


def handles(*message_types: type) -> Callable[[H], H]:
    """Register the decorated function as the rank's handler of ``message_types``; a type
    has one handler (a second registration is a programming error)."""

    def register(handler: H) -> H:
        for cls in message_types:
            other = HANDLERS.get(cls)
            if other is not None and other is not handler:
                raise ValueError(f"{cls.__name__} is handled by {other.__qualname__} already")
            HANDLERS[cls] = handler
        return handler

    return register


def op_name(msg: Any) -> str:
    """The op a message asks for, as logged and traced: FlushCacheReq -> flush_cache."""
    return _op_name(type(msg))


@functools.cache
def _op_name(cls: type) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.removesuffix("Req")).lower()
