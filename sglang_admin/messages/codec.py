"""The message codec: a registered message packed as a msgpack extension whose code is its
index in a closed registry, so only the types registered with ``@message``
(messages/types.py) can be decoded (no pickle, no arbitrary classes). Nested messages (a
``SamplingParams`` inside a ``GenerateReq``) travel the same way; a step's ``BatchOutput`` has a path of its own.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from sglang_admin.messages.replies import BatchOutput, ReqOutput
from sglang_admin.messages.types import REGISTRY

_REGISTRY: tuple[type, ...] = tuple(REGISTRY)  # every @message class of messages/types.py
_CODES: dict[type, int] = {cls: code for code, cls in enumerate(_REGISTRY)}


def _init_order(cls: type) -> tuple[str, ...]:
    """A message's field names in its constructor's order: positional fields first, then the
    keyword-only ones (RankCall's deadline and trace)."""
    fields = dataclasses.fields(cls)
    return (tuple(f.name for f in fields if not f.kw_only)
            + tuple(f.name for f in fields if f.kw_only))


_FIELDS: tuple[tuple[str, ...], ...] = tuple(_init_order(cls) for cls in _REGISTRY)
# per code: how many of its values are positional, and the names of the keyword-only rest
_POSITIONAL: tuple[int, ...] = tuple(
    sum(not f.kw_only for f in dataclasses.fields(cls)) for cls in _REGISTRY)
_KEYWORDS: tuple[tuple[str, ...], ...] = tuple(
    names[n:] for names, n in zip(_FIELDS, _POSITIONAL))
# each message's field values in one C call; a tuple packs as the same msgpack array as a
# list (a BatchOutput's ReqOutputs have a path of their own, below)
_VALUES: tuple[Callable[[Any], tuple[Any, ...]], ...] = tuple(
    operator.attrgetter(*names) if len(names) > 1
    else (lambda obj, get=operator.attrgetter(*names): (get(obj),)) if names
    else (lambda obj: ())
    for names in _FIELDS
)

Message = Any  # one of the registered dataclasses

# Initial buffer of each Packer (it grows as needed). msgpack's default, 256 KiB, is above
# glibc's mmap threshold: every packb, nested ones included, paid an mmap and a munmap
# (about 8 us per message part; 4 KiB makes a small message 8x cheaper to encode).
_BUF_SIZE = 4096


# The hot message, one per step: its ReqOutputs travel as plain arrays of their fields inside
# the BatchOutput's own ext (not one nested ext each), so a step costs one packb and one
# unpackb on either side instead of one per running request. An output whose fields after
# ``index`` hold their defaults travels as its first fields alone (the decoder's
# ReqOutput(*values) fills in the rest): a third of the values to pack.
_BATCH_CODE = _CODES[BatchOutput]
_OUTPUT_NAMES = _FIELDS[_CODES[ReqOutput]]
_OUTPUT_HEAD_LEN = _OUTPUT_NAMES.index("index") + 1
_OUTPUT_HEAD = operator.attrgetter(*_OUTPUT_NAMES[:_OUTPUT_HEAD_LEN])
_OUTPUT_TAIL = operator.attrgetter(*_OUTPUT_NAMES[_OUTPUT_HEAD_LEN:])
_OUTPUT_DEFAULT_TAIL = _OUTPUT_TAIL(ReqOutput("", [], 0, 0, 0))


def _output_values(out: ReqOutput) -> tuple[Any, ...]:
    tail = _OUTPUT_TAIL(out)
    head = _OUTPUT_HEAD(out)
    return head if tail == _OUTPUT_DEFAULT_TAIL else head + tail


def _default(obj: Any) -> msgpack.ExtType:
    code = _CODES.get(type(obj))
    if code is None:
        raise TypeError(f"type {type(obj).__name__} is not a registered message")
    if code == _BATCH_CODE:
        if not all(type(out) is ReqOutput for out in obj.outputs):
            raise TypeError("a BatchOutput holds something that is not a ReqOutput")
        values: Any = (obj.dp_rank, [_output_values(out) for out in obj.outputs])
    else:
        values = _VALUES[code](obj)
    return msgpack.ExtType(code, _pack(values))


class _Packers(threading.local):
    """Each thread's idle Packers. Making one per packb (its buffer allocated, its options
    parsed) cost several times the packing of a small message; a message packs its nested
    messages with further Packers of the pool while its own is busy."""

    def __init__(self) -> None:
        self.idle: list[msgpack.Packer] = []


_PACKERS = _Packers()


def _pack(obj: Any) -> bytes:
    idle = _PACKERS.idle
    packer = idle.pop() if idle else msgpack.Packer(
        default=_default, use_bin_type=True, buf_size=_BUF_SIZE)
    try:
        return packer.pack(obj)  # emptied by msgpack after packing, or after a failure
    finally:
        idle.append(packer)


def _ext_hook(code: int, data: bytes) -> Any:
    if not 0 <= code < len(_REGISTRY):
        raise ValueError(f"unknown message code {code}")
    values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    if code == _BATCH_CODE:
        dp_rank, outputs = values
        return BatchOutput(dp_rank, [ReqOutput(*out) for out in outputs])
    keywords = _KEYWORDS[code]
    if not keywords:
        return _REGISTRY[code](*values)
    n = _POSITIONAL[code]
    return _REGISTRY[code](*values[:n], **dict(zip(keywords, values[n:])))


def encode(msg: Message) -> bytes:
    """Serialize a registered message."""
    return _pack(msg)


def decode(data: bytes) -> Message:
    """Deserialize bytes made by :func:`encode`; raises on anything not registered."""
    msg = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    if type(msg) not in _CODES:
        raise ValueError("payload is not a registered message")
    return msg
