#!/usr/bin/env python
"""UpdateWeightsFromDistributed throughput against a bare gloo broadcast of the same
tensors between two processes, side by side in one run.

A random ~100M-parameter float32 Qwen2 checkpoint is served by a dp 1 worker (``sglang-admin
serve``, its own process); this process is the trainer (rank 0 of a gloo group of 2) and
pushes every tensor of the checkpoint:

- ``WeightPusher.push``: buckets of one dtype (256 MiB), one UpdateWeightsFromDistributed
  per bucket and one broadcast per tensor, timed as the trainer sees it (RPC, drain,
  receive, load, cache flush);
- SGLang's format: one UpdateWeightsFromDistributed naming every tensor, one broadcast per
  tensor (what verl, slime and OpenRLHF send);
- ``WeightPusher.push`` with ``flatten=True``: one flattened broadcast per bucket;
- bare gloo, per tensor and flattened: the same broadcasts from this process to a second
  process that only receives them into preallocated tensors (a group of its own; flattened,
  it copies each tensor out of the bucket as a loader must), timed the same way.

Rounds alternate the figures; each is the best round (the machine may be shared and
noisy), the ratio of the medians beside it. Target: ours >= 0.8x the bare broadcast of
the same format, in bytes/s.

Usage: python tools/bench_weight_sync.py [--rounds N] [--layers N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.client.trainer import WeightPusher  # noqa: E402
from sglang_admin.model.dist_group import broadcast_from_trainer, join_group  # noqa: E402
from sglang_admin.model.weight_push import (  # noqa: E402
    DEFAULT_BUCKET_BYTES,
    Bucket,
    broadcast_bucket,
    buckets,
)
from sglang_admin.pb import common_pb2 as pb  # noqa: E402
from sglang_admin.pb import common_pb2_grpc as pb_grpc  # noqa: E402
from tools.bench_refit import build_checkpoint, rank_threads  # noqa: E402

TARGET = 0.8
TIMEOUT_S = 600.0


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                out[name] = f.get_tensor(name).contiguous()
    return out


# ---------------------------------------------------------------- the bare receiver


def bare_receiver(port: int, shapes: list[tuple[str, list[int]]], bucket_sizes: list[int],
                  threads: int, conn: Any) -> None:
    """Rank 1 of a plain gloo group: receive each round's broadcasts into preallocated
    tensors, in the format the trainer names."""
    torch.set_num_threads(threads)
    group = join_group("127.0.0.1", port, 1, 2, "bare", "gloo", TIMEOUT_S)
    targets = [torch.empty(s, dtype=torch.float32) for _, s in shapes]
    flats = [torch.empty(n, dtype=torch.float32) for n in bucket_sizes]
    conn.send("ready")
    while True:
        fmt = conn.recv()
        if fmt == "stop":
            break
        bufs = flats if fmt == "flattened" else targets
        for buf in bufs:
            broadcast_from_trainer(group, buf, TIMEOUT_S)
        if fmt == "flattened":  # as a receiver that loads them must: copy each tensor out
            left = iter(targets)
            for flat in flats:
                start = 0
                while start < flat.numel():
                    t = next(left)
                    t.view(-1).copy_(flat[start:start + t.numel()])
                    start += t.numel()
        conn.send("done")
    group.destroy()


# ---------------------------------------------------------------- the four figures


def push_bare(group: Any, conn: Any, fmt: str, todo: list[Bucket]) -> float:
    conn.send(fmt)
    t0 = time.perf_counter()
    for bucket in todo:
        if fmt == "flattened":
            broadcast_bucket(group, bucket, TIMEOUT_S)
        else:
            for t in bucket.tensors:
                broadcast_from_trainer(group, t, TIMEOUT_S)
    assert conn.recv() == "done"
    return time.perf_counter() - t0


def push_ours(pusher: WeightPusher, tensors: dict[str, torch.Tensor], version: str,
              flatten: bool) -> float:
    pusher.flatten = flatten
    t0 = time.perf_counter()
    pusher.push(tensors.items(), weight_version=version)
    return time.perf_counter() - t0


def push_ours_per_tensor(stub: pb_grpc.SglangSchedulerStub, pusher: WeightPusher,
                         tensors: dict[str, torch.Tensor], version: str) -> float:
    """SGLang's format: every name in one call, one broadcast per tensor."""
    group = pusher.group
    assert group is not None
    answer: dict[str, Any] = {}
    req = pb.UpdateWeightsFromDistributedRequest(
        names=list(tensors), dtypes=["float32"] * len(tensors),
        shapes=[pb.TensorShape(dims=list(t.shape)) for t in tensors.values()],
        group_name=pusher.group_name, weight_version=version)
    t0 = time.perf_counter()
    call = threading.Thread(target=lambda: answer.update(
        resp=stub.UpdateWeightsFromDistributed(req, timeout=TIMEOUT_S)))
    call.start()
    for t in tensors.values():
        broadcast_from_trainer(group, t, TIMEOUT_S)
    call.join()
    dt = time.perf_counter() - t0
    if not answer["resp"].success:
        raise RuntimeError(answer["resp"].message)
    return dt


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from sglang_admin.client.testing import free_port, start_server

    tmp = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    threads = rank_threads()
    torch.set_num_threads(threads)
    ctx = mp.get_context("spawn")
    try:
        ckpt = tmp / "ckpt"
        params = build_checkpoint(ckpt, ns.layers)
        tensors = read_tensors(ckpt)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        todo = buckets(tensors.items(), DEFAULT_BUCKET_BYTES)
        log(f"checkpoint: {params / 1e6:.1f}M parameters, {len(tensors)} tensors, "
            f"{nbytes / 2**20:.0f} MiB, {len(todo)} bucket(s)")
        bare_port = free_port()
        here, there = ctx.Pipe()
        receiver = ctx.Process(target=bare_receiver, args=(
            bare_port, [(n, list(t.shape)) for n, t in tensors.items()],
            [sum(t.numel() for t in b.tensors) for b in todo], threads, there))
        receiver.start()
        bare_group = join_group("127.0.0.1", bare_port, 0, 2, "bare", "gloo", TIMEOUT_S)
        assert here.recv() == "ready"
        srv = start_server(tmp, "--model-path", str(ckpt), "--dtype", "float32",
                           "--max-total-tokens", "4096")
        try:
            stub = srv.stub()
            pusher = WeightPusher([srv.target], timeout_s=TIMEOUT_S)
            pusher.join("127.0.0.1", free_port(), group_name="bench")
            runs = {
                "pusher": lambda r: push_ours(pusher, tensors, f"p{r}", flatten=False),
                "bare_per_tensor": lambda r: push_bare(bare_group, here, "per_tensor", todo),
                "sglang_format": lambda r: push_ours_per_tensor(stub, pusher, tensors,
                                                                f"s{r}"),
                "pusher_flattened": lambda r: push_ours(pusher, tensors, f"f{r}",
                                                        flatten=True),
                "bare_flattened": lambda r: push_bare(bare_group, here, "flattened", todo),
            }
            figures: dict[str, list[float]] = {k: [] for k in runs}
            for fn in runs.values():  # warm every path once
                fn(-1)
            for r in range(ns.rounds):
                order = list(runs) if r % 2 == 0 else list(reversed(runs))
                for name in order:
                    figures[name].append(runs[name](r))
                log(f"round {r}: " + ", ".join(
                    f"{k} {nbytes / v[-1] / 2**20:.0f} MiB/s" for k, v in figures.items()))
            pusher.destroy()
        finally:
            srv.stop()
            here.send("stop")
            receiver.join(60)
            bare_group.destroy()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    best = {k: nbytes / min(v) for k, v in figures.items()}
    median = {k: nbytes / statistics.median(v) for k, v in figures.items()}
    return {
        "median_bytes_per_s": median,
        "median_ratios": [median["pusher"] / median["bare_per_tensor"],
                          median["sglang_format"] / median["bare_per_tensor"],
                          median["pusher_flattened"] / median["bare_flattened"]],
        "parameters": params,
        "bytes": nbytes,
        "tensors": len(tensors),
        "buckets": len(todo),
        "bytes_per_s": best,
        "pusher_ratio": best["pusher"] / best["bare_per_tensor"],
        "sglang_format_ratio": best["sglang_format"] / best["bare_per_tensor"],
        "flattened_ratio": best["pusher_flattened"] / best["bare_flattened"],
        "rounds": ns.rounds,
    }


