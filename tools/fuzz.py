#!/usr/bin/env python3
"""A bounded fuzzer for one local worker: does any request take it down?

    python tools/fuzz.py --target 127.0.0.1:30000 --requests 2000 --seconds 120

It sends, ``--concurrency`` at a time, until ``--requests`` cases ran or ``--seconds``
passed (whichever comes first), a random mix (``--seed``) of these case kinds:

- ``generate-ordinary``: valid Generate requests with random sampling values, streaming
  or not, with n > 1, stop strings, stream_interval, max_new_tokens 0, prompt and
  token-id logprobs and hidden states now and then, that must end OK;
- ``generate-extreme``: finite, in-range-looking extreme sampling values (temperature
  1e-40, logit_bias +-3e38, repetition_penalty 1e-40, stop_token_ids covering the
  vocabulary with min_new_tokens, ...) that must end with some status, never a death;
- ``generate-invalid``: invalid fields (NaN, out-of-vocabulary ids, empty prompt, bad
  ranks, n too large, stream_interval below 1, empty stop strings, token_ids_logprob out
  of the vocabulary, logprob_start_len past the prompt) that must end INVALID_ARGUMENT;
- ``generate-constrained``: valid regex, json_schema, ebnf_grammar and structural_tag
  constraints with random sampling values, that must end OK;
- ``constraint-garbage``: constraints mutated into (mostly) text that does not compile,
  that must end OK or INVALID_ARGUMENT (the compiler's message), never a death;
- ``malformed``: random bytes sent to random methods, which must end INVALID_ARGUMENT;
- ``cancelled``: a stream cancelled by the client after its first message;
- ``dropped``: a call whose channel is closed under it;
- ``admin``: FlushCache, GetLoads, GetServerInfo, StartProfile and StopProfile;
- ``embed-ordinary``: valid Embed requests of random lengths, that must end OK;
- ``embed-invalid``: Embed with an empty input, an id outside the vocabulary, an input over
  the context, mm_inputs, is_cross_encoder or a request_id too long: INVALID_ARGUMENT.

On a generation model every Embed must end FAILED_PRECONDITION, and on an embedding model
(GetModelInfo.is_generation false) every Generate.

It stops early once 20 calls ended UNAVAILABLE (the worker is down or going down).
It prints a table of statuses per case kind (markdown, ready to paste) and then checks
for deaths: the server must still be SERVING and every scheduler rank must have the pid it
had at the start. Exit status 1 on a death or on any UNKNOWN or INTERNAL status (the
kinds that must end OK or INVALID_ARGUMENT are listed under "unexpected" but do not fail
the run by themselves), 2 on bad arguments. All traffic goes to the given address, which
must be a loopback address.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tools.soak import check_loopback

SERVICE = "/sglang.grpc.scheduler.SglangScheduler/"
KINDS = (
    "generate-ordinary", "generate-extreme", "generate-invalid", "malformed", "cancelled",
    "dropped", "admin", "generate-constrained", "constraint-garbage", "embed-ordinary",
    "embed-invalid",
)
# Random bytes that happen to decode as the method's request are counted apart.
DECODED = "malformed-decoded"
FAILING_STATUSES = ("UNKNOWN", "INTERNAL")
# What a kind must end with; anything else is listed as unexpected.
EXPECTED = {
    "generate-ordinary": {"OK"},
    "generate-invalid": {"INVALID_ARGUMENT"},
    "malformed": {"INVALID_ARGUMENT"},
    "generate-constrained": {"OK"},
    "constraint-garbage": {"OK", "INVALID_ARGUMENT"},
    "embed-ordinary": {"OK"},
    "embed-invalid": {"INVALID_ARGUMENT"},
}
EMBED_KINDS = ("embed-ordinary", "embed-invalid")
GENERATE_KINDS = ("generate-ordinary", "generate-extreme", "generate-invalid",
                  "generate-constrained", "constraint-garbage")
CONSTRAINTS = (  # (SamplingParams field, text) that compile
    ("regex", r"[a-z]{1,6}@[a-z]{2,4}\.(com|org)"),
    ("regex", r"(yes|no|maybe)!?"),
    ("regex", r"-?[0-9]{1,4}(\.[0-9]{1,2})?"),
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}, '
                    '"b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}'),
    ("json_schema", '{"type": "array", "items": {"type": "boolean"}, "maxItems": 4}'),
    ("json_schema", "$$ANY$$"),
    ("ebnf_grammar", 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [0-9]{1,3}'),
    ("structural_tag", '{"type": "structural_tag", "structures": [{"begin": "<f>", '
                       '"schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<f>"]}'),
)
GRAMMAR_NOISE = "[](){}*+?|\\\"^$:,.0123456789 \n\x00\u00e9\U0001f600"

MAX_REQUESTS = 1_000_000
STOP_AFTER_UNAVAILABLE = 20  # the worker is down or going down: stop and report
MAX_SECONDS = 3600.0
CALL_TIMEOUT_S = 60.0
NAN, INF = float("nan"), float("inf")
TINY = (1e-45, 1e-40, 1e-38, 1e-30, 1e-8)
HUGE = (1e8, 1e30, 3e38)
RAW_METHODS = (  # (method, request type, server-streaming)
    ("Generate", pb.GenerateRequest, True),
    ("GetLoads", pb.GetLoadsRequest, False),
    ("GetServerInfo", pb.GetServerInfoRequest, False),
    ("FlushCache", pb.FlushCacheRequest, False),
    ("Abort", pb.AbortRequest, False),
    ("StartProfile", pb.StartProfileRequest, False),
    ("DownloadProfile", pb.DownloadProfileRequest, True),
    ("GetModelInfo", pb.GetModelInfoRequest, False),
    ("Embed", pb.EmbedRequest, False),
)


def decodes(message_type: type, body: bytes) -> bool:
    """Whether `body` parses as `message_type` (then it is not malformed)."""
    try:
        message_type.FromString(body)
    except Exception:  # noqa: BLE001 - DecodeError and its relatives
        return False
    return True


@dataclass
class Tally:
    """Statuses per case kind, and the details of the ones that fail the run."""

    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    bad: list[str] = field(default_factory=list)
    # (kind, status) -> (how many, the first one's details)
    unexpected_seen: dict[tuple[str, str], list] = field(default_factory=dict)
    # what each kind must end with (see :func:`expectations`)
    expected: dict[str, set[str]] = field(default_factory=lambda: dict(EXPECTED))

    def add(self, kind: str, status: str, details: str = "") -> None:
        self.counts[kind][status] += 1
        if status in FAILING_STATUSES and len(self.bad) < 50:
            self.bad.append(f"{kind}: {status} {details[:200]}")
        elif kind in self.expected and status not in self.expected[kind]:
            seen = self.unexpected_seen.setdefault((kind, status), [0, details[:200]])
            seen[0] += 1

    @property
    def unexpected(self) -> list[str]:
        """One line per (kind, status) that the kind should not end with."""
        return [
            f"{kind}: {status}" + (f" x{n}" if n > 1 else "") + (f" (first: {first})" if first else "")
            for (kind, status), (n, first) in self.unexpected_seen.items()
        ]

    @property
    def unavailable(self) -> int:
        return sum(c.get("UNAVAILABLE", 0) for c in self.counts.values())

    def table(self) -> str:
        statuses = sorted({s for c in self.counts.values() for s in c})
        lines = [
            "| case kind | " + " | ".join(statuses) + " | total |",
            "|---|" + "---:|" * (len(statuses) + 1),
        ]
        for kind in (*KINDS, DECODED):
            c = self.counts.get(kind)
            if not c:
                continue
            lines.append(
                f"| {kind} | " + " | ".join(str(c.get(s, 0)) for s in statuses)
                + f" | {sum(c.values())} |"
            )
        return "\n".join(lines)


class Fuzzer:
    """Generates and runs the cases against one worker."""

    def __init__(self, target: str, seed: int, vocab: int, dp_size: int,
                 context_length: int = 512, is_generation: bool = True) -> None:
        self.target = target
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.dp_size = dp_size
        self.context_length = context_length
        self.tally = Tally(expected=expectations(is_generation))
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self.seq = 0

    # ------------------------------------------------------------------ requests

    def prompt(self) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 24))]

    def ordinary(self) -> pb.GenerateRequest:
        r = self.rng
        sp = pb.SamplingParams(
            temperature=r.choice([0.0, 0.3, 0.7, 1.0, 1.5]),
            top_p=r.choice([1.0, 0.9, 0.5]),
            top_k=r.choice([-1, 0, 1, 10, 50]),
            min_p=r.choice([0.0, 0.05]),
            frequency_penalty=r.uniform(-2, 2),
            presence_penalty=r.uniform(-2, 2),
            repetition_penalty=r.choice([1.0, 0.8, 1.3]),
            max_new_tokens=r.randint(1, 8),
            ignore_eos=r.random() < 0.5,
        )
        req = pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=self.prompt()), sampling_params=sp,
            stream=r.random() < 0.5, return_logprob=r.random() < 0.3,
        )
        self.generation_features(req)
        return req

    def generation_features(self, req: pb.GenerateRequest) -> None:
        """Issue 10's fields, valid values: n, stop strings, stream_interval, prefill
        only, prompt and token-id logprobs, hidden states."""
        r = self.rng
        sp = req.sampling_params
        if r.random() < 0.3:
            sp.n = r.randint(1, 4)
        if r.random() < 0.3:
            sp.stop.extend(r.choice(["a", "\n", " the", "\u00e9", "xyz" * 20])
                           for _ in range(r.randint(1, 3)))
            sp.no_stop_trim = r.random() < 0.5
        if r.random() < 0.2:
            sp.stream_interval = r.randint(1, 5)
        if r.random() < 0.1:
            sp.max_new_tokens = 0
        if req.return_logprob and r.random() < 0.5:
            req.logprob_start_len = r.randrange(-1, len(req.tokenized.input_ids))
            req.token_ids_logprob.extend(r.randrange(self.vocab) for _ in range(r.randint(0, 3)))
        req.return_hidden_states = r.random() < 0.1
        req.require_reasoning = r.random() < 0.2  # counts nothing without --reasoning-parser

    def extreme(self) -> pb.GenerateRequest:
        r = self.rng
        req = self.ordinary()
        sp = req.sampling_params
        choice = r.randrange(8)
        if choice == 0:
            sp.temperature = r.choice(TINY + HUGE)
            sp.top_k = r.choice([-1, 1, 5, 2**31 - 1])
        elif choice == 1:
            sp.logit_bias[str(r.randrange(self.vocab))] = r.choice([3e38, -3e38, 1e30])
        elif choice == 2:
            value = r.choice([-3e38, 3e38, -1e30])
            for tok in range(self.vocab):
                sp.logit_bias[str(tok)] = value
        elif choice == 3:
            sp.repetition_penalty = r.choice(TINY + (2.0,))
        elif choice == 4:
            sp.stop_token_ids.extend(range(self.vocab))
            sp.min_new_tokens = r.randint(1, 4)
            sp.temperature = r.choice([0.0, 1.0])
        elif choice == 5:
            sp.top_p = r.choice(TINY)
            sp.min_p = r.choice([1.0, 0.999999])
        elif choice == 6:
            sp.frequency_penalty = r.choice([-2.0, 2.0])
            sp.presence_penalty = r.choice([-2.0, 2.0])
            sp.temperature = r.choice(TINY)
        else:
            sp.temperature = r.choice(TINY)
            sp.logit_bias[str(r.randrange(self.vocab))] = r.choice([3e38, -3e38])
            sp.repetition_penalty = r.choice(TINY)
        return req

    def invalid(self) -> pb.GenerateRequest:
        r = self.rng
        req = self.ordinary()
        sp = req.sampling_params
        choice = r.randrange(14)
        if choice == 9:
            sp.n = r.choice([65, 1000, 2**32 - 1])
        elif choice == 10:
            sp.stream_interval = r.choice([0, -1, -(2**31)])
        elif choice == 11:
            req.return_logprob = True
            req.token_ids_logprob.append(self.vocab + r.randrange(1000))
        elif choice == 12:
            sp.stop.extend(["ok", ""])
        elif choice == 13:
            req.return_logprob = True
            req.logprob_start_len = r.choice([len(req.tokenized.input_ids), -2])
        elif choice == 0:
            sp.temperature = r.choice([NAN, INF, -1.0])
        elif choice == 1:
            req.tokenized.input_ids.append(self.vocab + r.randrange(1000))
        elif choice == 2:
            del req.tokenized.input_ids[:]
        elif choice == 3:
            sp.top_p = r.choice([NAN, -0.5, 1.5])
        elif choice == 4:
            sp.logit_bias[r.choice(["x", "-1", str(self.vocab), "1e3"])] = 1.0
        elif choice == 5:
            sp.logit_bias["1"] = r.choice([NAN, INF, -INF])
        elif choice == 6:
            req.data_parallel_rank = r.choice([-1, self.dp_size, 2**31 - 1])
        elif choice == 7:
            sp.repetition_penalty = r.choice([NAN, -1.0, 1e9])
        else:
            sp.stop_token_ids.append(self.vocab + 5)
        return req

    def constrained(self) -> pb.GenerateRequest:
        req = self.ordinary()
        kind, text = self.rng.choice(CONSTRAINTS)
        setattr(req.sampling_params, kind, text)
        return req

    def constraint_garbage(self) -> pb.GenerateRequest:
        r = self.rng
        req = self.constrained()
        sp = req.sampling_params
        kind = sp.WhichOneof("constraint")
        text = getattr(sp, kind)
        choice = r.randrange(4)
        if choice == 0:  # one character deleted
            i = r.randrange(len(text))
            text = text[:i] + text[i + 1 :]
        elif choice == 1:  # noise inserted
            i = r.randrange(len(text) + 1)
            noise = "".join(r.choice(GRAMMAR_NOISE) for _ in range(r.randint(1, 4)))
            text = text[:i] + noise + text[i:]
        elif choice == 2:  # truncated
            text = text[: r.randrange(1, len(text) + 1)]
        else:  # noise only
            text = "".join(r.choice(GRAMMAR_NOISE) for _ in range(r.randint(1, 24)))
        setattr(sp, r.choice(["regex", "json_schema", "ebnf_grammar", "structural_tag", kind]),
                text)
        return req

    def embed_ordinary(self) -> pb.EmbedRequest:
        r = self.rng
        ids = self.prompt() if r.random() < 0.8 else [
            r.randrange(self.vocab) for _ in range(r.randint(25, min(300, self.context_length)))]
        return pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=ids),
                               request_id=f"fuzz-embed-{r.getrandbits(48):x}"
                               if r.random() < 0.3 else "")

    def embed_invalid(self) -> pb.EmbedRequest:
        r = self.rng
        req = self.embed_ordinary()
        choice = r.randrange(6)
        ids = req.tokenized.input_ids
        if choice == 0:
            del ids[:]
        elif choice == 1:
            ids.insert(r.randrange(len(ids) + 1), self.vocab + r.randrange(2**31))
        elif choice == 2:
            ids.extend([1] * (self.context_length + 1 - len(ids)))
        elif choice == 3:
            req.mm_inputs.SetInParent()
        elif choice == 4:
            req.is_cross_encoder = True
        else:
            req.request_id = "x" * 513
        return req

    # ------------------------------------------------------------------ cases

    async def _embed(self, kind: str, req: pb.EmbedRequest) -> None:
        try:
            await self.stub.Embed(req, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.tally.add(kind, exc.code().name, exc.details() or "")
        else:
            self.tally.add(kind, "OK", f"input_ids={list(req.tokenized.input_ids)[-3:]}")

    async def _generate(self, kind: str, req: pb.GenerateRequest) -> None:
        try:
            async for _ in self.stub.Generate(req, timeout=CALL_TIMEOUT_S):
                pass
        except grpc.aio.AioRpcError as exc:
            self.tally.add(kind, exc.code().name, exc.details() or "")
        else:
            self.tally.add(kind, "OK", _describe(req))

    async def malformed(self) -> None:
        method, message_type, streaming = self.rng.choice(RAW_METHODS)
        body = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 64)))
        body = b"\x0a\xff\x01" + body if self.rng.random() < 0.5 else body
        kind = "malformed" if not decodes(message_type, body) else DECODED
        try:
            if streaming:
                async for _ in self.channel.unary_stream(SERVICE + method)(
                    body, timeout=CALL_TIMEOUT_S
                ):
                    pass
            else:
                await self.channel.unary_unary(SERVICE + method)(body, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.tally.add(kind, exc.code().name, f"{method}: {exc.details()}")
        else:
            self.tally.add(kind, "OK", method)

    async def cancelled(self) -> None:
        req = self.ordinary()
        req.stream = True
        req.sampling_params.max_new_tokens = 64
        req.sampling_params.ignore_eos = True
        call = self.stub.Generate(req, timeout=CALL_TIMEOUT_S)
        try:
            async for _ in call:
                call.cancel()
                break
        except grpc.aio.AioRpcError as exc:
            self.tally.add("cancelled", exc.code().name, exc.details() or "")
            return
        except asyncio.CancelledError:
            pass
        self.tally.add("cancelled", "CANCELLED" if call.cancelled() else "OK")

    async def dropped(self) -> None:
        channel = grpc.aio.insecure_channel(self.target)
        stub = pb_grpc.SglangSchedulerStub(channel)
        req = self.ordinary()
        req.sampling_params.max_new_tokens = 32
        call = stub.Generate(req, timeout=CALL_TIMEOUT_S)
        await asyncio.sleep(self.rng.uniform(0, 0.05))
        await channel.close(grace=None)
        try:
            async for _ in call:
                pass
            status = "OK"
        except grpc.aio.AioRpcError as exc:
            status = exc.code().name
        except asyncio.CancelledError:
            status = "CANCELLED"
        self.tally.add("dropped", status)

    async def admin(self) -> None:
        ops: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("FlushCache", lambda: self.stub.FlushCache(
                pb.FlushCacheRequest(timeout_s=self.rng.choice([0.0, 0.5, 2.0])),
                timeout=CALL_TIMEOUT_S)),
            ("GetLoads", lambda: self.stub.GetLoads(
                pb.GetLoadsRequest(include=["all"]), timeout=CALL_TIMEOUT_S)),
            ("GetServerInfo", lambda: self.stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)),
            ("StartProfile", lambda: self.stub.StartProfile(
                pb.StartProfileRequest(num_steps=self.rng.randint(1, 3), output_dir="fuzz"),
                timeout=CALL_TIMEOUT_S)),
            ("StopProfile", lambda: self.stub.StopProfile(
                pb.StopProfileRequest(), timeout=CALL_TIMEOUT_S)),
        ]
        name, make = self.rng.choice(ops)
        try:
            await make()
        except grpc.aio.AioRpcError as exc:
            self.tally.add("admin", exc.code().name, f"{name}: {exc.details()}")
        else:
            self.tally.add("admin", "OK")

    async def one(self, kind: str) -> None:
        if kind == "generate-ordinary":
            await self._generate(kind, self.ordinary())
        elif kind == "generate-extreme":
            await self._generate(kind, self.extreme())
        elif kind == "generate-invalid":
            await self._generate(kind, self.invalid())
        elif kind == "generate-constrained":
            await self._generate(kind, self.constrained())
        elif kind == "constraint-garbage":
            await self._generate(kind, self.constraint_garbage())
        elif kind == "malformed":
            await self.malformed()
        elif kind == "cancelled":
            await self.cancelled()
        elif kind == "dropped":
            await self.dropped()
        elif kind == "embed-ordinary":
            await self._embed(kind, self.embed_ordinary())
        elif kind == "embed-invalid":
            await self._embed(kind, self.embed_invalid())
        else:
            await self.admin()

    async def run(self, kinds: list[str], requests: int, seconds: float, concurrency: int) -> int:
        """Run cases until `requests` ran or `seconds` passed; returns how many ran."""
        deadline = time.monotonic() + seconds
        started = 0

        async def worker() -> None:
            nonlocal started
            while (started < requests and time.monotonic() < deadline
                   and self.tally.unavailable < STOP_AFTER_UNAVAILABLE):
                started += 1
                kind = self.rng.choice(kinds)
                try:
                    await self.one(kind)
                except Exception as exc:  # noqa: BLE001 - a fuzzer bug must not hide the table
                    self.tally.add(kind, f"client-{type(exc).__name__}", str(exc))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return started


def expectations(is_generation: bool) -> dict[str, set[str]]:
    """What each kind must end with on this model: the kinds of the other model type are
    refused with FAILED_PRECONDITION (Embed on a generation model, Generate on an
    embedding model)."""
    refused = EMBED_KINDS if is_generation else GENERATE_KINDS
    return {**EXPECTED, **{kind: {"FAILED_PRECONDITION"} for kind in refused}}


def _describe(req: pb.GenerateRequest) -> str:
    """A short text of a request's sampling values (for the unexpected-status lines)."""
    sp = req.sampling_params
    text = str(sp).replace("\n", " ")
    if len(sp.logit_bias) > 4:
        text = f"logit_bias on {len(sp.logit_bias)} tokens, " + text.split("logit_bias")[0]
    return f"input_ids={list(req.tokenized.input_ids)[-3:]} {text}"[:200]


