"""``sglang-admin lora load|unload|list``: the LoRA RPCs over every ``--target``."""

from __future__ import annotations

import argparse

from sglang_admin.client.client import AsyncClient
from sglang_admin.client.command_base import Command, Outcome, to_dict
from sglang_admin.client.refit_commands import rank_lines
from sglang_admin.pb import common_pb2 as pb

LORA_HELP = "LoRA adapters: load, unload, list"


async def call_load(client: AsyncClient, ns: argparse.Namespace) -> pb.LoadLoRAAdapterResponse:
    return await client.load_lora_adapter(ns.name, ns.path, ns.lora_id or ns.name, ns.pinned)


async def call_unload(client: AsyncClient, ns: argparse.Namespace
                      ) -> pb.UnloadLoRAAdapterResponse:
    return await client.unload_lora_adapter(lora_id=ns.lora_id or "", lora_name=ns.name or "")


async def call_list(client: AsyncClient, ns: argparse.Namespace
                    ) -> pb.ListLoadedLoRAAdaptersResponse:
    return await client.list_lora_adapters()


def render_change(resp: pb.LoadLoRAAdapterResponse | pb.UnloadLoRAAdapterResponse) -> Outcome:
    text = resp.message or ("done" if resp.success else "failed")
    text += f"  loaded: {', '.join(resp.loaded_lora_ids) or '(none)'}"
    return Outcome(resp.success, text, to_dict(resp), rank_lines(resp.rank_results))


def render_list(resp: pb.ListLoadedLoRAAdaptersResponse) -> Outcome:
    details = [
        f"{a.lora_id}  name={a.lora_name} path={a.lora_path}" + ("  pinned" if a.pinned else "")
        for a in resp.loaded_adapters
    ]
    return Outcome(True, f"{len(resp.loaded_adapters)} adapter(s) loaded", to_dict(resp),
                   details)


def _load_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="the adapter's name (lora_name)")
    p.add_argument("path", metavar="PATH", help="PEFT adapter directory, as the server sees it")
    p.add_argument("--id", dest="lora_id", default="", help="lora_id to mint (default: NAME)")
    p.add_argument("--pinned", action="store_true", help="never evicted to make room")


def _unload_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", dest="lora_id", help="the adapter's lora_id")
    which.add_argument("--name", help="the adapter's lora_name")


LORA_COMMANDS: list[Command] = [
    Command("load", "load a PEFT LoRA adapter on every rank",
            "SglangScheduler/LoadLoRAAdapter", call_load, render_change, _load_arguments),
    Command("unload", "unload an adapter (waits for the requests that use it)",
            "SglangScheduler/UnloadLoRAAdapter", call_unload, render_change, _unload_arguments),
    Command("list", "the adapters loaded now",
            "SglangScheduler/ListLoadedLoRAAdapters", call_list, render_list),
]