def print_table(res: dict[str, Any]) -> bool:
    b = res["bytes_per_s"]
    rows = [
        ("WeightPusher.push (a call per bucket, a broadcast per tensor)",
         b["pusher"], b["bare_per_tensor"], res["pusher_ratio"]),
        ("SGLang's format (one call, a broadcast per tensor)",
         b["sglang_format"], b["bare_per_tensor"], res["sglang_format_ratio"]),
        ("WeightPusher.push, flatten=True (a broadcast per bucket)",
         b["pusher_flattened"], b["bare_flattened"], res["flattened_ratio"]),
    ]
    print(f"checkpoint: {res['parameters'] / 1e6:.1f}M parameters, {res['tensors']} tensors, "
          f"{res['bytes'] / 2**20:.0f} MiB float32; best of {res['rounds']} rounds")
    print(f"{'figure (bytes/s against a bare gloo broadcast)':<64} {'ours':>11} "
          f"{'bare gloo':>11} {'ratio':>6} {'target':>7}  ok  {'median ratio':>12}")
    ok = True
    for (name, ours, bare, ratio), med in zip(rows, res["median_ratios"], strict=True):
        passed = ratio >= TARGET
        ok &= passed
        print(f"{name:<64} {ours / 2**20:>7.0f} MiB/s {bare / 2**20:>5.0f} MiB/s "
              f"{ratio:>6.2f} {'>= ' + str(TARGET):>7}  {'yes' if passed else 'NO ':<3} "
              f"{med:>12.2f}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12, help="12: ~100M parameters")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    ns = parser.parse_args(argv)
    res = run(ns)
    ok = print_table(res)
    if ns.json:
        ns.json.write_text(json.dumps(res, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
