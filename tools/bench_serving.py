#!/usr/bin/env python
"""Benchmark online serving of one or more SglangScheduler workers over gRPC.

The gRPC counterpart of SGLang's ``bench_serving``: it builds prompts as token ids (no
tokenizer needed), sends them as streaming ``Generate`` calls with ``ignore_eos`` (so every
output has exactly the requested length), spread round robin over the ``--target`` workers,
either all at once, at a Poisson ``--request-rate``, or with at most ``--max-concurrency`` in
flight, and prints a table of throughput and latency (TTFT, time per output token,
inter-token latency, end-to-end latency).

Example::

    python tools/bench_serving.py --target 127.0.0.1:30000 --num-prompts 200 \\
        --random-input-len 512 --random-output-len 128 --request-rate 16 --flush-cache

Order of a run: model facts (GetModelInfo on every target) -> dataset -> warmup requests ->
FlushCache on every target (``--flush-cache``) -> StartProfile (``--profile``) -> the
benchmark -> StopProfile -> table -> JSON line (``--output-file``).

Exit status: 0 when every request completed; 1 when some failed, StopProfile failed, or a
setup step (model info, warmup, flush, profile start) failed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc
import grpc.aio

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc

Metadata = tuple[tuple[str, str], ...]
CHANNEL_OPTIONS: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 64 << 20)]
ADMIN_TIMEOUT_S = 600.0
INFO_TIMEOUT_S = 30.0
LINE = 50


# ---------------------------------------------------------------------- data types


@dataclass(frozen=True)
class ModelFacts:
    """What the dataset needs to know about the served model (over every target)."""

    vocab_size: int
    context_length: int
    special_ids: frozenset[int]


@dataclass(frozen=True)
class BenchRequest:
    """One prompt (token ids) and the exact number of tokens to generate for it."""

    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    """The measured outcome of one streaming Generate call (times in seconds)."""

    target: str
    prompt_len: int
    expected_output_len: int
    success: bool = False
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ---------------------------------------------------------------------- datasets


def sample_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """``n`` lengths drawn uniformly from [max(length * range_ratio, 1), length]."""
    low = max(int(length * range_ratio), 1)
    return [rng.randint(low, length) for _ in range(n)]


def token_pool(facts: ModelFacts) -> list[int]:
    """Token ids a random prompt may use: the vocabulary minus the special tokens."""
    pool = [t for t in range(facts.vocab_size) if t not in facts.special_ids]
    if not pool:
        raise ValueError(f"no usable token ids in a vocabulary of {facts.vocab_size}")
    return pool


def random_tokens(rng: random.Random, pool: Sequence[int], n: int) -> list[int]:
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


def random_dataset(args: argparse.Namespace, facts: ModelFacts) -> list[BenchRequest]:
    """Prompts of random token ids with random input and output lengths."""
    rng = random.Random(args.seed)
    pool = token_pool(facts)
    n = args.num_prompts
    input_lens = sample_lengths(rng, n, args.random_input_len, args.random_range_ratio)
    output_lens = sample_lengths(rng, n, args.random_output_len, args.random_range_ratio)
    return [
        BenchRequest(random_tokens(rng, pool, i), o) for i, o in zip(input_lens, output_lens)
    ]


def shared_prefix_dataset(args: argparse.Namespace, facts: ModelFacts) -> list[BenchRequest]:
    """Prompts made of one of ``--shared-prefix-groups`` common prefixes (``--shared-prefix-len``
    tokens each; prompt i uses prefix i mod groups) followed by a random suffix of
    ``--random-input-len`` tokens (range ratio applies) - what a prefix cache should reuse."""
    rng = random.Random(args.seed)
    pool = token_pool(facts)
    n = args.num_prompts
    prefixes = [
        random_tokens(rng, pool, args.shared_prefix_len) for _ in range(args.shared_prefix_groups)
    ]
    suffix_lens = sample_lengths(rng, n, args.random_input_len, args.random_range_ratio)
    output_lens = sample_lengths(rng, n, args.random_output_len, args.random_range_ratio)
    return [
        BenchRequest(prefixes[i % len(prefixes)] + random_tokens(rng, pool, s), o)
        for i, (s, o) in enumerate(zip(suffix_lens, output_lens))
    ]


def build_dataset(args: argparse.Namespace, facts: ModelFacts) -> list[BenchRequest]:
    """The benchmark's requests; ValueError when one would not fit the context length."""
    if args.dataset == "random":
        requests = random_dataset(args, facts)
    else:
        requests = shared_prefix_dataset(args, facts)
    for req in requests:
        if len(req.prompt) + req.output_len > facts.context_length:
            raise ValueError(
                f"a prompt of {len(req.prompt)} tokens plus {req.output_len} output tokens "
                f"exceeds the context length {facts.context_length}"
            )
    return requests


