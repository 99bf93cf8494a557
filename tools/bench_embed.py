#!/usr/bin/env python
"""Embeddings per second of the served worker against transformers' batched forward on the
same checkpoint, one run each.

The worker (``python -m sglang_admin serve``, its own processes; by default the embedded
default model served with ``--is-embedding``) is driven by a grpc.aio client in a process of
its own that sends every input of a mixed-length workload (128 inputs of 16..256 tokens,
fixed seed) at once through Embed, from an empty prefix cache. transformers runs in a third
process: ``AutoModel`` on the same checkpoint, right-padded batches of ``--hf-batch`` inputs in
the same order, the last real token's final hidden state L2-normalized (what the worker
answers). Both sides' vectors are compared, then the ratio is printed (target >= 2x).

Usage: python tools/bench_embed.py [--model-path DIR] [--hf-batch N] [--json]
       [--server-arg=--flag ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_INPUTS = 128
MIN_LEN, MAX_LEN = 16, 256
SEED = 32
CHECKED = 8  # vectors compared between the two sides


def workload(vocab: int) -> list[list[int]]:
    """The mixed-length inputs (the same on both sides)."""
    rng = random.Random(SEED)
    return [[rng.randrange(vocab) for _ in range(rng.randint(MIN_LEN, MAX_LEN))]
            for _ in range(NUM_INPUTS)]


# ------------------------------------------------------------------ the client process


async def _drive(target: str, inputs: list[list[int]]) -> dict:
    import grpc.aio

    from sglang_admin.pb import common_pb2 as pb
    from sglang_admin.pb import common_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)

        async def one(ids: list[int]) -> list[float]:
            out = await stub.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=ids)),
                                   timeout=1200)
            return list(out.embedding)

        await one(inputs[0][:8])  # warm the connection and the rank (not timed)
        flushed = await stub.FlushCache(pb.FlushCacheRequest(timeout_s=60), timeout=120)
        if not flushed.success:
            raise RuntimeError(f"FlushCache failed: {flushed.message}")
        t0 = time.perf_counter()
        vectors = await asyncio.gather(*(one(ids) for ids in inputs))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "vectors": vectors[:CHECKED]}


def client_main(target: str, vocab: int) -> None:
    print(json.dumps(asyncio.run(_drive(target, workload(vocab)))))


# ------------------------------------------------------------ the transformers process


def transformers_main(model_path: str, vocab: int, batch: int) -> None:
    import torch
    import transformers

    inputs = workload(vocab)
    model = transformers.AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()

    @torch.no_grad()
    def run(group: list[list[int]]) -> torch.Tensor:
        longest = max(map(len, group))
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros(len(group), longest, dtype=torch.long)
        for i, seq in enumerate(group):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        states = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = states[torch.arange(len(group)), mask.sum(dim=1) - 1]
        return torch.nn.functional.normalize(last.float(), p=2, dim=-1)

    run([inputs[0][:8]])  # warm-up (not timed)
    t0 = time.perf_counter()
    vectors = [run(inputs[i : i + batch]) for i in range(0, len(inputs), batch)]
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "threads": torch.get_num_threads(),
                      "vectors": torch.cat(vectors)[:CHECKED].tolist()}))


# ------------------------------------------------------------------------ the driver


def _child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{args[1]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None,
                   help="an embedding checkpoint (default: the embedded model, --is-embedding)")
    p.add_argument("--hf-batch", type=int, default=32, help="transformers' batch size")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for the worker (repeatable)")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    p.add_argument("--role", choices=["client", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.role == "client":
        client_main(ns.target, ns.vocab)
        return 0
    if ns.role == "transformers":
        transformers_main(ns.model_path, ns.vocab, ns.hf_batch)
        return 0

    import grpc

    from sglang_admin.client.testing import free_port, start_server
    from sglang_admin.pb import common_pb2 as pb
    from sglang_admin.pb import common_pb2_grpc as pb_grpc

    tmp = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    args = ["--model-path", ns.model_path] if ns.model_path else ["--is-embedding"]
    args += ns.server_arg
    srv = start_server(tmp, *args, port=free_port())
    try:
        with grpc.insecure_channel(srv.target) as ch:
            info = pb_grpc.SglangSchedulerStub(ch).GetModelInfo(pb.GetModelInfoRequest(),
                                                                timeout=30)
        if info.is_generation:
            raise SystemExit(f"{info.model_path} is served as a generation model: pass "
                             "--server-arg=--is-embedding")
        print(f"model {info.model_path} ({', '.join(info.architectures)}, vocab "
              f"{info.vocab_size}), {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; "
              f"worker flags {args}; {NUM_INPUTS} inputs of {MIN_LEN}..{MAX_LEN} tokens, "
              f"sent at once; transformers batches of {ns.hf_batch}")
        served = _child("--role", "client", "--target", srv.target,
                        "--vocab", str(info.vocab_size))
        hf = _child("--role", "transformers", "--model-path", info.model_path,
                    "--vocab", str(info.vocab_size), "--hf-batch", str(ns.hf_batch))
        diff = max(abs(a - b) for u, v in zip(served["vectors"], hf["vectors"])
                   for a, b in zip(u, v))
        served_rate, hf_rate = NUM_INPUTS / served["seconds"], NUM_INPUTS / hf["seconds"]
        ratio = served_rate / hf_rate
        print(f"served       {served_rate:8.1f} embeddings/s ({served['seconds']:.2f} s)")
        print(f"transformers {hf_rate:8.1f} embeddings/s ({hf['seconds']:.2f} s, "
              f"{hf['threads']} threads)")
        print(f"ratio {ratio:.2f}x (target >= 2.0x); the first {CHECKED} vectors differ by "
              f"at most {diff:.1e}")
        if ns.json:
            print(json.dumps({"served_per_s": served_rate, "transformers_per_s": hf_rate,
                              "ratio": ratio, "max_vector_difference": diff}))
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
