"""The ``sglang-admin`` subcommands of weights pushed by a trainer: ``destroy-group`` (free
a weight-update group, e.g. one a dead trainer left behind) and ``join-group`` (have one
worker's ranks join a trainer's group, for a trainer that does not call the RPC itself).
``commands.py`` runs them over every ``--target``; ``join-group`` takes one target (each
worker needs its own ``--rank-offset``)."""

from __future__ import annotations

import argparse

from sglang_admin.client.client import AsyncClient
from sglang_admin.client.command_base import Command
from sglang_admin.client.refit_commands import render_admin
from sglang_admin.pb import common_pb2 as pb


async def call_join_group(client: AsyncClient, ns: argparse.Namespace) -> pb.AdminResponse:
    return await client.init_weights_update_group(
        ns.master_address, ns.master_port, ns.rank_offset, ns.world_size, ns.group_name,
        ns.backend)


async def call_destroy_group(client: AsyncClient, ns: argparse.Namespace) -> pb.AdminResponse:
    return await client.destroy_weights_update_group(ns.group_name)


def _join_group_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master-address", required=True, help="the trainer's host (rank 0)")
    p.add_argument("--master-port", required=True, type=int, help="its TCPStore port")
    p.add_argument("--rank-offset", required=True, type=int,
                   help="this worker's dp rank r joins as rank_offset + r")
    p.add_argument("--world-size", required=True, type=int)
    p.add_argument("--group-name", required=True)
    p.add_argument("--backend", default="", choices=("", "gloo", "nccl"),
                   help="default: the one that matches the device")


def _group_name_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group-name", required=True)


SYNC_COMMANDS: list[Command] = [
    Command("join-group", "every rank of the worker joins a trainer's weight-update group",
            "SglangScheduler/InitWeightsUpdateGroup", call_join_group, render_admin,
            _join_group_arguments),
    Command("destroy-group", "every rank leaves a weight-update group",
            "SglangScheduler/DestroyWeightsUpdateGroup", call_destroy_group, render_admin,
            _group_name_argument),
]