# ---------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(name: str, seconds: Sequence[float]) -> dict[str, float]:
    """mean_, median_ (p50) and p99_ of ``name`` in milliseconds."""
    ms = [s * 1000.0 for s in seconds]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": percentile(ms, 50),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def compute_metrics(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Counts, throughputs and latency summaries of a run that took ``duration`` seconds."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) * per_s,
        "input_throughput": total_input * per_s,
        "output_throughput": total_output * per_s,
        "total_throughput": (total_input + total_output) * per_s,
        "concurrency": sum(r.latency for r in ok) * per_s,
        "cache_hit_rate": cached / total_input if total_input else 0.0,
    }
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    metrics.update(summarize("ttft", [r.ttft for r in ok]))
    metrics.update(summarize("tpot", tpots))
    metrics.update(summarize("itl", [x for r in ok for x in r.itl]))
    metrics.update(summarize("e2e_latency", [r.latency for r in ok]))
    return metrics


# ---------------------------------------------------------------------- output


class Progress:
    """A one-line progress bar on stderr, redrawn with a carriage return."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO = sys.stderr) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream
        self.done = 0
        self.failed = 0
        self.start = time.perf_counter()

    def update(self, success: bool) -> None:
        self.done += 1
        self.failed += 0 if success else 1
        self.draw()

    def draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (width - filled)
        elapsed = time.perf_counter() - self.start
        failed = f", {self.failed} failed" if self.failed else ""
        self.stream.write(f"\r[{bar}] {self.done}/{self.total}{failed} {elapsed:6.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def format_table(args: argparse.Namespace, metrics: dict[str, Any]) -> str:
    """The result table, in the layout of SGLang's bench_serving."""

    def row(label: str, value: Any) -> str:
        if isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label:<40} {value}"

    def section(title: str) -> str:
        return f"{title:-^{LINE}}"

    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    lines = [
        f"{' Serving Benchmark Result ':=^{LINE}}",
        row("Backend:", "grpc"),
        row("Targets:", ", ".join(args.target)),
        row("Dataset:", args.dataset),
        row("Traffic request rate:", rate),
        row("Max request concurrency:", args.max_concurrency or "not set"),
        row("Successful requests:", metrics["completed"]),
        row("Failed requests:", metrics["failed"]),
        row("Benchmark duration (s):", metrics["duration_s"]),
        row("Total input tokens:", metrics["total_input_tokens"]),
        row("Total generated tokens:", metrics["total_output_tokens"]),
        row("Request throughput (req/s):", metrics["request_throughput"]),
        row("Input token throughput (tok/s):", metrics["input_throughput"]),
        row("Output token throughput (tok/s):", metrics["output_throughput"]),
        row("Total token throughput (tok/s):", metrics["total_throughput"]),
        row("Concurrency:", metrics["concurrency"]),
        row("Prefix cache hit rate:", metrics["cache_hit_rate"]),
    ]
    for title, key, label in (
        ("End-to-End Latency", "e2e_latency", "E2E Latency"),
        ("Time to First Token", "ttft", "TTFT"),
        ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
        ("Inter-Token Latency", "itl", "ITL"),
    ):
        lines.append(section(title))
        lines.append(row(f"Mean {label} (ms):", metrics[f"mean_{key}_ms"]))
        lines.append(row(f"Median (p50) {label} (ms):", metrics[f"median_{key}_ms"]))
        lines.append(row(f"P99 {label} (ms):", metrics[f"p99_{key}_ms"]))
    lines.append("=" * LINE)
    return "\n".join(lines)


