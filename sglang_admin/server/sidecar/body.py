"""Request bodies at the sidecar's edge: JSON text to a dict, and a dict to typed fields.

SGLang's routes take dataclasses (``io_struct.py``) that FastAPI validates; here each
route declares its fields as :class:`Field` rows and :func:`read_fields` checks a body
against them: a value of the wrong type, a required field left out, or a field the route
does not know is a :class:`BadRequest` (400) whose message names the field. ``null`` means
"not given" (the field's default), as in SGLang's dataclasses. The message never echoes the
value itself (it may be large or binary).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

INT32_MAX = (1 << 31) - 1
_INTEGER = re.compile(r"-?[0-9]{1,10}")

# what a field holds
TEXT = "text"  # a string
INTEGER = "integer"  # an int32 (a JSON integer, an integral number or a digit string)
FLAG = "flag"  # true or false
TEXTS = "texts"  # a list of strings
SHAPES = "shapes"  # a list of lists of non-negative integers (tensor shapes)
NULL = "null"  # accepted only as null: SGLang has the field, this server has no use for it


class BadRequest(Exception):
    """A request the edge refuses with 400; the message names the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Field:
    """One field of a route's JSON body.

    ``default`` is the value when the field is absent or null. ``only``: the one value
    this server supports (another is a 400 saying ``why``), for SGLang fields whose other
    values ask for something this server does not do.
    """

    name: str
    kind: str
    required: bool = False
    default: Any = None
    only: Any = None
    why: str = ""


def kind_of(value: Any) -> str:
    """A JSON value's type, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def json_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; no body (or only whitespace) is ``{}``."""
    if not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("invalid JSON in the request body: not UTF-8 text") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"invalid JSON in the request body: {exc.msg} (line {exc.lineno}, column "
            f"{exc.colno})"
        ) from None
    except (ValueError, RecursionError):  # a number of thousands of digits, deep nesting
        raise BadRequest("invalid JSON in the request body: too large or too deeply nested") \
            from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {kind_of(body)}")
    return body


def text(body: dict[str, Any], name: str) -> str | None:
    """A string field (None when absent or null); lone surrogates are refused."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{name}: expected a string, got {kind_of(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{name}: not valid Unicode text") from None
    return value


def texts(body: dict[str, Any], name: str) -> list[str]:
    """A list-of-strings field ([] when absent or null)."""
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{name}: expected a list of strings, got {kind_of(value)}"
                         + (" holding other values" if isinstance(value, list) else ""))
    for item in value:
        text({name: item}, name)
    return value


def flag(body: dict[str, Any], name: str) -> bool | None:
    """A boolean field (None when absent or null); 0/1 and "true" are not booleans."""
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise BadRequest(f"{name}: expected true or false, got {kind_of(value)}")


def integer(body: dict[str, Any], name: str) -> int | None:
    """An int32 field: a JSON integer, an integral number, or a string of decimal digits
    (``bench_serving`` sends ``"start_step": "5"``; SGLang's pydantic model takes it)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool):
        raise BadRequest(f"{name}: expected an integer, got a boolean")
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        value = int(value.strip())
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise BadRequest(f"{name}: expected an integer, got {kind_of(value)}")
    if value > INT32_MAX:
        raise BadRequest(f"{name}: must be at most {INT32_MAX}")
    if value < -INT32_MAX - 1:
        raise BadRequest(f"{name}: must be at least {-INT32_MAX - 1}")
    return value


def shapes(body: dict[str, Any], name: str) -> list[list[int]]:
    """A list of tensor shapes, each a list of non-negative integers ([] when absent)."""
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest(f"{name}: expected a list of shapes (lists of integers), got "
                         f"{kind_of(value)}")
    out = []
    for i, shape in enumerate(value):
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise BadRequest(f"{name}[{i}]: expected a list of integers, got {kind_of(shape)}"
                             + (" holding other values" if isinstance(shape, list) else ""))
        if any(not 0 <= d <= 1 << 40 for d in shape):
            raise BadRequest(f"{name}[{i}]: dimensions must be in [0, 2^40]")
        out.append(shape)
    return out


_READERS = {TEXT: text, INTEGER: integer, FLAG: flag, TEXTS: texts, SHAPES: shapes}


def read_fields(body: dict[str, Any], fields: Sequence[Field]) -> dict[str, Any]:
    """``body`` checked against ``fields``: every field's value (its default when absent or
    null). Unknown fields, missing required ones and wrong types are a BadRequest."""
    known = {f.name for f in fields}
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(repr(k)[:80] for k in unknown[:8])}; "
                         f"this route takes: {', '.join(f.name for f in fields)}")
    out: dict[str, Any] = {}
    for f in fields:
        if f.kind == NULL:
            if body.get(f.name) is not None:
                raise BadRequest(f"{f.name}: only null is accepted here: {f.why}")
            out[f.name] = None
            continue
        if body.get(f.name) is None:
            if f.required:
                raise BadRequest(f"{f.name}: required field missing")
            out[f.name] = f.default
            continue
        value = _READERS[f.kind](body, f.name)
        if f.only is not None and value is not None and value != f.only:
            raise BadRequest(f"{f.name}: only {json.dumps(f.only)} is supported here: {f.why}")
        out[f.name] = value
    return out
