#!/usr/bin/env python
"""The served worker against transformers' batched ``generate``, side by side in one run.

What a user sees: a worker started as ``python -m sglang_admin serve`` (its own processes),
driven by a grpc.aio client in a process of its own that streams the mixed workload of
tools/bench_engine.py (64 requests, prompts 16..256 tokens, outputs 8..128, ignore_eos, all
at once, from an empty prefix cache), against transformers' left-padded batched greedy ``generate`` on the same
checkpoint in a third process with torch's default thread count. Rounds alternate (served,
transformers, served, ...) so that both see the same machine; the best round of each counts.

After the rounds, the rank's own step timing (GetMetrics' ``sglang:step_*`` families when the
worker has them) gives the decode step's non-model share.

Usage: python tools/bench_served.py [--model-path DIR] [--rounds N] [--concurrency N]
       [--json] [--server-arg=--flag ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.workloads import Workload, mixed_workload  # noqa: E402

# ------------------------------------------------------------------ the client process


async def _drive(target: str, work: Workload, concurrency: int = 0) -> dict[str, float | int]:
    """Stream every request of ``work``, at most ``concurrency`` at a time (0: all at once);
    returns seconds and tokens received."""
    import grpc.aio

    from sglang_admin.pb import common_pb2 as pb
    from sglang_admin.pb import common_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)

        async def one(i: int, prompt: list[int], n: int) -> int:
            req = pb.GenerateRequest(
                request_id=f"bench-{i}",
                tokenized=pb.TokenizedInput(input_ids=prompt),
                sampling_params=pb.SamplingParams(max_new_tokens=n, ignore_eos=True),
                stream=True,
            )
            got = 0
            async for resp in stub.Generate(req, timeout=600):
                if resp.HasField("chunk"):
                    got += len(resp.chunk.token_ids)
            return got

        # warm the connection and the rank (not timed), then start from an empty prefix
        # cache: transformers has none, and the rounds send the same prompts
        await one(-1, work.prompts[0][:16], 2)
        flushed = await stub.FlushCache(pb.FlushCacheRequest(timeout_s=60), timeout=120)
        if not flushed.success:
            raise RuntimeError(f"FlushCache failed: {flushed.message}")
        t0 = time.perf_counter()
        slots = asyncio.Semaphore(concurrency or len(work.prompts))

        async def limited(i: int, prompt: list[int], n: int) -> int:
            async with slots:
                return await one(i, prompt, n)

        got = await asyncio.gather(
            *(limited(i, p, n) for i, (p, n) in enumerate(zip(work.prompts, work.outputs)))
        )
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(got)}


def client_main(target: str, vocab: int, concurrency: int) -> None:
    print(json.dumps(asyncio.run(_drive(target, mixed_workload(vocab), concurrency))))


# ------------------------------------------------------------ the transformers process


def transformers_main(model_path: str, vocab: int, pad_id: int) -> None:
    import torch
    import transformers

    from tools.bench_engine import run_transformers

    work = mixed_workload(vocab)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    run_transformers(model, Workload("warmup", [p[:16] for p in work.prompts[:2]], [2, 2]),
                     pad_id)
    seconds, _ = run_transformers(model, work, pad_id)
    print(json.dumps({"seconds": seconds, "tokens": work.output_tokens,
                      "threads": torch.get_num_threads()}))


# ------------------------------------------------------------------------ the driver


def _child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _step_timing(target: str) -> dict[str, float]:
    """The rank's decode-step seconds by phase (all ranks), from GetMetrics."""
    import grpc
    from prometheus_client.parser import text_string_to_metric_families

    from sglang_admin.pb import common_pb2 as pb
    from sglang_admin.pb import common_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as ch:
        text = pb_grpc.SglangSchedulerStub(ch).GetMetrics(pb.GetMetricsRequest(), timeout=30).text
    phases: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang_admin:decode_step_phase_seconds_total":
                phase = sample.labels["phase"]
                phases[phase] = phases.get(phase, 0.0) + sample.value
            elif sample.name == "sglang_admin:decode_steps_total":
                phases["steps"] = phases.get("steps", 0.0) + sample.value
    return phases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded model")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for the worker (repeatable), e.g. --server-arg=--dp-size=2")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    p.add_argument("--concurrency", type=int, default=0,
                   help="streams in flight at most (0: all 64 at once); the decode-step "
                        "phases are then measured under that many streams")
    p.add_argument("--role", choices=["client", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--pad", type=int, default=0, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.role == "client":
        client_main(ns.target, ns.vocab, ns.concurrency)
        return 0
    if ns.role == "transformers":
        transformers_main(ns.model_path, ns.vocab, ns.pad)
        return 0

    import grpc

    from sglang_admin.client.testing import free_port, start_server
    from sglang_admin.pb import common_pb2 as pb

    tmp = Path(tempfile.mkdtemp(prefix="bench-served-"))
    args = (["--model-path", ns.model_path] if ns.model_path else []) + ns.server_arg
    srv = start_server(tmp, *args, "--enable-metrics", "--metrics-port", str(free_port()),
                       port=free_port())
    try:
        with grpc.insecure_channel(srv.target) as ch:
            from sglang_admin.pb import common_pb2_grpc as pb_grpc

            info = pb_grpc.SglangSchedulerStub(ch).GetModelInfo(pb.GetModelInfoRequest(),
                                                                timeout=30)
        model_path, vocab = info.model_path, info.vocab_size
        pad = info.pad_token_id or 0
        load = os.getloadavg()[0]
        print(f"model {model_path} (vocab {vocab}), {os.cpu_count()} CPUs, load {load:.2f}; "
              f"worker flags {args or '(defaults)'}; {ns.rounds} alternating rounds, best counts; "
              f"streams in flight: {ns.concurrency or 'all'}")
        served: list[float] = []
        hf: list[float] = []
        tokens = 0
        for r in range(ns.rounds):
            s = _child("--role", "client", "--target", srv.target, "--vocab", str(vocab),
                       "--concurrency", str(ns.concurrency))
            t = _child("--role", "transformers", "--model-path", model_path,
                       "--vocab", str(vocab), "--pad", str(pad))
            tokens = int(t["tokens"])
            if int(s["tokens"]) != tokens:
                raise RuntimeError(f"served {s['tokens']} tokens, expected {tokens}")
            served.append(tokens / s["seconds"])
            hf.append(tokens / t["seconds"])
            print(f"round {r + 1}: served {served[-1]:8.1f} tok/s   transformers "
                  f"{hf[-1]:8.1f} tok/s ({t['threads']} threads)   ratio "
                  f"{served[-1] / hf[-1]:.2f}x")
        best = max(served) / max(hf)
        print(f"\nbest: served {max(served):.1f} tok/s, transformers {max(hf):.1f} tok/s, "
              f"ratio {best:.2f}x (target >= 2.0x)")
        result: dict[str, object] = {"served_tok_s": max(served), "transformers_tok_s": max(hf),
                                     "ratio": best, "rounds": ns.rounds}
        timing = _step_timing(srv.target)
        steps = timing.pop("steps", 0.0)
        total = sum(timing.values())
        if steps and total > 0:
            share = 1 - timing.get("model", 0.0) / total
            result.update(decode_steps=steps, decode_phase_s=timing, decode_non_model_share=share)
            print(f"\nthe rank's decode steps ({steps:.0f} in all rounds, "
                  f"{total / steps * 1e3:.2f} ms each on average), by phase:")
            for phase, seconds in timing.items():
                print(f"  {phase:<12}{seconds / steps * 1e3:8.3f} ms  {seconds / total:6.1%}")
            print(f"  non-model share {share:.1%} (target < 15%)")
        if ns.json:
            print(json.dumps(result))
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