def json_record(
    args: argparse.Namespace,
    metrics: dict[str, Any],
    profile_ids: dict[str, str],
    profile_files: dict[str, list[str]],
    errors: list[str],
) -> dict[str, Any]:
    """The JSON line of one run: its settings, its metrics, the profile ids and trace files
    per target (empty without --profile) and up to ten distinct request errors."""
    return {
        "backend": "grpc",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "targets": list(args.target),
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "shared_prefix_len": args.shared_prefix_len if args.dataset == "shared-prefix" else 0,
        "seed": args.seed,
        # JSON has no infinity: null means all requests at once.
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        **metrics,
        "profile_ids": profile_ids,
        "profile_files": profile_files,
        "errors": errors,
    }


# ---------------------------------------------------------------------- gRPC calls


def auth_metadata(api_key: str | None) -> Metadata:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def rpc_error_text(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


async def model_facts(
    stubs: dict[str, pb_grpc.SglangSchedulerStub], metadata: Metadata
) -> ModelFacts:
    """Vocabulary and context length that fit every target; the union of special ids."""
    infos = await asyncio.gather(
        *(
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=INFO_TIMEOUT_S)
            for stub in stubs.values()
        )
    )
    special: set[int] = set()
    for info in infos:
        special.update(info.eos_token_ids)
        special.update(t for t in (info.bos_token_id, info.pad_token_id) if t > 0)
    return ModelFacts(
        vocab_size=min(info.vocab_size for info in infos),
        context_length=min(info.max_context_length for info in infos),
        special_ids=frozenset(special),
    )


async def run_one(
    stub: pb_grpc.SglangSchedulerStub,
    target: str,
    req: BenchRequest,
    metadata: Metadata,
    temperature: float,
    timeout: float | None,
    json_schema: str = "",
) -> RequestResult:
    """Send one streaming Generate and time its tokens.

    A token "arrives" when a message raises the cumulative ``completion_tokens``: the first
    arrival gives the TTFT, later ones the inter-token latencies. The final message must be a
    GenerateComplete whose finish_reason is not "abort". ``json_schema``: constrain the
    output to it (a schema that cannot end before max_new_tokens keeps the lengths exact)."""
    result = RequestResult(target, len(req.prompt), req.output_len)
    request = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=req.prompt),
        sampling_params=pb.SamplingParams(
            temperature=temperature, max_new_tokens=req.output_len, ignore_eos=True
        ),
        stream=True,
    )
    if json_schema:
        request.sampling_params.json_schema = json_schema
    start = time.perf_counter()
    last = start
    received = 0
    complete: pb.GenerateComplete | None = None
    try:
        async for resp in stub.Generate(request, metadata=metadata, timeout=timeout):
            now = time.perf_counter()
            if resp.HasField("chunk"):
                chunk = resp.chunk
                count = chunk.completion_tokens or received + len(chunk.token_ids)
                result.cached_tokens = max(result.cached_tokens, chunk.cached_tokens)
            elif resp.HasField("complete"):
                complete = resp.complete
                count = complete.completion_tokens or max(received, len(complete.output_ids))
                result.cached_tokens = max(result.cached_tokens, complete.cached_tokens)
            else:
                continue
            if count > received:
                if received == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                received = count
    except Exception as exc:  # noqa: BLE001 - every failure is a failed request
        result.error = rpc_error_text(exc)
        return result
    result.latency = time.perf_counter() - start
    result.output_len = received
    if complete is None:
        result.error = "stream ended without a GenerateComplete"
    elif complete.finish_reason == "abort":
        result.error = "request aborted by the server"
    else:
        result.success = True
    return result


