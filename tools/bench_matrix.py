#!/usr/bin/env python
"""The benchmark matrix: served worker against transformers per (shape, dtype, workload).

One command for issue 28's figures. For every checkpoint shape (random weights made from a
published config with transformers, cached under --cache-dir) and every dtype:

- a worker is started as ``python -m sglang_admin serve --model-path DIR --dtype D`` (its
  own processes), and a grpc.aio client in a process of its own streams each workload to it,
  from an empty prefix cache;
- transformers' left-padded batched ``generate`` runs the same workload on the same checkpoint
  in the same dtype, in a process of its own with as many torch threads as the cores both
  sides may use (--cores: both are pinned to the same cores; default all of this process's);
- the two alternate, --rounds rounds each; the best round of each side counts, the ratio is
  served / transformers (output tokens asked for, per second from the first send);
- the decode step's matmul floor: the matmuls of a batch-32 decode step alone (every
  projection of every layer and the LM head; attention at a 48-token context is left out),
  run back to back as a step runs them, each layer's weights tensors of their own (a real
  model's weights do not fit in cache: they stream from memory in a step, and so here),
  each shape through torch's faster GEMM there (``F.linear`` or oneDNN on a packed weight),
  in that dtype with that thread count, in this run. Printed beside it: the "hot" figure,
  the sum of each shape's GEMM timed on one weight repeated (in cache; no step can reach
  it). Our step: the real ModelRunner driven in-process at batch 32 with the worker's
  default lanes and threads, under the OpenMP settings the worker gives its ranks
  (tools/bench_decode.py's ``time_decode``). Floor and step each run in a child process of
  their own, alternated --floor-rounds times (default 2: floor, step, floor, step). The
  table prints step / floor, both the best of their repetitions and rounds (this machine is
  shared: the least disturbed repetition is the closest to what the code costs; alternating
  keeps one burst of load from deciding the ratio).

Workloads (tools/workloads.py, fixed seeds): mixed (64 requests, prompts 16..256, outputs
8..128), chat (32 at once, prompts 30..60, outputs 64..256), long (8 prompts of 1..2k tokens,
16 outputs), prefix (32 requests sharing a 960-token prefix, 16 outputs), n8 (8 prompts, n = 8
samples of 128 tokens at temperature 1). Every request ignores EOS; transformers generates the
longest output of a workload for every row (what a batched ``generate`` costs).

Usage: python tools/bench_matrix.py [--quick] [--shapes S ...] [--dtypes D ...]
       [--workloads W ...] [--rounds N] [--cores N] [--cache-dir DIR] [--json PATH]
       [--server-arg=--flag ...] [--small]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.constants import rank_openmp_environment  # noqa: E402
from tools.workloads import (  # noqa: E402
    Workload,
    chat_workload,
    long_prompt_workload,
    mixed_workload,
    parallel_sampling_workload,
    prefix_workload,
)

# Published configs (the fields that set the compute; random weights). The Llama-3.2 shape
# keeps plain RoPE (its llama3 frequency scaling changes no cost) and an 8k context.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m": ("llama", dict(
        num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
        rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    "qwen2.5-0.5b": ("qwen2", dict(
        num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)),
    "llama3.2-1b": ("llama", dict(
        num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    # for the tool's own test: runs in seconds
    "tiny": ("llama", dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, tie_word_embeddings=False,
        max_position_embeddings=4096)),
}
DEFAULT_SHAPES = ["smollm2-135m", "qwen2.5-0.5b"]
DTYPES = ["float32", "bfloat16"]
CHECKPOINT_VERSION = 1  # bump when the way checkpoints are built changes


def workload(name: str, vocab: int, small: bool) -> Workload:
    """The named workload; ``small``: a few requests of a few tokens (--quick, tests)."""
    makers: dict[str, Callable[[], Workload]] = {
        "mixed": lambda: mixed_workload(vocab) if not small else Workload(
            "mixed", [p[:32] for p in mixed_workload(vocab).prompts[:8]],
            [o // 8 + 1 for o in mixed_workload(vocab).outputs[:8]]),
        "chat": lambda: chat_workload(vocab, **({"requests": 8, "output": (16, 32)}
                                                 if small else {})),
        "long": lambda: long_prompt_workload(vocab, **({"requests": 2, "prompt": (256, 512),
                                                        "output": 4} if small else {})),
        "prefix": lambda: prefix_workload(vocab) if not small else Workload(
            "prefix", [p[-96:] for p in prefix_workload(vocab).prompts[:8]], [4] * 8),
        "n8": lambda: parallel_sampling_workload(vocab, **({"requests": 2, "n": 4, "output": 16}
                                                           if small else {})),
    }
    return makers[name]()


WORKLOADS = ["mixed", "chat", "long", "prefix", "n8"]


# ------------------------------------------------------------------------ checkpoints


def checkpoint(shape: str, cache_dir: Path) -> Path:
    """The random checkpoint of ``shape`` (float32 safetensors, made once, then cached)."""
    path = cache_dir / f"{shape}-v{CHECKPOINT_VERSION}"
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    kind, fields = SHAPES[shape]
    common = dict(bos_token_id=0, eos_token_id=1, pad_token_id=0, hidden_act="silu")
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, **fields))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, **fields))
    torch.manual_seed(0)
    with torch.no_grad():  # deterministic weights of a sensible scale (init is not seeded)
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):
                p.normal_(0, 0.02)
            else:  # the RMSNorm weights
                p.fill_(1.0)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=cache_dir))
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)  # atomic: a half-written checkpoint is never found
    return path


# ------------------------------------------------------------------- the client process


async def drive(target: str, work: Workload) -> dict[str, float]:
    """Stream every request of ``work`` at once to the worker from an empty prefix cache;
    returns seconds and the output tokens received."""
    import grpc.aio

    from sglang_admin.pb import common_pb2 as pb
    from sglang_admin.pb import common_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)

        async def one(i: int, prompt: list[int], n: int) -> int:
            params = pb.SamplingParams(max_new_tokens=n, ignore_eos=True,
                                       temperature=work.temperature, n=work.n)
            req = pb.GenerateRequest(request_id=f"matrix-{i}", stream=True,
                                     tokenized=pb.TokenizedInput(input_ids=prompt),
                                     sampling_params=params)
            got = 0
            async for resp in stub.Generate(req, timeout=3600):
                if resp.HasField("chunk"):
                    got += len(resp.chunk.token_ids)
            return got

        await one(-1, work.prompts[0][:16], 2)  # warm the connection and the rank
        flushed = await stub.FlushCache(pb.FlushCacheRequest(timeout_s=60), timeout=120)
        if not flushed.success:
            raise RuntimeError(f"FlushCache failed: {flushed.message}")
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(i, p, n) for i, (p, n) in
                                     enumerate(zip(work.prompts, work.outputs))))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(got)}


# ------------------------------------------------------------- the transformers process


def hf_generate(model: Any, work: Workload, pad_id: int) -> float:
    """One left-padded batched ``generate`` of the whole workload; returns seconds."""
    import torch

    longest = max(len(p) for p in work.prompts)
    ids = torch.full((len(work.prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(work.prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    sampling: dict[str, Any] = (
        dict(do_sample=True, temperature=work.temperature, top_k=0, top_p=1.0,
             num_return_sequences=work.n) if work.temperature > 0 else dict(do_sample=False))
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(work.outputs),
                             min_new_tokens=max(work.outputs), pad_token_id=pad_id, **sampling)
    seconds = time.perf_counter() - t0
    if out.shape[0] != len(work.prompts) * work.n or out.shape[1] != longest + max(work.outputs):
        raise RuntimeError(f"transformers returned {tuple(out.shape)}")
    return seconds


def transformers_main(model_path: str, dtype: str, threads: int, vocab: int, small: bool) -> None:
    """Serve workload names read from stdin, one JSON line of seconds each (model loaded once)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path,
                                                              dtype=getattr(torch, dtype))
    model.eval()
    hf_generate(model, Workload("warmup", [[5, 6, 7, 8]] * 2, [2, 2]), 0)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        work = workload(line.strip(), vocab, small)
        print(json.dumps({"seconds": hf_generate(model, work, 0),
                          "tokens": work.output_tokens}), flush=True)


