#!/usr/bin/env python
"""Multi-LoRA serving throughput: the same workload on the base model and spread over 4
adapters, side by side on one served worker, driven by this (client) process over gRPC.

The tool writes 4 random PEFT-format adapters (adapter_config.json +
adapter_model.safetensors, the layout peft's save_pretrained writes) for the embedded
default model, starts ``sglang-admin serve --enable-lora`` with them, then alternates rounds
of the two workloads (``--rounds`` each): ``--concurrency`` streaming Generate calls of
``--input-len`` prompt tokens and ``--output-len`` output tokens (ignore_eos), all sent at
once; base rounds send no lora_id, LoRA rounds give request i adapter i % 4. Figure: output
tokens/s from the first send to the last token, best round of each; target LoRA >= 0.6x base.

    python tools/bench_lora.py                 # about a minute on 2 cores
    python tools/bench_lora.py --rank 16 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc.aio

from sglang_admin.client.testing import free_port
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_ADAPTERS = 4
TARGET_RATIO = 0.6


def write_adapter(path: Path, cfg: dict, rank: int, seed: int) -> None:
    """A random LoRA adapter over every projection, in PEFT's on-disk format."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target, (fan_in, fan_out) in shapes.items():
            part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS,
        "bias": "none", "lora_dropout": 0.0,
    }))


async def one(stub: pb_grpc.SglangSchedulerStub, prompt: list[int], n: int, lora: str) -> int:
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=prompt), stream=True, lora_id=lora,
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True),
    )
    tokens = 0
    async for resp in stub.Generate(req, timeout=600):
        if resp.HasField("chunk"):
            tokens += len(resp.chunk.token_ids)
    return tokens


async def round_(stub: pb_grpc.SglangSchedulerStub, prompts: list[list[int]], n: int,
                 loras: list[str]) -> float:
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(stub, p, n, lora) for p, lora in zip(prompts, loras)))
    elapsed = time.perf_counter() - t0
    assert all(c == n for c in counts), counts
    return sum(counts) / elapsed


async def drive(target: str, args: argparse.Namespace, adapters: list[str]) -> dict:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        rng = random.Random(0)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        vocab = info.vocab_size

        def prompts() -> list[list[int]]:  # fresh prompts every round: no prefix reuse
            return [[rng.randrange(3, vocab) for _ in range(args.input_len)]
                    for _ in range(args.concurrency)]

        base = [""] * args.concurrency
        mixed = [adapters[i % len(adapters)] for i in range(args.concurrency)]
        await round_(stub, prompts(), 8, mixed)  # warm-up of both paths
        await round_(stub, prompts(), 8, base)
        rates: dict[str, list[float]] = {"base": [], "lora": []}
        for r in range(args.rounds):
            order = [("base", base), ("lora", mixed)]
            for name, loras in order if r % 2 == 0 else order[::-1]:
                rates[name].append(await round_(stub, prompts(), args.output_len, loras))
        return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8, help="rank of every adapter")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each workload")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    from sglang_admin.model.default_model import ensure_default_model

    model = ensure_default_model()
    cfg = json.loads((Path(model) / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i in range(NUM_ADAPTERS):
            write_adapter(Path(tmp) / f"lora{i}", cfg, args.rank, seed=i)
            paths.append(f"lora{i}={Path(tmp) / f'lora{i}'}")
        port = free_port()
        log = open(Path(tmp) / "server.log", "w")  # noqa: SIM115 - closed below
        server = subprocess.Popen(
            [sys.executable, "-m", "sglang_admin", "serve", "--port", str(port),
             "--grpc-http-sidecar-port", str(free_port()), "--enable-lora", "--max-loaded-loras", str(NUM_ADAPTERS),
             "--max-lora-rank", str(args.rank), "--lora-paths", *paths],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
        try:
            target = f"127.0.0.1:{port}"
            deadline = time.time() + 180
            while True:
                try:
                    asyncio.run(_ping(target))
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    if server.poll() is not None or time.time() > deadline:
                        log.flush()
                        print((Path(tmp) / "server.log").read_text()[-3000:], file=sys.stderr)
                        return 1
                    time.sleep(0.3)
            load = os.getloadavg()[0]
            rates = asyncio.run(drive(target, args, [f"lora{i}" for i in range(NUM_ADAPTERS)]))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
            log.close()
    best = {k: max(v) for k, v in rates.items()}
    ratio = best["lora"] / best["base"]
    print(f"load average before the run: {load:.2f}")
    print(f"workload: {args.concurrency} streams x {args.input_len} prompt + {args.output_len} "
          f"output tokens; {NUM_ADAPTERS} adapters of rank {args.rank} on all 7 projections")
    for name in ("base", "lora"):
        rounds = ", ".join(f"{r:.0f}" for r in rates[name])
        print(f"{name:5s} output tok/s: best {best[name]:.0f}  (rounds: {rounds})")
    met = ratio >= TARGET_RATIO
    print(f"LoRA / base: {ratio:.2f}x  (target >= {TARGET_RATIO}x: {'met' if met else 'MISSED'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "ratio": ratio, "load": load}))
    return 0 if met else 1


async def _ping(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        await stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest(), timeout=2)


if __name__ == "__main__":
    raise SystemExit(main())
