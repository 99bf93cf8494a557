#!/usr/bin/env python
"""One layer's bfloat16 prefill attention of a whole step on CPU, side by side in one run:
torch's SDPA once per sequence (the extend path's call), the flash kernel once per sequence
(``CpuKernels.extend_attend``), and every sequence in one kernel call
(model/extend_batch.py; where the CPU has AMX tiles, that call also with the tiles off), at SmolLM2-135M's shape (9 query / 3 kv heads of 64).

Cases: the chat step (32 prompts of 40-100 tokens, tools/bench_cpu_peers.py's chat
workload), one 512-token and one 2048-token prompt, and 8 chunks of 64 after 448 cached
tokens. The paths alternate per round; the median counts. Prints one line per case and path
and the ratio of each to per-sequence SDPA.

Usage: python tools/bench_prefill_batch.py [--threads 2] [--rounds 7] [--iters 10]
       [--clock cpu]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.model.cpu_kernels_build import load_cpu_kernels  # noqa: E402
from sglang_admin.model.extend_batch import ExtendBatch, tile_kernel  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64


def cases() -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, [(prefix, n)] per sequence)."""
    rng = random.Random(0)
    return [("chat 32 x 40-100", [(0, rng.randrange(40, 101)) for _ in range(32)]),
            ("one 512", [(0, 512)]),
            ("one 2048", [(0, 2048)]),
            ("8 x 64 after 448", [(448, 64)] * 8)]


def run_case(kernel, name: str, seqs: list[tuple[int, int]], rounds: int, iters: int,  # noqa: ANN001
             clock, tiles: bool) -> bool:  # noqa: ANN001
    """Times one case's paths and prints their lines; False when a path's output is off."""
    bf = torch.bfloat16
    scale = DIM**-0.5
    gen = torch.Generator().manual_seed(0)
    total = sum(p + n for p, n in seqs)
    tokens = sum(n for _, n in seqs)
    k_pool = torch.randn(total + 7, KV_HEADS, DIM, generator=gen).to(bf)
    v_pool = torch.randn(total + 7, KV_HEADS, DIM, generator=gen).to(bf)
    order = torch.randperm(total + 7, generator=gen)[:total]  # slots scattered
    q = torch.randn(tokens, HEADS, DIM, generator=gen).to(bf)
    chunks, at, off = [], 0, 0
    for p, n in seqs:
        chunks.append((at, n, p, order[off:off + p + n]))
        at, off = at + n, off + p + n
    batch = ExtendBatch.of(kernel, chunks)

    # a chunk without a cached prefix attends to the layer's new k, v as they are (no gather)
    new_kv = {a: (k_pool[slots].transpose(0, 1)[None], v_pool[slots].transpose(0, 1)[None])
              for a, n, p, slots in chunks if not p}

    def sdpa() -> torch.Tensor:
        outs = []
        for a, n, p, slots in chunks:
            qs = q[a:a + n].transpose(0, 1)[None]
            if p:  # the extend path gathers a cached prefix's rows and masks
                ks = k_pool[slots].transpose(0, 1)[None]
                vs = v_pool[slots].transpose(0, 1)[None]
            else:
                ks, vs = new_kv[a]
            if p:
                keys = torch.arange(p + n)[None, :]
                mask = (keys <= torch.arange(p, p + n)[:, None]).view(1, 1, n, p + n)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                   enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
        return torch.cat(outs)

    def per_seq() -> torch.Tensor:
        return torch.cat([kernel.extend_attend(q[a:a + n], k_pool, v_pool, s, p, scale,
                                               None) for a, n, p, s in chunks])

    def batched() -> torch.Tensor:
        return batch.attend(q, k_pool, v_pool, scale, None,
                            torch.empty(tokens, HEADS * DIM, dtype=bf))

    def batched_vector() -> torch.Tensor:
        tile_kernel(kernel, False)
        try:
            return batched()
        finally:
            tile_kernel(kernel, True)

    paths = {"sdpa per sequence": sdpa, "kernel per sequence": per_seq,
             "kernel, one call": batched}
    if tiles:  # the same call on AVX512_BF16 alone
        paths["one call, no tiles"] = batched_vector
    ref = sdpa().float()
    for label, fn in paths.items():
        diff = (fn().float() - ref).abs().max().item()
        if diff > 0.05:
            print(f"{name}: {label} differs from SDPA by {diff}")
            return False
    times: dict[str, list[float]] = {label: [] for label in paths}
    for _ in range(rounds):
        for label, fn in paths.items():
            t = clock()
            for _ in range(iters):
                fn()
            times[label].append((clock() - t) / iters * 1e3)
    base = statistics.median(times["sdpa per sequence"])
    for label in paths:
        ms = statistics.median(times[label])
        print(f"{name:18s} ({tokens:4d} tokens) {label:20s} {ms:7.2f} ms  "
              f"{base / ms:5.2f}x sdpa")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU seconds (with --threads 1 a ratio that holds "
                         "on a busy machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = load_cpu_kernels()
    if kernel is None or not kernel.extend_applies(DIM, torch.bfloat16):
        print("no bfloat16 prefill kernel on this CPU (AVX512_BF16)")
        return 1
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    tiles = tile_kernel(kernel)
    print(f"threads {args.threads}, {args.clock} clock, AMX tiles {'on' if tiles else 'absent'}, {HEADS} heads / {KV_HEADS} kv heads of {DIM}, "
          f"median of {args.rounds} rounds x {args.iters}")
    for name, seqs in cases():
        if not run_case(kernel, name, seqs, args.rounds, args.iters, clock, tiles):
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
