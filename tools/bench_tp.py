"""Decode step time at --tp-size 1 and 2 on CPU (gloo), and the all-reduce's share.

Runs the ModelRunner directly (no server): a random Llama checkpoint, a batch of prompts
prefilled, then decode steps timed; at tp 2 both ranks run the same steps, as the leader
and a follower do in a worker, and the row-parallel all-reduces are timed on rank 0.
Usage: python -m tools.bench_tp [--hidden 512] [--layers 8] [--batch 8] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def build(path: Path, hidden: int, layers: int) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
        max_position_embeddings=1024)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def run(tp_rank: int, tp_size: int, port: int, path: str, opts: argparse.Namespace,
        out: dict) -> None:
    from sglang_admin.messages import SamplingParams
    from sglang_admin.model import tensor_parallel as tpm
    from sglang_admin.model.runner import ModelRunner, SeqInput

    torch.set_num_threads(opts.threads)
    tp = None
    reduce_s = [0.0]
    if tp_size > 1:
        tp = tpm.join_tensor_parallel(f"tcp://127.0.0.1:{port}", tp_rank, tp_size,
                                      torch.device("cpu"))
        plain = tpm.TensorParallel._sum_output

        def timed(self, module, inputs, output):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            result = plain(self, module, inputs, output)
            reduce_s[0] += time.perf_counter() - t0
            return result

        tpm.TensorParallel._sum_output = timed  # type: ignore[method-assign]
    runner = ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=8192,
                         attention_backend="torch_native", tensor_parallel=tp)
    prompt_len, params = 64, SamplingParams()
    seqs = []
    for row in range(opts.batch):
        prompt = [(row * 7 + i) % 4000 + 2 for i in range(prompt_len)]
        slots = list(range(1 + row * 512, 1 + row * 512 + prompt_len))
        seqs.append(SeqInput(row, 0, prompt, 0, slots, params, prompt, []))
    outs = runner.forward_step(seqs)
    times = []
    for step in range(opts.steps):
        pos = prompt_len + step
        seqs = [SeqInput(row, pos, [o.token_id], pos, [1 + row * 512 + pos], params, [], [])
                for row, o in enumerate(outs)]
        if tp is not None:
            tp.barrier()
        reduce_s[0] = 0.0
        t0 = time.perf_counter()
        outs = runner.forward_step(seqs)
        times.append((time.perf_counter() - t0, reduce_s[0]))
    if tp_rank == 0:
        out["step_ms"] = statistics.median(t for t, _ in times) * 1e3
        out["reduce_ms"] = statistics.median(r for _, r in times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args()
    from sglang_admin.client.testing import free_port

    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), opts.hidden, opts.layers)
        manager = mp.Manager()
        for tp_size in (1, 2):
            out = manager.dict()
            port = free_port()
            procs = [mp.get_context("spawn").Process(
                target=run, args=(r, tp_size, port, tmp, opts, out)) for r in range(tp_size)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            share = out["reduce_ms"] / out["step_ms"] if tp_size > 1 else 0.0
            print(f"tp {tp_size}: decode step {out['step_ms']:.2f} ms (batch {opts.batch}, "
                  f"hidden {opts.hidden}, {opts.layers} layers, {opts.threads} thread/rank); "
                  f"all-reduce {out['reduce_ms']:.2f} ms ({share:.0%})")


if __name__ == "__main__":
    main()
