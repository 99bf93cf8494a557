#!/usr/bin/env python
"""Output tok/s with a json_schema constraint against the same workload unconstrained.

    PYTHONPATH=$PWD python tools/bench_grammar.py --rounds 3

The worker (``sglang-admin serve``, embedded default model, dp 1) runs in its own process;
this process is the client (tools/bench_serving.py's streaming client, the same prompts
on both sides). The mixed workload: ``--num-prompts`` prompts of 16 to 256 random tokens,
``--output-len`` output tokens each, all sent at once. The constrained side sends every
request with SCHEMA (an array of at least 64 {id, name} objects: the grammar cannot end
before max_new_tokens, so both sides generate exactly the same token counts, and every
step masks every row). The sides alternate ``--rounds`` times after a warmup (which also
compiles the schema once: later requests hit the cache); the best round of each counts.
Target: constrained >= 0.8x unconstrained.

``--mask-cost-vocab N`` also times, in this process, the per-step mask work for 64 rows of
SCHEMA over a synthetic N-token vocabulary (random strings; a real model's vocabulary is
~150k tokens, the default model's 261): the matchers' bitmask fill and its application to
the logits, with xgrammar's CPU kernel and with the torch masked fill, at three points of
the grammar (start, inside a number, inside a string), best of 7 each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
        "required": ["id", "name"],
    },
    "minItems": 64,
}
TARGET_RATIO = 0.8


def bench_args(target: str, ns: argparse.Namespace, json_schema: str) -> argparse.Namespace:
    from tools import bench_serving

    return bench_serving.build_parser().parse_args([
        "--target", target, "--num-prompts", str(ns.num_prompts),
        "--random-input-len", "256", "--random-range-ratio", "0.0625",
        "--random-output-len", str(ns.output_len), "--seed", str(ns.seed),
        "--warmup-requests", "1", "--no-progress", "--json-schema", json_schema,
    ])


async def one_side(target: str, ns: argparse.Namespace, json_schema: str) -> dict[str, Any]:
    """One benchmark run of one side; its metrics."""
    import grpc

    from tools import bench_serving as bs

    args = bench_args(target, ns, json_schema)
    args.target = [target]
    async with grpc.aio.insecure_channel(target, options=bs.CHANNEL_OPTIONS) as ch:
        stubs = {target: bs.pb_grpc.SglangSchedulerStub(ch)}
        facts = await bs.model_facts(stubs, ())
        requests = bs.build_dataset(args, facts)
        errors = await bs.warmup(args, stubs, requests, ())
        if errors:
            raise RuntimeError("; ".join(errors))
        errors = await bs.flush_all(stubs, (), 30.0)
        if errors:
            raise RuntimeError("; ".join(errors))
        results, duration = await bs.run_benchmark(args, stubs, requests, ())
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    exact = all(r.output_len == r.expected_output_len for r in results)
    return {**bs.compute_metrics(results, duration), "exact_lengths": exact}


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from sglang_admin.client.testing import start_server

    schema = json.dumps(SCHEMA)
    sides: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "json_schema": []}
    with tempfile.TemporaryDirectory() as tmp:
        srv = start_server(Path(tmp))
        try:
            for r in range(ns.rounds):
                order = ["unconstrained", "json_schema"]
                if r % 2:
                    order.reverse()
                for side in order:
                    text = schema if side == "json_schema" else ""
                    metrics = asyncio.run(one_side(srv.target, ns, text))
                    sides[side].append(metrics)
                    print(f"round {r + 1} {side:13s} {metrics['output_throughput']:8.1f} tok/s "
                          f"({metrics['total_output_tokens']} tokens, "
                          f"{metrics['duration_s']:.2f} s)", file=sys.stderr)
        finally:
            srv.stop()
    best = {side: max(runs, key=lambda m: m["output_throughput"]) for side, runs in sides.items()}
    return {"best": best, "runs": sides}


def mask_cost(vocab_size: int, rows: int = 64) -> list[tuple[str, float, float, float]]:
    """(grammar point, fill ms, xgrammar apply ms, torch apply ms) for ``rows`` rows."""
    import random
    import time

    import torch
    import xgrammar as xgr

    from sglang_admin.model.grammar_mask import allocate_bitmask, apply_bitmask
    from sglang_admin.scheduler.grammar import GrammarState

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.:;{}[]\"'-_()"
    vocab = [chr(i) for i in range(32, 127)]
    seen = set(vocab)
    while len(vocab) < vocab_size - 1:
        token = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    stop = len(vocab)
    vocab.append("<|endoftext|>")
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab),
                             stop_token_ids=[stop])
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False)

    def best(fn: Any) -> float:
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1000

    logits = torch.randn(rows, len(vocab))
    out = []
    for name, prefix in (("start", ""), ("in a number", '[{"id": 1'),
                         ("in a string", '[{"id": 12, "name": "ab')):
        states = [GrammarState(compiled, (stop,)) for _ in range(rows)]
        for st in states:
            if prefix and not st.matcher.accept_string(prefix):
                raise RuntimeError(f"{prefix!r} does not match the schema")
        bitmask = allocate_bitmask(rows, len(vocab))

        def fill(states: list[GrammarState] = states, bitmask: Any = bitmask) -> None:
            for i, st in enumerate(states):
                st.fill_next_token_bitmask(bitmask, i)

        fill()
        out.append((
            name, best(fill),
            best(lambda b=bitmask: apply_bitmask(logits, b, list(range(rows)), "xgrammar")),
            best(lambda b=bitmask: apply_bitmask(logits, b, None, "torch")),
        ))
    return out


def print_table(res: dict[str, Any]) -> bool:
    free, constrained = res["best"]["unconstrained"], res["best"]["json_schema"]
    ratio = constrained["output_throughput"] / free["output_throughput"]
    ok = ratio >= TARGET_RATIO and free["exact_lengths"] and constrained["exact_lengths"]
    print(f"{'side':14s} {'output tok/s':>12s} {'tokens':>7s} {'p50 ITL ms':>10s}")
    for name, m in (("unconstrained", free), ("json_schema", constrained)):
        print(f"{name:14s} {m['output_throughput']:12.1f} {m['total_output_tokens']:7d} "
              f"{m['median_itl_ms']:10.2f}")
    print(f"ratio json_schema / unconstrained: {ratio:.2f}x (target >= {TARGET_RATIO}x) "
          f"{'ok' if ok else 'NOT MET'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--mask-cost-vocab", type=int, default=0,
                   help="also time the per-step mask work over a synthetic vocabulary")
    ns = p.parse_args(argv)
    if ns.mask_cost_vocab:
        import torch

        torch.set_num_threads(1)
        print(f"mask work per step, 64 rows, {ns.mask_cost_vocab}-token vocabulary (ms):")
        print(f"{'grammar point':14s} {'fill':>7s} {'xgrammar apply':>15s} {'torch apply':>12s}")
        for name, fill_ms, xgr_ms, torch_ms in mask_cost(ns.mask_cost_vocab):
            print(f"{name:14s} {fill_ms:7.2f} {xgr_ms:15.2f} {torch_ms:12.2f}")
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    res = run(ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps(res, indent=1))
    return 0 if print_table(res) else 1


if __name__ == "__main__":
    raise SystemExit(main())