async def flush_all(
    stubs: dict[str, pb_grpc.SglangSchedulerStub], metadata: Metadata, timeout_s: float
) -> list[str]:
    """FlushCache on every target; the error messages (empty when all flushed)."""

    async def flush(target: str, stub: pb_grpc.SglangSchedulerStub) -> str:
        try:
            resp = await stub.FlushCache(
                pb.FlushCacheRequest(timeout_s=timeout_s),
                metadata=metadata, timeout=timeout_s + ADMIN_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            return f"{target}: FlushCache failed: {rpc_error_text(exc)}"
        return "" if resp.success else f"{target}: FlushCache failed: {resp.message}"

    errors = await asyncio.gather(*(flush(t, s) for t, s in stubs.items()))
    return [e for e in errors if e]


def profile_request(args: argparse.Namespace) -> pb.StartProfileRequest:
    req = pb.StartProfileRequest(activities=args.profile_activities or [])
    if args.profile_output_dir:
        req.output_dir = args.profile_output_dir
    if args.profile_num_steps:
        req.num_steps = args.profile_num_steps
    return req


def profile_files_of(resp: pb.ProfileResponse) -> list[str]:
    """Every trace file a ProfileResponse names, top level and per rank, in order."""
    files = list(resp.files)
    for rank in resp.rank_results:
        files.extend(f for f in rank.files if f not in files)
    return files


async def start_profiles(
    args: argparse.Namespace, stubs: dict[str, pb_grpc.SglangSchedulerStub], metadata: Metadata
) -> tuple[dict[str, pb.ProfileResponse], list[str]]:
    """StartProfile on every target: the answers of those that started, and the failure
    messages (on any failure the targets that did start are stopped again)."""

    async def start(target: str, stub: pb_grpc.SglangSchedulerStub) -> pb.ProfileResponse | str:
        try:
            resp = await stub.StartProfile(
                profile_request(args), metadata=metadata, timeout=ADMIN_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            return f"{target}: StartProfile failed: {rpc_error_text(exc)}"
        return resp if resp.success else f"{target}: StartProfile failed: {resp.message}"

    targets = list(stubs)
    outcomes = await asyncio.gather(*(start(t, stubs[t]) for t in targets))
    started = {t: o for t, o in zip(targets, outcomes) if not isinstance(o, str)}
    errors = [o for o in outcomes if isinstance(o, str)]
    if errors:
        await stop_profiles({t: stubs[t] for t in started}, metadata)
        started = {}
    return started, errors


@dataclass
class ProfileOutcome:
    """What StopProfile said on one target."""

    success: bool
    message: str
    profile_id: str = ""
    files: list[str] = field(default_factory=list)


async def stop_profiles(
    stubs: dict[str, pb_grpc.SglangSchedulerStub], metadata: Metadata
) -> dict[str, ProfileOutcome]:
    """StopProfile on every target."""

    async def stop(stub: pb_grpc.SglangSchedulerStub) -> ProfileOutcome:
        try:
            resp = await stub.StopProfile(
                pb.StopProfileRequest(), metadata=metadata, timeout=ADMIN_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            return ProfileOutcome(False, rpc_error_text(exc))
        return ProfileOutcome(resp.success, resp.message, resp.profile_id, profile_files_of(resp))

    targets = list(stubs)
    outcomes = await asyncio.gather(*(stop(stubs[t]) for t in targets))
    return dict(zip(targets, outcomes))


def print_profile_report(
    args: argparse.Namespace,
    started: dict[str, pb.ProfileResponse],
    stopped: dict[str, ProfileOutcome],
) -> None:
    """Where the traces are: each target's files, or what the server said about them.

    With ``--profile-num-steps`` the profiler may have stopped by itself before the end of
    the run; StopProfile then finds nothing to stop, and the StartProfile answer (which names
    the output directory and the profile id) says where the traces went."""
    print("Profile traces:")
    for target, outcome in stopped.items():
        if outcome.files:
            for name in outcome.files:
                print(f"  {target}: {name}")
        elif outcome.success:
            print(f"  {target}: no files listed by the server ({outcome.message})")
        elif args.profile_num_steps:
            start = started[target]
            print(
                f"  {target}: stopped by itself after {args.profile_num_steps} step(s); "
                f"{start.message}"
            )
        else:
            print(f"  {target}: StopProfile failed: {outcome.message}")


# ---------------------------------------------------------------------- the run


async def arrivals(
    requests: Sequence[BenchRequest], rate: float, rng: random.Random
) -> AsyncIterator[tuple[int, BenchRequest]]:
    """Yield the requests with Poisson arrivals at ``rate`` per second (inf: all at once)."""
    for i, req in enumerate(requests):
        yield i, req
        if not math.isinf(rate) and i + 1 < len(requests):
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(
    args: argparse.Namespace,
    stubs: dict[str, pb_grpc.SglangSchedulerStub],
    requests: Sequence[BenchRequest],
    metadata: Metadata,
) -> tuple[list[RequestResult], float]:
    """Send every request (round robin over the targets); the results and the duration."""
    targets = list(stubs)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = Progress(len(requests), enabled=not args.no_progress)

    async def one(i: int, req: BenchRequest) -> RequestResult:
        target = targets[i % len(targets)]
        if sem is None:
            result = await run_one(
                stubs[target], target, req, metadata, args.temperature, args.request_timeout,
                args.json_schema,
            )
        else:
            async with sem:
                result = await run_one(
                    stubs[target], target, req, metadata, args.temperature, args.request_timeout,
                    args.json_schema,
                )
        progress.update(result.success)
        return result

    rng = random.Random(args.seed + 1)
    start = time.perf_counter()
    progress.start = start
    progress.draw()
    tasks: list[asyncio.Task[RequestResult]] = []
    async for i, req in arrivals(requests, args.request_rate, rng):
        tasks.append(asyncio.create_task(one(i, req)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    progress.close()
    return results, duration


async def warmup(
    args: argparse.Namespace,
    stubs: dict[str, pb_grpc.SglangSchedulerStub],
    requests: Sequence[BenchRequest],
    metadata: Metadata,
) -> list[str]:
    """``--warmup-requests`` short requests to every target; the failures."""
    errors: list[str] = []
    first = requests[0]
    probe = BenchRequest(first.prompt, min(first.output_len, 16))
    for _ in range(args.warmup_requests):
        results = await asyncio.gather(
            *(
                run_one(stub, t, probe, metadata, args.temperature, args.request_timeout,
                        args.json_schema)
                for t, stub in stubs.items()
            )
        )
        errors.extend(f"{r.target}: warmup failed: {r.error}" for r in results if not r.success)
        if errors:
            break
    return errors


def report_errors(errors: Sequence[str]) -> None:
    for error in errors:
        print(f"error: {error}", file=sys.stderr)


async def bench(args: argparse.Namespace) -> int:
    """The whole run against live targets; the exit status."""
    metadata = auth_metadata(args.api_key)
    admin_metadata = auth_metadata(args.admin_api_key or args.api_key)
    channels = {t: grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS) for t in args.target}
    stubs = {t: pb_grpc.SglangSchedulerStub(ch) for t, ch in channels.items()}
    try:
        try:
            facts = await model_facts(stubs, metadata)
        except grpc.aio.AioRpcError as exc:
            report_errors([f"GetModelInfo failed: {rpc_error_text(exc)}"])
            return 1
        try:
            requests = build_dataset(args, facts)
        except ValueError as exc:
            report_errors([str(exc)])
            return 2
        print(
            f"#prompts: {len(requests)}, #input tokens: {sum(len(r.prompt) for r in requests)}, "
            f"#output tokens: {sum(r.output_len for r in requests)}, "
            f"vocab: {facts.vocab_size}, targets: {len(stubs)}",
            file=sys.stderr,
        )
        errors = await warmup(args, stubs, requests, metadata)
        if errors:
            report_errors(errors)
            return 1
        if args.flush_cache:
            errors = await flush_all(stubs, admin_metadata, args.flush_timeout)
            if errors:
                report_errors(errors)
                return 1
        started: dict[str, pb.ProfileResponse] = {}
        if args.profile:
            started, errors = await start_profiles(args, stubs, admin_metadata)
            if errors:
                report_errors(errors)
                return 1
        results, duration = await run_benchmark(args, stubs, requests, metadata)
        stopped: dict[str, ProfileOutcome] = {}
        if args.profile:
            stopped = await stop_profiles(stubs, admin_metadata)
        metrics = compute_metrics(results, duration)
        print(format_table(args, metrics))
        if args.profile:
            print_profile_report(args, started, stopped)
        profile_ids = {t: o.profile_id or started[t].profile_id for t, o in stopped.items()}
        profile_files = {t: o.files for t, o in stopped.items()}
        # A profiler that stopped by itself after --profile-num-steps is not a failure.
        profile_failed = any(
            not o.success and not args.profile_num_steps for o in stopped.values()
        )
        failures = sorted({f"{r.target}: {r.error}" for r in results if not r.success})
        for error in failures[:10]:
            print(f"failed request: {error}", file=sys.stderr)
        if args.output_file:
            record = json_record(args, metrics, profile_ids, profile_files, failures[:10])
            await asyncio.to_thread(_append_line, args.output_file, json.dumps(record))
        return 0 if metrics["failed"] == 0 and not profile_failed else 1
    finally:
        for ch in channels.values():
            await ch.close()


# ---------------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_serving.py",
        description="Benchmark SglangScheduler workers over gRPC (streaming Generate).",
    )
    p.add_argument("--target", action="append", metavar="HOST:PORT",
                   help="a worker; repeat for several (requests go round robin). "
                        "Default 127.0.0.1:30000")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=_positive_int, default=1000)
    p.add_argument("--random-input-len", type=_positive_int, default=1024,
                   help="input tokens per prompt (shared-prefix: the suffix after the prefix)")
    p.add_argument("--random-output-len", type=_positive_int, default=1024,
                   help="output tokens per request")
    p.add_argument("--random-range-ratio", type=_ratio, default=0.0,
                   help="lengths are drawn uniformly from [len * ratio, len]; 1 = exact")
    p.add_argument("--shared-prefix-len", type=_non_negative_int, default=512,
                   help="shared-prefix dataset: tokens of the common prefix")
    p.add_argument("--shared-prefix-groups", type=_positive_int, default=1,
                   help="shared-prefix dataset: number of distinct prefixes")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="at most this many requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json-schema", default="", metavar="SCHEMA",
                   help="constrain every output to this JSON schema (text, or @FILE)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="deadline of each Generate call in seconds (default none)")
    p.add_argument("--warmup-requests", type=_non_negative_int, default=1,
                   help="short requests sent to every target before the run (not measured)")
    p.add_argument("--flush-cache", action="store_true",
                   help="FlushCache on every target before the run")
    p.add_argument("--flush-timeout", type=float, default=30.0,
                   help="FlushCache timeout_s: seconds each target may take to go idle")
    p.add_argument("--profile", action="store_true",
                   help="StartProfile on every target before the run, StopProfile after")
    p.add_argument("--profile-output-dir", default=None,
                   help="StartProfile output_dir (inside the server's profile root)")
    p.add_argument("--profile-num-steps", type=_positive_int, default=None,
                   help="StartProfile num_steps: the profiler stops itself after that many")
    p.add_argument("--profile-activities", nargs="+", choices=["CPU", "GPU", "CUDA", "MEM"],
                   default=None, help="profiler activities (default the server's: CPU and GPU)")
    p.add_argument("--output-file", default=None, help="append the results as one JSON line")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY'")
    p.add_argument("--admin-api-key", default=None,
                   help="key for FlushCache/StartProfile/StopProfile (default --api-key)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _append_line(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; the exit status (0: every request completed)."""
    args = build_parser().parse_args(argv)
    # Each target once, in the order given (requests go round robin over them).
    args.target = list(dict.fromkeys(args.target or ["127.0.0.1:30000"]))
    if args.json_schema.startswith("@"):
        with open(args.json_schema[1:], encoding="utf-8") as f:
            args.json_schema = f.read()
    try:
        return asyncio.run(bench(args))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
