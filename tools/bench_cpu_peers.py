#!/usr/bin/env python
"""Ours (served) against llama.cpp (and vLLM-CPU when installed) on the same GGUF file and
threads, side by side in one run.

- **ours**: ``python -m sglang_admin serve --model-path FILE`` (weights kept quantized, the
  default for a GGUF file; ``--server-arg`` adds flags), driven by a gRPC client in a
  process of its own;
- **llama.cpp**: llama-cpp-python's raw API in a process of its own (the ``bench`` extra:
  ``pip install '.[bench]'``, built from its sdist; or any Python that imports
  ``llama_cpp`` and numpy, ``--llama-python``, e.g. a venv of its own), ``n_threads`` =
  ``--threads``; the batched rows put every sequence in one ``llama_batch``, as
  llama-server's slots do;
- **vLLM-CPU**: ``vllm`` offline, bfloat16, on the same file's Hugging Face conversion (the
  directory our dequantizing load reads: vLLM 0.32 takes no GGUF path on its own), when a
  Python with it is given (``--vllm-python``; optional, skipped otherwise with a line
  saying so);
- **ngram** (``--engines ...,ngram``): ours again, a second worker started with
  ``--speculative-algorithm NGRAM`` (its other flags as ours), on the batch-1 workload only:
  the batch-1 rows with speculative decoding on, beside the rows with it off.

Workloads (greedy, ignore EOS): batch 1 (a 32-token prompt, 128 new tokens: time to first
token and decode tok/s), chat 32 x 64 (32 prompts of 40-100 tokens at once, 64 new tokens
each: tok/s), and one 2048-token prompt's time to first token. Rounds alternate engines;
the best round of each counts. Printed: each figure, ours / theirs, and the batch-1 floor:
the weight bytes a decode token reads (the quantized projections and LM head) over this
machine's read bandwidth (measured here: sums over an array of those bytes, read again and
again as decode reads its weights, and over one 4x that size, past the caches), as tok/s. Memory:
our server's resident set (its processes, peak) and weight bytes held, llama.cpp's process
peak resident set and model size.

Usage: python tools/bench_cpu_peers.py [--model-path FILE] [--threads 2] [--rounds 2]
       [--llama-python /venv/bin/python] [--server-arg=--flag ...] [--json]
       [--workloads b1,chat,long] [--engines ours,llama.cpp,vllm,ngram]
(``--workloads chat,long --engines ours,vllm``: the batched comparison alone; the batch-1
floor lines need ``b1``.)
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

B1_PROMPT, B1_NEW = 32, 128
CHAT_N, CHAT_NEW = 32, 64
LONG_PROMPT = 2048


def workloads(vocab: int) -> dict[str, list[list[int]]]:
    """The prompts of each workload (random token ids past the first 100, fixed seed)."""
    rng = random.Random(53)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    return {"b1": [prompt(B1_PROMPT)],
            "chat": [prompt(rng.randrange(40, 101)) for _ in range(CHAT_N)],
            "long": [prompt(LONG_PROMPT)]}


# ------------------------------------------------------------------ ours: the client process


async def _ours(target: str, vocab: int, which: set[str]) -> dict[str, float]:
    import grpc.aio

    from sglang_admin.pb import common_pb2 as pb
    from sglang_admin.pb import common_pb2_grpc as pb_grpc

    work = workloads(vocab)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)

        async def one(i: int, ids: list[int], n: int) -> tuple[float, float, int]:
            """(first token s, last token s, tokens) from the call's start."""
            req = pb.GenerateRequest(
                request_id=f"peer-{i}-{time.monotonic_ns()}",
                tokenized=pb.TokenizedInput(input_ids=ids),
                sampling_params=pb.SamplingParams(max_new_tokens=n, ignore_eos=True,
                                                  temperature=0.0),
                stream=True)
            t0 = time.perf_counter()
            first = last = 0.0
            got = 0
            async for resp in stub.Generate(req, timeout=900):
                if resp.HasField("chunk") and resp.chunk.token_ids:
                    now = time.perf_counter() - t0
                    first = first or now
                    last = now
                    got += len(resp.chunk.token_ids)
            return first, last, got

        async def flush() -> None:
            await stub.FlushCache(pb.FlushCacheRequest(timeout_s=60), timeout=120)

        await one(-1, work["b1"][0][:8], 4)  # warm
        out: dict[str, float] = {}
        if "b1" in which:
            await flush()
            first, last, got = await one(0, work["b1"][0], B1_NEW)
            out.update(b1_ttft_ms=first * 1e3, b1_decode_tok_s=(got - 1) / (last - first))
        if "chat" in which:
            await flush()
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(i, p, CHAT_NEW)
                                         for i, p in enumerate(work["chat"])))
            out["chat_tok_s"] = sum(r[2] for r in res) / (time.perf_counter() - t0)
        if "long" in which:
            await flush()
            first, _, _ = await one(1, work["long"][0], 1)
            out["long_ttft_ms"] = first * 1e3
    return out