# ------------------------------------------------------------------- the floor process


def linear_shapes(config: dict[str, Any]) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """(in, out) of each projection of one layer, of the LM head, and the layer count."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    layer = [(hidden, (heads + 2 * kv) * head_dim), (heads * head_dim, hidden),
             (hidden, 2 * inter), (inter, hidden)]
    return layer, (hidden, config["vocab_size"]), config["num_hidden_layers"]


def _gemms(batch: int, k: int, n: int,
           dtype: Any) -> list[tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]]:
    """torch's CPU GEMMs of (batch x k) by an (n x k) weight, as (prepare, run) pairs: plain
    ``F.linear``, and oneDNN on a weight packed once (model/packed_linear.py) where torch
    has it."""
    import torch
    import torch.nn.functional as F

    from sglang_admin.model.packed_linear import packed_linear, packing_available

    gemms: list[tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]] = [
        (lambda w: w, F.linear)]
    if packing_available():
        gemms.append((lambda w: (torch.ops.mkldnn._reorder_linear_weight(w, batch), None),
                      packed_linear))
    return gemms


def matmul_seconds(batch: int, k: int, n: int, dtype: Any, reps: int) -> tuple[float, int]:
    """Best seconds of torch's fastest CPU GEMM of (batch x k) by an (n x k) weight, the
    weight hot in cache (the same one repeated), and which of ``_gemms`` it was."""
    import torch

    x = torch.randn(batch, k).to(dtype)
    w = (torch.randn(n, k) * 0.02).to(dtype)
    best, which = float("inf"), 0
    for i, (prepare, run) in enumerate(_gemms(batch, k, n, dtype)):
        weight = prepare(w)
        for _ in range(3):
            run(x, weight)
        for _ in range(reps):
            t0 = time.perf_counter()
            run(x, weight)
            seconds = time.perf_counter() - t0
            if seconds < best:
                best, which = seconds, i
    return best, which


def step_matmuls_seconds(shapes: list[tuple[int, int, int, int]], batch: int, dtype: Any,
                         reps: int) -> float:
    """Best seconds of one decode step's matmuls alone, run back to back as a step runs them:
    (k, n, count, gemm) per shape, each of the ``count`` weights a tensor of its own (so the
    weights stream from memory as in a step: a real model's do not fit in cache), through
    the GEMM ``_gemms`` index ``gemm``."""
    import torch

    plan = []
    for k, n, count, which in shapes:
        prepare, run = _gemms(batch, k, n, dtype)[which]
        x = torch.randn(batch, k).to(dtype)
        weights = [prepare((torch.randn(n, k) * 0.02).to(dtype)) for _ in range(count)]
        plan.append((x, run, weights))
    layers = max(len(w) for _, _, w in plan)
    order = [(x, run, w[i]) for i in range(layers) for x, run, w in plan if i < len(w)]
    best = float("inf")
    for _ in range(reps + 1):  # the first pass warms up
        t0 = time.perf_counter()
        for x, run, weight in order:
            run(x, weight)
        best = min(best, time.perf_counter() - t0)
    return best


def floor_main(model_path: str, dtype: str, threads: int, batch: int) -> None:
    """Print one JSON line: the matmul floor of a batch-``batch`` decode step (seconds), in
    a process of torch's default OpenMP settings (the floor is what torch reaches at best)."""
    import torch

    config = json.loads((Path(model_path) / "config.json").read_text())
    torch_dtype = getattr(torch, dtype)
    torch.set_num_threads(threads)  # torch's best use of the cores both sides get
    layer, head, layers = linear_shapes(config)
    reps = 20 if config["num_hidden_layers"] > 2 else 5
    per_shape = []
    hot_floor = 0.0
    flops = 0.0
    plan = []
    for (k, n), count in [*((s, layers) for s in layer), (head, 1)]:
        seconds, which = matmul_seconds(batch, k, n, torch_dtype, reps)
        f = 2.0 * batch * k * n
        per_shape.append({"k": k, "n": n, "count": count, "gflops": f / seconds / 1e9,
                          "gemm": ["F.linear", "packed"][which]})
        hot_floor += count * seconds
        flops += count * f
        plan.append((k, n, count, which))
    print(json.dumps({"floor_s": step_matmuls_seconds(plan, batch, torch_dtype, reps=5),
                      "hot_floor_s": hot_floor, "flops": flops, "matmuls": per_shape}))


def step_main(model_path: str, dtype: str, server_args: list[str], batch: int,
              steps: int) -> None:
    """Print one JSON line: our batch-``batch`` decode step (seconds), with the lanes and
    threads the worker's flags give a rank on these cores (run under the ranks' OpenMP
    settings: the caller passes rank_openmp_environment)."""
    import torch

    from sglang_admin.cli import build_parser
    from sglang_admin.config import ServerArgs
    from sglang_admin.model.runner import ModelRunner
    from tools.bench_decode import time_decode

    ns = build_parser().parse_args(["serve", *server_args])
    args = ServerArgs(dp_size=ns.dp_size, torch_threads=ns.torch_threads, cpu_lanes=ns.cpu_lanes)
    torch.set_num_threads(args.rank_threads)
    context = 48
    runner = ModelRunner(model_path, device="cpu", dtype=dtype, max_running_requests=batch,
                         max_total_tokens=batch * (context + steps + 16) + 64,
                         lanes=args.rank_lanes, attention_backend=ns.attention_backend)
    times = time_decode(runner, batch, context, steps)
    print(json.dumps({"step_s": min(times), "step_median_s": statistics.median(times),
                      "lanes": runner.lanes, "threads": torch.get_num_threads()}))


def measure_floor(path: Path, dtype: str, threads: int, ns: argparse.Namespace) -> dict[str, Any]:
    """The shape's matmul floor and our decode step, each in a child process of its own,
    alternated ``ns.floor_rounds`` times (floor, step, floor, step, ...): the best of each,
    so a burst of load on one side does not decide the ratio alone."""
    floors = []
    steps = []
    for _ in range(ns.floor_rounds):
        floors.append(_run_child("--role", "floor", "--model-path", str(path), "--dtype-one",
                                 dtype, "--threads", str(threads)))
        steps.append(_run_child("--role", "step", "--model-path", str(path), "--dtype-one", dtype,
                                "--steps", str(ns.floor_steps),
                                *(f"--server-arg={a}" for a in ns.server_arg),
                                env=rank_openmp_environment(dict(os.environ))))  # the ranks'
    floor = min(floors, key=lambda f: f["floor_s"])
    step = min(steps, key=lambda s: s["step_s"])
    rounds = {"floor_rounds_s": [f["floor_s"] for f in floors],
              "step_rounds_s": [s["step_s"] for s in steps]}
    return floor | step | rounds


# ------------------------------------------------------------------------ the driver


@dataclass
class Cell:
    """One row of the table."""

    shape: str
    dtype: str
    workload: str
    served: list[float] = field(default_factory=list)  # tok/s per round
    transformers: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ratio(self) -> float:
        return max(self.served) / max(self.transformers) if self.served and self.transformers \
            else 0.0


def _run_child(*args: str, timeout: float = 7200,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{args[1]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class TransformersProc:
    """The persistent transformers process of one (checkpoint, dtype)."""

    def __init__(self, model_path: Path, dtype: str, threads: int, vocab: int, small: bool):
        cmd = [sys.executable, __file__, "--role", "transformers", "--model-path", str(model_path),
               "--dtype-one", dtype, "--threads", str(threads), "--vocab", str(vocab)]
        self.proc = subprocess.Popen(cmd + (["--small"] if small else []), cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.threads = int(self._read()["threads"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the transformers process exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, name: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True).stdout.strip() or "?"
    except OSError:
        return "?"


def run_matrix(ns: argparse.Namespace) -> dict[str, Any]:
    """Every (shape, dtype): a worker, a transformers process, the workloads' rounds, the floor."""
    from tests.conftest import free_port, start_server

    cores = sorted(os.sched_getaffinity(0))
    if ns.cores:
        cores = cores[: ns.cores]
        os.sched_setaffinity(0, cores)  # every child (worker, client, transformers) inherits
    threads = len(cores)
    import torch

    print(f"bench_matrix: commit {_commit()}, torch {torch.__version__}, {threads} cores "
          f"(both sides), load average {os.getloadavg()[0]:.2f}; {ns.rounds} alternating "
          f"round(s), best counts; worker flags {ns.server_arg or '(defaults)'}", flush=True)
    cells: list[Cell] = []
    floors: dict[tuple[str, str], dict[str, Any]] = {}
    for shape in ns.shapes:
        path = checkpoint(shape, Path(ns.cache_dir))
        vocab = SHAPES[shape][1]["vocab_size"]
        for dtype in ns.dtypes:
            tmp = Path(tempfile.mkdtemp(prefix="bench-matrix-"))
            srv = start_server(tmp, "--model-path", str(path), "--dtype", dtype,
                               *ns.server_arg, port=free_port())
            hf = None
            try:
                hf = TransformersProc(path, dtype, threads, vocab, ns.small)
                for name in ns.workloads:
                    cell = Cell(shape, dtype, name)
                    cells.append(cell)
                    try:
                        for _ in range(ns.rounds):
                            s = _run_child("--role", "client", "--target", srv.target,
                                           "--workload", name, "--vocab", str(vocab),
                                           *(["--small"] if ns.small else []))
                            t = hf.run(name)
                            if int(s["tokens"]) != int(t["tokens"]):
                                raise RuntimeError(f"served {s['tokens']} tokens, "
                                                   f"expected {t['tokens']}")
                            cell.served.append(s["tokens"] / s["seconds"])
                            cell.transformers.append(t["tokens"] / t["seconds"])
                        print(f"  {shape} {dtype} {name}: served {cell.served} transformers "
                              f"{cell.transformers} -> {cell.ratio:.2f}x", flush=True)
                    except Exception as exc:  # one cell's failure leaves the others
                        cell.error = str(exc).splitlines()[0][:200]
                        print(f"  {shape} {dtype} {name}: error {exc}", flush=True)
            finally:
                if hf is not None:
                    hf.close()
                srv.stop()
            try:
                floors[(shape, dtype)] = measure_floor(path, dtype, threads, ns)
                f = floors[(shape, dtype)]
                print(f"  {shape} {dtype} decode step at batch 32: {f['step_s'] * 1e3:.1f} ms "
                      f"({f['lanes']} lane(s) x {f['threads']} thread(s)), matmul floor "
                      f"{f['floor_s'] * 1e3:.1f} ms ({f['flops'] / 1e9:.2f} GFLOP at "
                      f"{f['flops'] / f['floor_s'] / 1e9:.0f} GFLOP/s, {threads} threads; "
                      f"weights in cache: {f['hot_floor_s'] * 1e3:.1f} ms; rounds: step "
                      f"{' '.join(f'{x * 1e3:.1f}' for x in f['step_rounds_s'])}, floor "
                      f"{' '.join(f'{x * 1e3:.1f}' for x in f['floor_rounds_s'])} ms)",
                      flush=True)
            except Exception as exc:
                floors[(shape, dtype)] = {"error": str(exc).splitlines()[0][:200]}
                print(f"  {shape} {dtype} floor: error {exc}", flush=True)
    print()
    print(format_table(cells, floors))
    return {"cells": [vars(c) | {"ratio": c.ratio} for c in cells],
            "floors": {f"{s} {d}": v for (s, d), v in floors.items()}, "cores": threads,
            "commit": _commit()}


def format_table(cells: list[Cell], floors: dict[tuple[str, str], dict[str, Any]]) -> str:
    """The markdown table: one row per cell, the shape's step / floor on each row."""
    lines = ["| shape | dtype | workload | served tok/s | transformers tok/s | ratio | "
             "step / floor (batch 32) |", "|---|---|---|---|---|---|---|"]
    for c in cells:
        f = floors.get((c.shape, c.dtype), {})
        floor = (f"{f['step_s'] * 1e3:.1f} / {f['floor_s'] * 1e3:.1f} ms = "
                 f"{f['step_s'] / f['floor_s']:.2f}x" if "step_s" in f else f.get("error", "-"))
        if c.error:
            lines.append(f"| {c.shape} | {c.dtype} | {c.workload} | error: {c.error} | | | "
                         f"{floor} |")
            continue
        lines.append(f"| {c.shape} | {c.dtype} | {c.workload} | {max(c.served):.1f} | "
                     f"{max(c.transformers):.1f} | {c.ratio:.2f}x | {floor} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a couple of minutes: smollm2-135m, bfloat16, the small chat workload, "
                        "1 round (flags given explicitly still apply)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                   help=f"default {' '.join(DEFAULT_SHAPES)}")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None)
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3)")
    p.add_argument("--small", action="store_true", help="small versions of the workloads")
    p.add_argument("--cores", type=int, default=0,
                   help="cores both sides may use (default: all this process may use)")
    p.add_argument("--floor-steps", type=int, default=8, help="timed decode steps of ours")
    p.add_argument("--floor-rounds", type=int, default=2,
                   help="floor and step measured alternately this many times, best of each")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "sglang_admin" /
                                              "bench-shapes"))
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra worker flag (repeatable), e.g. --server-arg=--torch-threads=2")
    p.add_argument("--json", default=None, help="also write the results to this file")
    # the child processes
    p.add_argument("--role", choices=["client", "transformers", "floor", "step"],
                   help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    p.add_argument("--dtype-one", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.role == "client":
        work = workload(ns.workload, ns.vocab, ns.small)
        print(json.dumps(asyncio.run(drive(ns.target, work))))
        return 0
    if ns.role == "transformers":
        transformers_main(ns.model_path, ns.dtype_one, ns.threads, ns.vocab, ns.small)
        return 0
    if ns.role == "floor":
        floor_main(ns.model_path, ns.dtype_one, ns.threads, 32)
        return 0
    if ns.role == "step":
        step_main(ns.model_path, ns.dtype_one, ns.server_arg, 32, ns.steps)
        return 0
    if ns.quick:
        ns.floor_rounds = 1
        ns.shapes = ns.shapes or ["smollm2-135m"]
        ns.dtypes = ns.dtypes or ["bfloat16"]
        ns.workloads = ns.workloads or ["chat"]
        ns.rounds = ns.rounds or 1
        ns.small = True
        ns.floor_steps = min(ns.floor_steps, 4)
    ns.shapes = ns.shapes or DEFAULT_SHAPES
    ns.dtypes = ns.dtypes or DTYPES
    ns.workloads = ns.workloads or WORKLOADS
    ns.rounds = ns.rounds or 3
    result = run_matrix(ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1))
    return 0 if not any(c["error"] for c in result["cells"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