# ---------------------------------------------------------------------- checks


async def server_facts(target: str) -> tuple[bool, list[int], str]:
    """(SERVING, rank pids, why not) of the worker."""
    async with grpc.aio.insecure_channel(target) as ch:
        try:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            info = await pb_grpc.SglangSchedulerStub(ch).GetServerInfo(
                pb.GetServerInfoRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            return False, [], f"{exc.code().name}: {exc.details()}"
    serving = health.status == health_pb2.HealthCheckResponse.SERVING
    return serving, [s.pid for s in info.rank_states], "" if serving else "not SERVING"


async def fuzz(args: argparse.Namespace) -> int:
    serving, pids, why = await server_facts(args.target)
    if not serving:
        print(f"error: {args.target} is not serving before the run: {why}", file=sys.stderr)
        return 1
    async with grpc.aio.insecure_channel(args.target) as ch:
        info = await pb_grpc.SglangSchedulerStub(ch).GetModelInfo(
            pb.GetModelInfoRequest(), timeout=10
        )
    fuzzer = Fuzzer(args.target, args.seed, info.vocab_size, len(pids),
                    info.max_context_length, info.is_generation)
    t0 = time.monotonic()
    try:
        ran = await fuzzer.run(args.kinds, args.requests, args.seconds, args.concurrency)
    finally:
        await fuzzer.channel.close()
    elapsed = time.monotonic() - t0
    serving_after, pids_after, why_after = await server_facts(args.target)
    deaths: list[str] = []
    if not serving_after:
        deaths.append(f"server no longer serving: {why_after}")
    if serving_after and pids_after != pids:
        deaths.append(f"rank pids changed: {pids} -> {pids_after}")
    tally = fuzzer.tally
    print(f"fuzz: {ran} cases in {elapsed:.1f} s against {args.target} "
          f"(seed {args.seed}, concurrency {args.concurrency})\n")
    print(tally.table())
    print()
    print(f"server SERVING after the run: {'yes' if serving_after else 'NO'}; "
          f"rank pids unchanged: {'yes' if serving_after and pids_after == pids else 'NO'} "
          f"({pids} -> {pids_after})")
    for line in tally.unexpected:
        print(f"unexpected: {line}")
    for line in tally.bad:
        print(f"FAIL status: {line}")
    for line in deaths:
        print(f"DEATH: {line}")
    return 1 if deaths or tally.bad else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HOST:PORT of the worker (loopback only)")
    p.add_argument("--requests", type=int, default=1000, help="cases to run at most")
    p.add_argument("--seconds", type=float, default=60.0, help="time to run at most")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated case kinds (default: all of {', '.join(KINDS)})")
    ns = p.parse_args(argv)
    if not 1 <= ns.requests <= MAX_REQUESTS:
        p.error(f"--requests must be in 1..{MAX_REQUESTS}")
    if not (math.isfinite(ns.seconds) and 0 < ns.seconds <= MAX_SECONDS):
        p.error(f"--seconds must be in (0, {MAX_SECONDS:g}]")
    if not 1 <= ns.concurrency <= 256:
        p.error("--concurrency must be in 1..256")
    kinds = [k.strip() for k in ns.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        p.error(f"unknown case kind(s) {', '.join(unknown) or '(none given)'}; "
                f"valid: {', '.join(KINDS)}")
    ns.kinds = kinds
    try:
        check_loopback(ns.target)
    except ValueError as exc:
        p.error(str(exc).replace("soak is local only", "fuzz is local only"))
    return ns


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(fuzz(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