# ------------------------------------------------------------------ llama.cpp's process


def _llama_cpp(model_path: str, threads: int, vocab: int, extra_bufts: bool,
               which: set[str]) -> dict[str, float]:
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    # llama.cpp's extra buffer types (AMX, weight repacking); its AMX matmul crashed
    # (SIGSEGV in ggml_backend_amx_mul_mat) on this VM's AMX CPU: off unless asked for
    mparams.use_extra_bufts = extra_bufts
    model = L.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {model_path}")
    cparams = L.llama_context_default_params()
    cparams.n_ctx = 8192
    cparams.n_batch = cparams.n_ubatch = 2048
    cparams.n_seq_max = CHAT_N
    # one KV pool shared by the sequences, as llama-server's slots (per sequence, each
    # would get n_ctx / n_seq_max = 256 cells, too few for the 2048-token prompt)
    cparams.kv_unified = True
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cparams)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(4096, 0, 1)
    mem = L.llama_get_memory(ctx)

    def decode(items: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """items: (token, position, sequence, wants logits), in chunks of the batch size;
        the greedy next token of each sequence that wanted logits."""
        nxt: dict[int, int] = {}
        for start in range(0, len(items), 2048):
            chunk = items[start:start + 2048]
            batch.n_tokens = len(chunk)
            for j, (tok, pos, seq, logits) in enumerate(chunk):
                batch.token[j] = tok
                batch.pos[j] = pos
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seq
                batch.logits[j] = logits
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for j, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    row = L.llama_get_logits_ith(ctx, j)
                    nxt[seq] = int(np.argmax(np.ctypeslib.as_array(row, shape=(n_vocab,))))
        return nxt

    def generate(prompts: list[list[int]], n_new: int) -> tuple[float, float, int]:
        """Greedy tokens for every prompt at once: (first token s, last token s, tokens)."""
        L.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        nxt = decode([(tok, pos, s, pos == len(p) - 1)
                      for s, p in enumerate(prompts) for pos, tok in enumerate(p)])
        first = time.perf_counter() - t0
        got = len(prompts)
        lengths = [len(p) for p in prompts]
        for step in range(1, n_new):
            nxt = decode([(nxt[s], lengths[s] + step - 1, s, True)
                          for s in range(len(prompts))])
            got += len(prompts)
        return first, time.perf_counter() - t0, got

    work = workloads(vocab)
    generate([work["b1"][0][:8]], 4)  # warm
    out: dict[str, float] = {}
    if "b1" in which:
        first, last, got = generate(work["b1"], B1_NEW)
        out.update(b1_ttft_ms=first * 1e3, b1_decode_tok_s=(got - 1) / (last - first))
    if "chat" in which:
        t0 = time.perf_counter()
        _, _, got = generate(work["chat"], CHAT_NEW)
        out["chat_tok_s"] = got / (time.perf_counter() - t0)
    if "long" in which:
        first, _, _ = generate(work["long"], 1)
        out["long_ttft_ms"] = first * 1e3
    import resource

    out["mem_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["mem_weights_mib"] = L.llama_model_size(model) / 2**20
    return out


# ------------------------------------------------------------------ vLLM (optional)


def _vllm(model_path: str, threads: int, vocab: int, which: set[str]) -> dict[str, float]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model_path, dtype="bfloat16", max_model_len=4096)
    work = workloads(vocab)

    def run(prompts: list[list[int]], n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t0

    run([work["b1"][0][:8]], 4)
    out: dict[str, float] = {}
    if "b1" in which:
        ttft = run(work["b1"], 1)
        total = run(work["b1"], B1_NEW)
        out.update(b1_ttft_ms=ttft * 1e3, b1_decode_tok_s=(B1_NEW - 1) / (total - ttft))
    if "chat" in which:
        out["chat_tok_s"] = CHAT_N * CHAT_NEW / run(work["chat"], CHAT_NEW)
    if "long" in which:
        out["long_ttft_ms"] = run(work["long"], 1) * 1e3
    return out


# ------------------------------------------------------------------ the driver


def read_bandwidth_gb_s(nbytes: int = 1 << 30) -> float:
    """This machine's read bandwidth: the best of 5 sums over an array of ``nbytes`` (torch,
    its threads; the first sum warms it, as a decode's earlier tokens warm its weights)."""
    import torch

    data = torch.ones(max(nbytes // 4, 1 << 16), dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.numel() * 4 / best / 1e9


def decode_bytes(model_path: str) -> tuple[int, int]:
    """(bytes of weights a batch-1 decode token reads with the weights kept quantized: the
    kept projections and LM head (the quantized store's), the norms' few bytes aside;
    bytes of weights the model holds)."""
    import torch

    from sglang_admin.model.gguf import ensure_converted
    from sglang_admin.model.runner import ModelRunner

    runner = ModelRunner(ensure_converted(model_path), device="cpu", max_total_tokens=256,
                         max_running_requests=1, quantization="gguf")
    del torch
    return runner.model.quant.quantized_bytes(), runner.model.weight_bytes()


def peak_rss_mib(pids: list[int]) -> float:
    """The sum of the processes' peak resident sets (VmHWM), MiB."""
    total = 0.0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


def _child(mode: str, *args: str, python: str = sys.executable) -> dict:
    out = subprocess.run([python, __file__, "--child", mode, *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    # the last JSON line (vLLM logs its shutdown to stdout after it)
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="", help="a .gguf file (default: smollm2's Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--llama-python", default=sys.executable,
                    help="a Python that imports llama_cpp (e.g. a venv of its own)")
    ap.add_argument("--vllm-python", default=sys.executable,
                    help="a Python that imports vllm (vLLM-CPU wants a venv of its own)")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="llama.cpp's AMX / repacked weight buffers (off: its AMX matmul "
                    "crashed on this VM)")
    ap.add_argument("--workloads", default="b1,chat,long",
                    help="comma-separated: b1, chat, long (default: all three)")
    ap.add_argument("--engines", default="ours,llama.cpp,vllm",
                    help="comma-separated: ours, llama.cpp, vllm, ngram (ours always runs; "
                    "ngram: ours with --speculative-algorithm NGRAM, batch 1 only)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        mode, *rest = ns.child
        which = set(ns.workloads.split(","))
        if mode == "ours":
            print(json.dumps(asyncio.run(_ours(rest[0], int(rest[1]), which))))
        elif mode == "llama":
            print(json.dumps(_llama_cpp(rest[0], int(rest[1]), int(rest[2]), rest[3] == "1",
                                        which)))
        elif mode == "vllm":
            print(json.dumps(_vllm(rest[0], int(rest[1]), int(rest[2]), which)))
        return 0
    which = set(ns.workloads.split(","))
    unknown = which - {"b1", "chat", "long"}
    if unknown:
        ap.error(f"--workloads: unknown {sorted(unknown)} (b1, chat, long)")
    wanted = set(ns.engines.split(",")) | {"ours"}
    unknown = wanted - {"ours", "llama.cpp", "vllm", "ngram"}
    if unknown:
        ap.error(f"--engines: unknown {sorted(unknown)} (ours, llama.cpp, vllm, ngram)")
    if "ngram" in wanted and "b1" not in which:
        ap.error("--engines ngram runs the batch-1 workload: add b1 to --workloads")
    from sglang_admin.model.gguf import open_gguf, packaged_model

    path = ns.model_path or packaged_model("smollm2")
    vocab = len(open_gguf(path).get("tokenizer.ggml.tokens"))
    engines: dict[str, list[dict[str, float]]] = {"ours": [], "llama.cpp": []}
    probe = subprocess.run([ns.llama_python, "-c", "import llama_cpp, numpy; "
                            "print(llama_cpp.__version__)"], capture_output=True, text=True)
    if "llama.cpp" not in wanted:
        print("llama.cpp: not asked for (--engines)")
        engines.pop("llama.cpp")
    elif probe.returncode != 0:
        print(f"llama.cpp: {ns.llama_python} does not import llama_cpp "
              f"({probe.stderr.strip().splitlines()[-1:]}); pip install '.[bench]'")
        engines.pop("llama.cpp")
    else:
        print(f"llama.cpp: llama-cpp-python {probe.stdout.strip()} ({ns.llama_python})")
    probe = subprocess.run([ns.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                           capture_output=True, text=True)
    if "vllm" not in wanted:
        print("vLLM-CPU: not asked for (--engines)")
    elif probe.returncode == 0:
        engines["vllm"] = []
        print(f"vLLM-CPU: vllm {probe.stdout.strip().splitlines()[-1]} ({ns.vllm_python})")
    else:
        print(f"vLLM-CPU: {ns.vllm_python} does not import vllm, skipped")
    from sglang_admin.client.testing import start_server
    from sglang_admin.model.gguf import ensure_converted

    tmp = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    srv = start_server(tmp, "--model-path", path, "--torch-threads", str(ns.threads),
                       "--cpu-lanes", "1", *ns.server_arg)
    ngram = None
    if "ngram" in wanted:
        engines["ngram"] = []
        ngram = start_server(tmp, "--model-path", path, "--torch-threads",
                             str(ns.threads), "--cpu-lanes", "1", *ns.server_arg,
                             "--speculative-algorithm", "NGRAM")
    try:
        for r in range(ns.rounds):
            wl = ("--workloads", ns.workloads)
            engines["ours"].append(_child("ours", srv.target, str(vocab), *wl))
            if ngram is not None:
                engines["ngram"].append(_child("ours", ngram.target, str(vocab),
                                               "--workloads", "b1"))
            if "llama.cpp" in engines:
                engines["llama.cpp"].append(_child("llama", path, str(ns.threads), str(vocab),
                                                   str(int(ns.llama_extra_bufts)), *wl,
                                                   python=ns.llama_python))
            if "vllm" in engines:
                engines["vllm"].append(_child("vllm", ensure_converted(path), str(ns.threads),
                                              str(vocab), *wl, python=ns.vllm_python))
            print(f"round {r + 1}: " + "; ".join(
                f"{name} " + ", ".join(f"{k} {v:.1f}" for k, v in runs[-1].items())
                for name, runs in engines.items()), flush=True)
        ours_rss = peak_rss_mib([srv.proc.pid, *srv.children()])
    finally:
        srv.stop()
        if ngram is not None:
            ngram.stop()
    best: dict[str, dict[str, float]] = {}
    memory: dict[str, dict[str, float]] = {}
    for name, runs in engines.items():
        best[name] = {k: (min if k.endswith("_ms") else max)(run[k] for run in runs)
                      for k in runs[0] if not k.startswith("mem_")}
        if any(k.startswith("mem_") for k in runs[0]):  # vLLM's child reports none
            memory[name] = {k[4:]: max(run[k] for run in runs) for k in runs[0]
                            if k.startswith("mem_")}
    keys = list(best["ours"])
    print(f"\n{'(best of ' + str(ns.rounds) + ')':<22}" + "".join(f"{k:>18}" for k in keys))
    def row(name: str, figures: dict[str, float]) -> str:
        return f"{name:<22}" + "".join(f"{figures[k]:>18.1f}" if k in figures
                                       else f"{'':>18}" for k in keys)

    for name, figures in best.items():
        print(row(name, figures))
    for name in best:
        if name in ("ours", "ngram"):
            continue
        ratios = [best[name][k] / best["ours"][k] if k.endswith("_ms")
                  else best["ours"][k] / best[name][k] for k in keys]
        print(f"{'ours / ' + name:<22}" + "".join(f"{x:>17.2f}x" for x in ratios))
        if "ngram" in best:  # the batch-1 figures with speculative decoding on
            ratios_ngram = {k: best[name][k] / v if k.endswith("_ms") else v / best[name][k]
                            for k, v in best["ngram"].items()}
            print(f"{'ngram / ' + name:<22}" + "".join(
                f"{ratios_ngram[k]:>17.2f}x" if k in ratios_ngram else f"{'':>18}"
                for k in keys))
    if "ngram" in best:
        print(f"{'ngram / ours':<22}" + "".join(
            (f"{best['ours'][k] / best['ngram'][k]:>17.2f}x" if k.endswith("_ms")
             else f"{best['ngram'][k] / best['ours'][k]:>17.2f}x") if k in best["ngram"]
            else f"{'':>18}" for k in keys))
    nbytes, held = decode_bytes(path)
    # an array of the weights' size read again and again, as decode reads them (what of it
    # the caches hold, they hold of the weights too); and one 4x that, past the caches
    bandwidth = read_bandwidth_gb_s(nbytes)
    cold = read_bandwidth_gb_s(4 * nbytes)
    memory["ours"] = {"peak_rss_mib": ours_rss, "weights_mib": held / 2**20}
    print("\nmemory: " + "; ".join(f"{name} peak resident {m['peak_rss_mib']:.0f} MiB, "
                                    f"weights {m['weights_mib']:.1f} MiB"
                                    for name, m in memory.items()))
    if "b1" not in which:
        if ns.json:
            print(json.dumps({"best": best, "memory": memory, "threads": ns.threads}))
        return 0
    floor = bandwidth * 1e9 / nbytes
    ours_b1 = best["ours"]["b1_decode_tok_s"]
    print(f"\nbatch-1 floor: {nbytes / 1e6:.1f} MB of weights a token / {bandwidth:.1f} GB/s "
          f"read (an array of that size) = {floor:.0f} tok/s; ours at {ours_b1:.1f} (a token "
          f"takes {floor / ours_b1:.2f}x the floor's time); past the caches ({cold:.1f} GB/s, "
          f"an array 4x that size): {cold * 1e9 / nbytes:.0f} tok/s, ours at "
          f"{cold * 1e9 / nbytes / ours_b1:.2f}x")
    if "llama.cpp" in memory:  # its model size over the same bandwidth
        theirs = bandwidth * 1e9 / (memory["llama.cpp"]["weights_mib"] * 2**20)
        print(f"llama.cpp's own floor: {memory['llama.cpp']['weights_mib'] * 2**20 / 1e6:.1f} MB "
              f"a token = {theirs:.0f} tok/s; it at {best['llama.cpp']['b1_decode_tok_s']:.1f} "
              f"({theirs / best['llama.cpp']['b1_decode_tok_s']:.2f}x)")
    if ns.json:
        print(json.dumps({"best": best, "memory": memory, "floor_tok_s": floor,
                          "bandwidth_gb_s": bandwidth, "bandwidth_4x_gb_s": cold,
                          "decode_bytes": nbytes, "threads": ns.threads}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
