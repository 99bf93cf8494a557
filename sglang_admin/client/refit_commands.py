"""The ``sglang-admin`` subcommands of the RL refit surface (pause, continue,
update-weights, weight-version, get-weights, check-weights, release-memory, resume-memory)
and ``abort`` (one request, or ``--all``). Each is one :class:`Command` in
:data:`REFIT_COMMANDS`; ``commands.py`` runs them over every ``--target``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from sglang_admin.client.client import AsyncClient
from sglang_admin.client.command_base import Command, Outcome, Summary, to_dict
from sglang_admin.client.fanout import TargetResult
from sglang_admin.constants import MEMORY_TAGS
from sglang_admin.pb import common_pb2 as pb

PAUSE_MODES = ("abort", "retract", "in_place")
SHOWN_VALUES = 8  # values of a parameter printed by get-weights (JSON has them all)


# ---------------------------------------------------------------------- renderers


def rank_lines(results: Sequence[pb.RankResult]) -> list[str]:
    """One line per rank: its outcome and message."""
    return [
        f"rank {r.dp_rank}: {'OK' if r.success else 'FAILED'}"
        + (f"  {r.message}" if r.message else "")
        for r in results
    ]


def render_admin(resp: pb.AdminResponse) -> Outcome:
    """ContinueGeneration, UpdateWeightVersion, Release/ResumeMemoryOccupation."""
    text = resp.message or ("done" if resp.success else "failed")
    details = rank_lines(resp.rank_results)
    released = sum(r.bytes_released for r in resp.rank_results)
    if released:
        text += f" ({released} bytes released in all)"
    return Outcome(resp.success, text, to_dict(resp), details)


def render_pause(resp: pb.PauseGenerationResponse) -> Outcome:
    text = resp.message or ("paused" if resp.success else "pause failed")
    details = [
        f"{line}  paused={r.num_paused_requests}"
        for line, r in zip(rank_lines(resp.rank_results), resp.rank_results, strict=True)
    ]
    return Outcome(resp.success, f"{text}  num_paused_requests={resp.num_paused_requests}",
                   to_dict(resp), details)


def render_update_weights(resp: pb.UpdateWeightsResponse) -> Outcome:
    text = resp.message or ("updated" if resp.success else "update failed")
    text += f"  model_path={resp.model_path} weight_version={resp.weight_version!r}"
    return Outcome(resp.success, text, to_dict(resp), rank_lines(resp.rank_results))


def render_get_weights(resp: pb.GetWeightsByNameResponse) -> Outcome:
    if not resp.success:
        return Outcome(False, resp.message or "failed", to_dict(resp),
                       rank_lines(resp.rank_results))
    shown = ", ".join(f"{v:.6g}" for v in resp.values[:SHOWN_VALUES])
    more = ", ..." if len(resp.values) > SHOWN_VALUES else ""
    text = f"shape={list(resp.shape)} values ({len(resp.values)}): [{shown}{more}]"
    return Outcome(True, text, to_dict(resp), rank_lines(resp.rank_results))


def render_check_weights(resp: pb.CheckWeightsResponse) -> Outcome:
    text = f"digest={resp.digest}" if resp.digest else (resp.message or "failed")
    if resp.digest and resp.message:
        text += f"  ({resp.message})"
    details = [
        f"rank {r.dp_rank}: {r.digest or 'FAILED'}" + (f"  {r.message}" if r.message else "")
        for r in resp.rank_results
    ]
    return Outcome(resp.success, text, to_dict(resp), details)


def render_abort(resp: pb.AbortResponse) -> Outcome:
    return Outcome(resp.success, resp.message or ("aborted" if resp.success else "failed"),
                   to_dict(resp))


def summarize_digests(results: Sequence[TargetResult[Any]]) -> Summary:
    """Whether every rank of every target holds the same weights (check-weights)."""
    digests: dict[str, list[str]] = {}
    for res in results:
        if res.ok and isinstance(res.value, pb.CheckWeightsResponse):
            ranks = [r.digest for r in res.value.rank_results]
            if ranks and all(ranks):
                digests[res.target] = ranks
    answered = len(digests) == len(results)
    distinct = {d for ranks in digests.values() for d in ranks}
    ranks = sum(len(v) for v in digests.values())
    agree = answered and len(distinct) == 1
    if agree:
        text = f"all {len(results)} target(s), {ranks} rank(s) in all, agree: {distinct.pop()}"
    elif not answered:
        text = (f"cannot tell whether the weights agree: {len(results) - len(digests)} "
                "target(s) gave no digest for every rank")
    else:
        text = f"the weights DIFFER: {len(distinct)} distinct digests over {ranks} rank(s)"
    return Summary(agree, text, {"all_agree": agree})


# ---------------------------------------------------------------------- calls


async def call_pause(client: AsyncClient, ns: argparse.Namespace) -> pb.PauseGenerationResponse:
    return await client.pause_generation(ns.mode)


async def call_continue(client: AsyncClient, ns: argparse.Namespace) -> pb.AdminResponse:
    return await client.continue_generation(ns.torch_empty_cache)


async def call_update_weights(
    client: AsyncClient, ns: argparse.Namespace
) -> pb.UpdateWeightsResponse:
    return await client.update_weights_from_disk(
        ns.model_path,
        load_format=ns.load_format,
        abort_all_requests=ns.abort_all_requests,
        weight_version=ns.weight_version,
        flush_cache=ns.flush_cache,
        torch_empty_cache=ns.torch_empty_cache,
    )


async def call_weight_version(client: AsyncClient, ns: argparse.Namespace) -> pb.AdminResponse:
    return await client.update_weight_version(ns.new_version, ns.abort_all_requests)


async def call_get_weights(
    client: AsyncClient, ns: argparse.Namespace
) -> pb.GetWeightsByNameResponse:
    return await client.get_weights_by_name(ns.name, ns.truncate_size)


async def call_check_weights(
    client: AsyncClient, ns: argparse.Namespace
) -> pb.CheckWeightsResponse:
    return await client.check_weights(ns.action)


async def call_release_memory(client: AsyncClient, ns: argparse.Namespace) -> pb.AdminResponse:
    return await client.release_memory_occupation(ns.tags or ())


async def call_resume_memory(client: AsyncClient, ns: argparse.Namespace) -> pb.AdminResponse:
    return await client.resume_memory_occupation(ns.tags or ())


async def call_abort(client: AsyncClient, ns: argparse.Namespace) -> pb.AbortResponse:
    return await client.abort(ns.request_id or "", ns.reason, abort_all=ns.all)


# ---------------------------------------------------------------------- parsers


def _pause_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=PAUSE_MODES, default="abort",
                   help="abort: abort what runs; retract: requeue it and free its KV (a flush "
                   "then succeeds); in_place: hold it with its KV (default abort)")


def _continue_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--torch-empty-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="release cached accelerator memory first (default yes)")


def _update_weights_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", required=True, metavar="DIR",
                   help="checkpoint directory (as the server sees it) of the served architecture")
    p.add_argument("--load-format", default="", choices=("", "auto", "safetensors", "gguf"))
    p.add_argument("--abort-all-requests", action="store_true",
                   help="abort every request first instead of waiting for them")
    p.add_argument("--weight-version", default="", help="label set on success")
    p.add_argument("--flush-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="flush the prefix cache after the load (default yes)")
    p.add_argument("--torch-empty-cache", action="store_true")


def _weight_version_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("new_version", metavar="VERSION", help="the label GetModelInfo reports")
    p.add_argument("--abort-all-requests", action=argparse.BooleanOptionalAction, default=True,
                   help="abort every request in flight first (default yes, as SGLang)")


def _get_weights_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="e.g. model.layers.0.mlp.up_proj.weight")
    p.add_argument("--truncate-size", type=int, default=100,
                   help="values of the flattened parameter to return (default 100)")


def _check_weights_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--action", default="checksum", help="checksum (the default)")


def _memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tags", nargs="+", choices=MEMORY_TAGS, metavar="TAG",
                   help="kv_cache, weights (default: both)")


def _abort_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--request-id", help="the request to abort")
    which.add_argument("--all", action="store_true",
                       help="every request in flight on every rank (an admin op)")
    p.add_argument("--reason", default="", help="reported to the aborted requests")


REFIT_COMMANDS: list[Command] = [
    Command("pause", "pause generation on every rank (new requests wait)",
            "SglangScheduler/PauseGeneration", call_pause, render_pause, _pause_arguments),
    Command("continue", "continue generation after a pause",
            "SglangScheduler/ContinueGeneration", call_continue, render_admin,
            _continue_arguments),
    Command("update-weights", "load a checkpoint directory into the live model",
            "SglangScheduler/UpdateWeightsFromDisk", call_update_weights,
            render_update_weights, _update_weights_arguments),
    Command("weight-version", "set the weight version label",
            "SglangScheduler/UpdateWeightVersion", call_weight_version, render_admin,
            _weight_version_arguments),
    Command("get-weights", "the shape and first values of one parameter",
            "SglangScheduler/GetWeightsByName", call_get_weights, render_get_weights,
            _get_weights_arguments),
    Command("check-weights", "a digest of every parameter per rank; whether all agree",
            "SglangScheduler/CheckWeights", call_check_weights, render_check_weights,
            _check_weights_arguments, summarize_digests),
    Command("release-memory", "free the KV pool and/or the weights of an idle worker",
            "SglangScheduler/ReleaseMemoryOccupation", call_release_memory, render_admin,
            _memory_arguments),
    Command("resume-memory", "allocate released memory again (weights reloaded from their "
            "checkpoint)", "SglangScheduler/ResumeMemoryOccupation", call_resume_memory,
            render_admin, _memory_arguments),
    Command("abort", "abort one request, or --all requests", "SglangScheduler/Abort",
            call_abort, render_abort, _abort_arguments),
]
