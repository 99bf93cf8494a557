"""The client subcommands of ``sglang-admin``: each runs one call on every ``--target`` at
once and prints one result line per target (or, with ``--json``, one JSON object per
target per line). Each subcommand is one :class:`Command` entry in :data:`COMMANDS` (those
of the RL refit surface come from ``refit_commands.REFIT_COMMANDS``).

Exit status: 0 only when every target succeeded (and, for a command that compares the
targets' answers, such as ``check-weights``, when they agree). A call that failed (any
gRPC status, a bad download), a response that reports ``success: false`` or ``healthy:
false``, and a target skipped because its reflection does not list the RPC all count as
failures; a skipped target gets its own ``SKIPPED`` line (``"code": "SKIPPED"`` in JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from sglang_admin.client.channel import channel_credentials
from sglang_admin.client.client import DEFAULT_TARGET, AsyncClient
from sglang_admin.client.command_base import (
    Call,
    Command,
    Outcome,
    Render,
    Summarize,
    Summary,
    to_dict,
)
from sglang_admin.client.fanout import TargetResult, fan_out
from sglang_admin.client.generate_result import GenerateResult
from sglang_admin.client.lora_commands import LORA_COMMANDS, LORA_HELP
from sglang_admin.client.refit_commands import REFIT_COMMANDS
from sglang_admin.client.sync_commands import SYNC_COMMANDS
from sglang_admin.pb import common_pb2 as pb

# ---------------------------------------------------------------------- running


def targets_of(ns: argparse.Namespace) -> list[str]:
    """The ``--target`` values, deduplicated, or the default target."""
    return list(dict.fromkeys(ns.target or [DEFAULT_TARGET]))


def run_command(
    ns: argparse.Namespace, *, rpc: str | None, call: Call, render: Render,
    summarize: Summarize | None = None,
) -> int:
    """Fan ``call`` out over the targets, print the results, return the exit status."""
    try:
        channel_credentials(ns.tls_ca, ns.tls_cert, ns.tls_key)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = asyncio.run(
        fan_out(
            targets_of(ns),
            lambda client: call(client, ns),
            rpc if ns.check_rpc else None,
            api_key=ns.api_key,
            tls_ca=ns.tls_ca,
            tls_cert=ns.tls_cert,
            tls_key=ns.tls_key,
            timeout=ns.timeout,
        )
    )
    summary = summarize(results) if summarize is not None else None
    return report(results, render, as_json=ns.json, summary=summary)


def report(
    results: Sequence[TargetResult[Any]], render: Render, *, as_json: bool,
    summary: Summary | None = None,
) -> int:
    """Print one line (or JSON object) per target, then the summary's line (in JSON, its
    fields go into every target's object); 0 when every target succeeded and the summary
    (if any) is ok."""
    width = max((len(r.target) for r in results), default=0)
    failed = 0
    for res in results:
        outcome = render(res.value) if res.ok else None
        ok = outcome is not None and outcome.ok
        failed += not ok
        if as_json:
            obj: dict[str, Any] = {"target": res.target, "ok": ok}
            if outcome is not None:
                obj.update(outcome.data)
                if not ok:
                    obj["error"] = outcome.text
            else:
                obj.update(code=res.code, error=res.error)
            if summary is not None:
                obj.update(summary.data)
            print(json.dumps(obj), flush=True)
            continue
        if outcome is not None:
            print(f"{res.target:<{width}}  {'OK' if ok else 'FAILED'}  {outcome.text}")
            for line in outcome.details:
                print(f"    {line}")
        elif res.skipped:
            print(f"{res.target:<{width}}  SKIPPED  {res.error}")
        else:
            print(f"{res.target:<{width}}  FAILED  {res.code}: {res.error}")
    if summary is not None and not as_json:
        print(summary.text)
    sys.stdout.flush()
    return 1 if failed or (summary is not None and not summary.ok) else 0


# ---------------------------------------------------------------------- renderers


def render_flush(resp: pb.FlushCacheResponse) -> Outcome:
    text = resp.message or ("flushed" if resp.success else "flush failed")
    if resp.success and resp.rank_results:
        text += f" (tokens freed: {sum(r.tokens_freed for r in resp.rank_results)})"
    return Outcome(resp.success, text, to_dict(resp))


def render_profile(resp: pb.ProfileResponse) -> Outcome:
    parts = [resp.message or ("done" if resp.success else "failed")]
    if resp.profile_id:
        parts.append(f"profile_id={resp.profile_id}")
    if resp.files:
        parts.append(f"{len(resp.files)} file(s)")
    return Outcome(resp.success, "  ".join(parts), to_dict(resp), list(resp.files))


def render_files(files: list[Path]) -> Outcome:
    names = [str(f) for f in files]
    return Outcome(True, f"{len(files)} file(s) written", {"files": names}, names)


def render_server_info(resp: pb.GetServerInfoResponse) -> Outcome:
    args = resp.server_args
    # a protobuf Struct: no .get()
    model = args["served_model_name"] if "served_model_name" in args else "?"  # noqa: SIM401
    text = (
        f"version={resp.sglang_version} model={model} ranks={len(resp.rank_states)} "
        f"active_requests={resp.active_requests} uptime={resp.uptime_seconds:.0f}s"
    )
    details = [
        f"rank {s.dp_rank}: {s.device} running={s.num_running_reqs} "
        f"waiting={s.num_waiting_reqs} tokens={s.num_used_tokens}/{s.token_capacity} "
        f"(cached={s.num_evictable_tokens} free={s.num_free_tokens}) "
        f"profiler={s.profiler_state}"
        for s in resp.rank_states
    ]
    return Outcome(True, text, to_dict(resp), details)


def render_loads(resp: pb.GetLoadsResponse) -> Outcome:
    agg = resp.aggregate
    text = (
        f"ranks={resp.dp_rank_count} running={agg.total_running_reqs} "
        f"waiting={agg.total_waiting_reqs} token_usage={agg.avg_token_usage:.1%} "
        f"throughput={agg.avg_throughput:.1f} tok/s"
    )
    details = [
        f"rank {x.dp_rank}: running={x.num_running_reqs} waiting={x.num_waiting_reqs} "
        f"tokens={x.num_used_tokens}/{x.max_total_num_tokens} "
        f"(cached={x.num_evictable_tokens} free={x.num_free_tokens}) "
        f"cache_hit_rate={x.cache_hit_rate:.1%}"
        for x in resp.loads
    ]
    return Outcome(True, text, to_dict(resp), details)


def render_health(resp: pb.HealthCheckResponse) -> Outcome:
    text = f"{'healthy' if resp.healthy else 'unhealthy'}: {resp.message}"
    return Outcome(resp.healthy, text, to_dict(resp))


def render_generate(result: GenerateResult | list[GenerateResult]) -> Outcome:
    if isinstance(result, list):  # --n / --stop: a line per sample
        samples = [render_generate(r) for r in result]
        return Outcome(True, f"{len(samples)} sample(s)", {"samples": [o.data for o in samples]},
                       [f"[{i}] {o.text}" for i, o in enumerate(samples)])
    c = result.complete
    text = (
        f"tokens={','.join(map(str, result.tokens))} finish_reason={c.finish_reason} "
        f"prompt_tokens={c.prompt_tokens} cached_tokens={c.cached_tokens}"
    )
    if c.HasField("matched_stop_str"):
        text += f" matched_stop_str={c.matched_stop_str!r}"
    return Outcome(True, text, {"tokens": result.tokens, "complete": to_dict(c)})


def render_services(services: dict[str, list[str]]) -> Outcome:
    details = [f"{name}: {' '.join(methods) or '(no descriptor)'}" for name, methods in services.items()]
    return Outcome(True, f"{len(services)} service(s)", {"services": services}, details)


# ---------------------------------------------------------------------- calls


async def call_flush(client: AsyncClient, ns: argparse.Namespace) -> pb.FlushCacheResponse:
    return await client.flush_cache(ns.timeout_s)


async def call_start_profile(client: AsyncClient, ns: argparse.Namespace) -> pb.ProfileResponse:
    return await client.start_profile(
        output_dir=ns.output_dir,
        start_step=ns.start_step,
        num_steps=ns.num_steps,
        activities=ns.activities or (),
        with_stack=ns.with_stack,
        record_shapes=ns.record_shapes,
        profile_by_stage=ns.profile_by_stage,
        merge_profiles=ns.merge_profiles,
        profile_prefix=ns.profile_prefix,
        profile_stages=ns.profile_stages or (),
    )


async def call_stop_profile(client: AsyncClient, ns: argparse.Namespace) -> pb.ProfileResponse:
    return await client.stop_profile()


def dest_for(ns: argparse.Namespace, target: str) -> Path:
    """``--dest``, or a folder per target under it when there are several targets."""
    if len(targets_of(ns)) == 1:
        return Path(ns.dest)
    return Path(ns.dest) / re.sub(r"[^A-Za-z0-9._-]", "_", target)


async def call_download(client: AsyncClient, ns: argparse.Namespace) -> list[Path]:
    return await client.download_profile(dest_for(ns, client.target), profile_id=ns.profile_id)


async def call_server_info(client: AsyncClient, ns: argparse.Namespace) -> pb.GetServerInfoResponse:
    return await client.server_info()


async def call_loads(client: AsyncClient, ns: argparse.Namespace) -> pb.GetLoadsResponse:
    return await client.loads(include=ns.include or (), dp_rank=ns.dp_rank)


async def call_health(client: AsyncClient, ns: argparse.Namespace) -> pb.HealthCheckResponse:
    return await client.health()


async def call_metrics(client: AsyncClient, ns: argparse.Namespace) -> pb.GetMetricsResponse:
    return await client.metrics()


def render_metrics(resp: pb.GetMetricsResponse) -> Outcome:
    return Outcome(True, resp.text.rstrip("\n"), {"text": resp.text,
                                                   "content_type": resp.content_type})


async def call_generate(client: AsyncClient,
                        ns: argparse.Namespace) -> GenerateResult | list[GenerateResult]:
    if ns.n > 1 or ns.stop:
        return await client.generate_samples(
            ns.input_ids, ns.n, ns.max_new_tokens, ns.temperature, ns.stream,
            ignore_eos=ns.ignore_eos, stop=ns.stop or (), sampling_params=constraint_params(ns),
        )
    return await client.generate_tokens(
        ns.input_ids, ns.max_new_tokens, ns.temperature, ns.stream, ignore_eos=ns.ignore_eos,
        sampling_params=constraint_params(ns),
    )


def constraint_params(ns: argparse.Namespace) -> pb.SamplingParams | None:
    """--regex / --json-schema / --ebnf-grammar / --structural-tag as sampling params."""
    for field_name in ("regex", "json_schema", "ebnf_grammar", "structural_tag"):
        text = getattr(ns, field_name, None)
        if text is not None:
            return pb.SamplingParams(**{field_name: text})
    return None


async def call_embed(client: AsyncClient, ns: argparse.Namespace) -> pb.EmbedResponse:
    return await client.embed(ns.input_ids)


def render_embed(resp: pb.EmbedResponse) -> Outcome:
    values = ",".join(f"{v:.6g}" for v in resp.embedding)
    text = f"embedding_dim={resp.embedding_dim} prompt_tokens={resp.prompt_tokens} [{values}]"
    return Outcome(True, text, {"embedding_dim": resp.embedding_dim,
                                "prompt_tokens": resp.prompt_tokens,
                                "embedding": list(resp.embedding)})


async def call_services(client: AsyncClient, ns: argparse.Namespace) -> dict[str, list[str]]:
    return await client.services()


# ---------------------------------------------------------------------- parsers


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids, got {text!r}"
        ) from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return ids


def _sample_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a sample count >= 1, got {text!r}")
    return n


def common_options() -> argparse.ArgumentParser:
    """The options every client subcommand takes."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument("--target", action="append", metavar="HOST:PORT",
                   help=f"worker to call; repeat for several (default {DEFAULT_TARGET})")
    g.add_argument("--api-key", help="sent as 'authorization: Bearer KEY' (the admin key "
                   "for admin commands when the server has one)")
    g.add_argument("--tls-ca", metavar="PEM", help="CA to verify the server: use TLS")
    g.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    g.add_argument("--tls-key", metavar="PEM", help="client private key (mutual TLS)")
    g.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="deadline of each call (default: none)")
    g.add_argument("--json", action="store_true",
                   help="one JSON object per target per line")
    g.add_argument("--no-reflection-check", dest="check_rpc", action="store_false",
                   help="call without first asking reflection whether the target has the RPC")
    return p


