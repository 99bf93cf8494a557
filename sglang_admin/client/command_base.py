"""The pieces every ``sglang-admin`` client subcommand is made of: :class:`Command` (one
subcommand), :class:`Outcome` (how one target's answer reads), :class:`Summary` (what the
answers of all targets say together) and :func:`to_dict`."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from google.protobuf.message import Message

if TYPE_CHECKING:
    from sglang_admin.client.client import AsyncClient
    from sglang_admin.client.fanout import TargetResult

Call = Callable[["AsyncClient", argparse.Namespace], Awaitable[Any]]


@dataclass(frozen=True)
class Outcome:
    """How one target's value reads: success, a one-line summary, extra indented lines
    for the human output, and the JSON fields."""

    ok: bool
    text: str
    data: dict[str, Any]
    details: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Summary:
    """What the answers of every target say together (e.g. whether their weight digests
    agree): one closing line of the human output, and fields added to every target's JSON
    object. ``ok`` false makes the command fail even when each target succeeded."""

    ok: bool
    text: str
    data: dict[str, Any] = field(default_factory=dict)


Render = Callable[[Any], Outcome]
Summarize = Callable[[Sequence["TargetResult[Any]"]], Summary]


def to_dict(message: Message) -> dict[str, Any]:
    """A proto message as JSON-ready data, proto field names, zero values included."""
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """A subcommand with only the common options."""


@dataclass(frozen=True)
class Command:
    """One client subcommand: its name and help, the ``"Service/Method"`` a target's
    reflection must list (``None``: no check), the call, how its value reads, the
    subcommand's own arguments (beside the common options), and optionally what all
    targets' answers say together."""

    name: str
    help: str
    rpc: str | None
    call: Call
    render: Render
    arguments: Callable[[argparse.ArgumentParser], None] = no_arguments
    summarize: Summarize | None = None
