"""The TP group's commands and answers as msgpack bytes in uint8 tensors: no pickle.

``torch.distributed.broadcast_object_list`` and ``all_gather_object`` pickle, so any process
that can reach a rank's group port could run code in it. Here every command TP rank 0 sends
its followers (a step's batch, a refit, an adapter, a profile start) and every answer they
gather travels as msgpack: primitives, lists, dicts; a tensor as an extension (dtype from a
closed list, shape, raw bytes); a tuple or a record as an array led by a one-byte tag, the
record's type an index into the closed :data:`RECORDS` registry, its fields set one by one
(no constructor runs, no class named by the sender). Anything else is refused on the
sending side (:class:`WireError`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from sglang_admin.messages import ProfileStopResult, SamplingParams, StartProfileReq
from sglang_admin.model.lora import AdapterWeights
from sglang_admin.model.step_io import SeqInput
from sglang_admin.scheduler.embedding import EmbedProgress

_TUPLE, _TENSOR, _RECORD = 1, 2, 3

# The record types a command may hold, by index (the wire carries the index, never a name).
RECORDS: tuple[type, ...] = (SeqInput, SamplingParams, StartProfileReq, ProfileStopResult,
                             AdapterWeights, EmbedProgress)
_RECORD_CODE = {cls: i for i, cls in enumerate(RECORDS)}
_RECORD_FIELDS = tuple(tuple(f.name for f in dataclasses.fields(cls)) for cls in RECORDS)

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class WireError(ValueError):
    """A value that the TP group's wire does not carry, or bytes that do not decode."""


class _Mark:
    """What a tuple's or a record's leading tag decodes to, until its array is complete."""

    __slots__ = ("record",)

    def __init__(self, record: int) -> None:
        self.record = record  # -1: a tuple


# A tuple or a record travels as a plain array whose first item is a small extension (its
# tag): one packb per command, not one per record (a step carries two records a sequence).
_TUPLE_TAG = msgpack.ExtType(_TUPLE, b"")
_RECORD_TAGS = tuple(msgpack.ExtType(_RECORD, bytes([i])) for i in range(len(RECORDS)))
_TUPLE_MARK = _Mark(-1)
_RECORD_MARKS = tuple(_Mark(i) for i in range(len(RECORDS)))
_RECORD_VALUES = tuple(
    (lambda obj, names=names: [getattr(obj, n) for n in names]) for names in _RECORD_FIELDS)


def _default(obj: Any) -> Any:
    code = _RECORD_CODE.get(type(obj))
    if code is not None:
        return [_RECORD_TAGS[code], *_RECORD_VALUES[code](obj)]
    if isinstance(obj, tuple):
        return [_TUPLE_TAG, *obj]
    if isinstance(obj, torch.Tensor):
        dtype_code = _DTYPE_CODE.get(obj.dtype)
        if dtype_code is None:
            raise WireError(f"a tensor of dtype {obj.dtype} does not travel to the TP ranks")
        flat = obj.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return msgpack.ExtType(_TENSOR, _pack([dtype_code, list(obj.shape), raw]))
    if isinstance(obj, (bool, int, float, str, bytes)):  # a subclass (an IntEnum, a str enum)
        for base in (bool, int, float, str, bytes):
            if isinstance(obj, base):
                return base(obj)
    raise WireError(f"a {type(obj).__name__} does not travel to the TP ranks")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _ext(code: int, data: bytes) -> Any:
    if code == _TUPLE and not data:
        return _TUPLE_MARK
    if code == _RECORD and len(data) == 1 and data[0] < len(RECORDS):
        return _RECORD_MARKS[data[0]]
    if code == _TENSOR:
        dtype_code, shape, raw = _unpack(data)
        if not (isinstance(dtype_code, int) and 0 <= dtype_code < len(_DTYPES)):
            raise WireError(f"unknown tensor dtype code {dtype_code!r}")
        dtype = _DTYPES[dtype_code]
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    raise WireError(f"unknown extension code {code} ({len(data)} bytes)")


def _array(items: list[Any]) -> Any:
    """A decoded array: a tuple or a record when its first item is a tag, else the list."""
    if not items or type(items[0]) is not _Mark:
        return items
    mark = items[0]
    if mark.record < 0:
        return tuple(items[1:])
    names = _RECORD_FIELDS[mark.record]
    if len(items) != len(names) + 1:
        raise WireError(f"a {RECORDS[mark.record].__name__} with {len(items) - 1} fields")
    obj = object.__new__(RECORDS[mark.record])
    for name, value in zip(names, items[1:]):
        object.__setattr__(obj, name, value)
    return obj


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext, list_hook=_array, raw=False,
                           strict_map_key=False, use_list=True)


def encode(obj: Any) -> bytes:
    """``obj`` as the wire's bytes; :class:`WireError` when something in it cannot travel."""
    return _pack(obj)


def decode(data: bytes) -> Any:
    """The value :func:`encode` made of ``data``; :class:`WireError` on bytes that do not
    decode (msgpack's own errors are turned into it)."""
    try:
        return _unpack(data)
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError, RuntimeError) as exc:
        raise WireError(f"undecodable TP command: {type(exc).__name__}: {exc}") from None


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t if device.type == "cpu" else t.to(device)


def broadcast(obj: Any, rank: int, group: dist.ProcessGroup | None,
              device: torch.device, counter: list[int] | None = None) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (the others pass None): its length, then
    its bytes, two tensor broadcasts. ``counter[0]`` grows by the bytes sent."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    data = b""
    if rank == 0:
        data = encode(obj)
        size.fill_(len(data))
    dist.broadcast(size, src=0, group=group)
    n = int(size.item())
    if counter is not None:
        counter[0] += n + 8
    buf = (_bytes_tensor(data, device) if rank == 0
           else torch.empty(n, dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=0, group=group)
    if rank == 0:
        return obj
    return decode(buf.cpu().numpy().tobytes())


def gather(obj: Any, world: int, group: dist.ProcessGroup | None,
           device: torch.device) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank: the lengths, then the bytes
    padded to the longest, two all-gathers."""
    data = encode(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[:len(data)] = _bytes_tensor(data, device)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [decode(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, lengths)]