def _flush_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout-s", type=float, default=0.0,
                   help="seconds to wait for the ranks to go idle (0: fail when busy)")


def _start_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", help="inside the server's profile root")
    p.add_argument("--start-step", type=int, help="forward step to start at (default: now)")
    p.add_argument("--num-steps", type=int, help="stop after this many steps")
    p.add_argument("--activities", nargs="+", metavar="ACTIVITY", help="CPU, GPU (CUDA), MEM")
    p.add_argument("--with-stack", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--record-shapes", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--profile-by-stage", action="store_true",
                   help="profile prefill and decode apart")
    p.add_argument("--profile-stages", nargs="+", metavar="STAGE")
    p.add_argument("--profile-prefix")
    p.add_argument("--merge-profiles", action=argparse.BooleanOptionalAction, default=None)


def _download_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile-id", default="", help="default: the last finished profile")
    p.add_argument("--dest", required=True, metavar="DIR",
                   help="folder for the files (a subfolder per target when several)")


def _loads_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--include", nargs="+", metavar="SECTION",
                   help="core, memory, spec, lora, disagg, queues, all")
    p.add_argument("--dp-rank", type=int)


def _embed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-ids", type=_token_ids, required=True, metavar="1,2,3")


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-ids", type=_token_ids, required=True, metavar="1,2,3")
    p.add_argument("--max-new-tokens", type=int,
                   help="default: up to the context (the server's, as SGLang's scheduler)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stream", action="store_true", help="use the streaming form of the call")
    p.add_argument("--n", type=_sample_count, default=1,
                   help="parallel samples (the worker prefills the prompt once)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="a stop string (repeatable); the worker matches it on decoded text")
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--regex", help="constrain the output to this regular expression")
    constraint.add_argument("--json-schema", help="constrain the output to this JSON schema")
    constraint.add_argument("--ebnf-grammar", help="constrain the output to this EBNF grammar")
    constraint.add_argument("--structural-tag", help="constrain with an xgrammar structural tag")


COMMANDS: list[Command] = [
    Command("flush-cache", "flush the radix cache on every rank",
            "SglangScheduler/FlushCache", call_flush, render_flush, _flush_arguments),
    Command("start-profile", "start the torch profiler on every rank",
            "SglangScheduler/StartProfile", call_start_profile, render_profile,
            _start_profile_arguments),
    Command("stop-profile", "stop the profiler; answers once traces are written",
            "SglangScheduler/StopProfile", call_stop_profile, render_profile),
    Command("download-profile", "download a finished profile's trace files (sha256-verified)",
            "SglangScheduler/DownloadProfile", call_download, render_files,
            _download_arguments),
    Command("server-info", "settings and live per-rank state",
            "SglangScheduler/GetServerInfo", call_server_info, render_server_info),
    Command("loads", "load metrics per rank and in aggregate",
            "SglangScheduler/GetLoads", call_loads, render_loads, _loads_arguments),
    Command("health", "round trip to every scheduler rank",
            "SglangScheduler/HealthCheck", call_health, render_health),
    Command("metrics", "the Prometheus exposition (--enable-metrics)",
            "SglangScheduler/GetMetrics", call_metrics, render_metrics),
    Command("generate", "generate tokens for a tokenized prompt",
            "SglangScheduler/Generate", call_generate, render_generate, _generate_arguments),
    Command("embed", "the vector (embedding model) or logits (classifier) of tokenized input",
            "SglangScheduler/Embed", call_embed, render_embed, _embed_arguments),
    Command("services", "list services and methods (server reflection)",
            None, call_services, render_services),
    *REFIT_COMMANDS,
    *SYNC_COMMANDS,
]


def add_client_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the client subcommands (:data:`COMMANDS`) to ``sglang-admin``'s subparsers."""
    common = common_options()
    for command in COMMANDS:
        _add_command(sub, command, common)
    lora = sub.add_parser("lora", help=LORA_HELP, description=LORA_HELP)
    lora_sub = lora.add_subparsers(dest="lora_command", required=True)
    for command in LORA_COMMANDS:
        _add_command(lora_sub, command, common)


def _add_command(
    sub: argparse._SubParsersAction, command: Command, common: argparse.ArgumentParser
) -> None:
    p = sub.add_parser(command.name, help=command.help, description=command.help,
                       parents=[common])
    command.arguments(p)
    p.set_defaults(func=partial(run_command, rpc=command.rpc, call=command.call,
                                render=command.render, summarize=command.summarize))
