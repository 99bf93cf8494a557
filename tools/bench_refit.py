#!/usr/bin/env python
"""Refit-path costs, each figure beside its reference, measured side by side in one run.

1. UpdateWeightsFromDisk wall time (as the client sees it) on a served ~100M-parameter
   random Qwen2 checkpoint (float32), against a bare safetensors load of the same files
   into preallocated tensors of the same shapes in one process (safe_open, get_tensor,
   copy_), with the rank's torch thread count: ratio <= 1.5.
2. PauseGeneration + ContinueGeneration on an idle worker against one FlushCache: ratio of
   the medians <= 2.

The worker runs in its own process (``sglang-admin serve``, dp 1); this process is the
client and runs the bare load. Rounds alternate the measured op and its reference; each
figure is the best round (the machine may be shared and noisy).

Usage: python tools/bench_refit.py [--rounds N] [--samples N] [--layers N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.pb import common_pb2 as pb  # noqa: E402
from sglang_admin.pb import common_pb2_grpc as pb_grpc  # noqa: E402

UPDATE_TARGET = 1.5
PAUSE_TARGET = 2.0


def build_checkpoint(path: Path, layers: int) -> int:
    """A random float32 Qwen2 checkpoint (~100M parameters at 12 layers); its parameter count."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=True, torch_dtype="float32", eos_token_id=1, bos_token_id=0,
    )
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def rank_threads(dp_size: int = 1) -> int:
    """The torch thread count a rank of a dp ``dp_size`` worker uses (scheduler/rank/builder.py)."""
    from sglang_admin.config import ServerArgs

    return ServerArgs(dp_size=dp_size).rank_threads


def bare_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Preallocated float32 tensors shaped as the checkpoint's (the bare load's targets)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                out[name] = torch.zeros(f.get_slice(name).get_shape(), dtype=torch.float32)
    return out


def bare_load(path: Path, tensors: dict[str, torch.Tensor]) -> float:
    """Seconds to read every tensor of the checkpoint into ``tensors`` in place."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118
                    tensors[name].copy_(f.get_tensor(name))
    return time.perf_counter() - t0


def served_update(stub: pb_grpc.SglangSchedulerStub, path: Path, version: str) -> float:
    t0 = time.perf_counter()
    resp = stub.UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(path), weight_version=version),
        timeout=600)
    dt = time.perf_counter() - t0
    if not resp.success:
        raise RuntimeError(f"UpdateWeightsFromDisk failed: {resp.message}")
    return dt


def pause_continue(stub: pb_grpc.SglangSchedulerStub) -> float:
    t0 = time.perf_counter()
    paused = stub.PauseGeneration(pb.PauseGenerationRequest(mode="abort"), timeout=30)
    cont = stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30)
    dt = time.perf_counter() - t0
    if not (paused.success and cont.success):
        raise RuntimeError(f"pause/continue failed: {paused.message} / {cont.message}")
    return dt


def flush(stub: pb_grpc.SglangSchedulerStub) -> float:
    t0 = time.perf_counter()
    resp = stub.FlushCache(pb.FlushCacheRequest(), timeout=30)
    dt = time.perf_counter() - t0
    if not resp.success:
        raise RuntimeError(f"FlushCache failed: {resp.message}")
    return dt


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from sglang_admin.client.testing import start_server

    tmp = Path(tempfile.mkdtemp(prefix="bench-refit-"))
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    try:
        torch.set_num_threads(rank_threads())  # the bare load copies as the rank does
        ckpt = tmp / "ckpt"
        params = build_checkpoint(ckpt, ns.layers)
        size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        log(f"checkpoint: {params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB")
        srv = start_server(tmp, "--model-path", str(ckpt), "--dtype", "float32",
                           "--max-total-tokens", "4096")
        try:
            stub = srv.stub()
            tensors = bare_tensors(ckpt)
            bare_load(ckpt, tensors)  # warm the page cache and the tensors
            served_update(stub, ckpt, "warm")
            updates: list[float] = []
            bares: list[float] = []
            for r in range(ns.rounds):
                pair = [("bare", lambda: bare_load(ckpt, tensors)),
                        ("update", lambda r=r: served_update(stub, ckpt, f"round-{r}"))]
                for name, fn in pair if r % 2 == 0 else reversed(pair):
                    (bares if name == "bare" else updates).append(fn())
                log(f"round {r}: update {updates[-1]:.3f}s, bare load {bares[-1]:.3f}s")

            for _ in range(5):  # warm both paths
                pause_continue(stub)
                flush(stub)
            pc_rounds: list[float] = []
            fl_rounds: list[float] = []
            for r in range(ns.rounds):
                pcs: list[float] = []
                fls: list[float] = []
                for _ in range(ns.samples):
                    pcs.append(pause_continue(stub))
                    fls.append(flush(stub))
                pc_rounds.append(statistics.median(pcs))
                fl_rounds.append(statistics.median(fls))
                log(f"round {r}: pause+continue p50 {pc_rounds[-1] * 1e3:.2f} ms, "
                    f"flush p50 {fl_rounds[-1] * 1e3:.2f} ms")
        finally:
            srv.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    best_update, best_bare = min(updates), min(bares)
    best_pc, best_fl = min(pc_rounds), min(fl_rounds)
    return {
        "parameters": params,
        "checkpoint_bytes": size,
        "update_s": best_update,
        "bare_load_s": best_bare,
        "update_ratio": best_update / best_bare,
        "pause_continue_ms": best_pc * 1e3,
        "flush_ms": best_fl * 1e3,
        "pause_ratio": best_pc / best_fl,
        "rounds": ns.rounds,
        "samples": ns.samples,
    }


def print_table(res: dict[str, Any]) -> bool:
    rows = [
        ("UpdateWeightsFromDisk vs bare safetensors load",
         f"{res['update_s']:.3f} s", f"{res['bare_load_s']:.3f} s", res["update_ratio"],
         UPDATE_TARGET),
        ("PauseGeneration+ContinueGeneration vs FlushCache (p50)",
         f"{res['pause_continue_ms']:.2f} ms", f"{res['flush_ms']:.2f} ms", res["pause_ratio"],
         PAUSE_TARGET),
    ]
    print(f"checkpoint: {res['parameters'] / 1e6:.1f}M parameters, "
          f"{res['checkpoint_bytes'] / 2**20:.0f} MiB float32; best of {res['rounds']} rounds")
    print(f"{'figure':<56} {'ours':>11} {'reference':>11} {'ratio':>6} {'target':>7}  ok")
    ok = True
    for name, ours, ref, ratio, target in rows:
        passed = ratio <= target
        ok &= passed
        print(f"{name:<56} {ours:>11} {ref:>11} {ratio:>6.2f} {'<= ' + str(target):>7}  "
              f"{'yes' if passed else 'NO'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=30,
                        help="pause+continue and flush calls per round")
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
