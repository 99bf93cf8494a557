"""Our engine against transformers `generate` on the same checkpoint, side by side in one run.

Workloads (fixed seed):
- mixed: 64 requests, prompt lengths uniform in 16..256, output lengths uniform in 8..128,
  ignore_eos. Ours: the scheduler + model runner of one rank, driven in-process exactly as
  a rank drives them. Transformers: one left-padded batched greedy `generate` with
  max_new_tokens = the longest output; only the tokens each request asked for count.
- prefix: 32 requests sharing a 960-token prefix with distinct 64-token tails (16 output
  tokens each); transformers has no prefix cache, ours reuses the prefix.
- ttft (through a real server): time to first token of a request with a 960-token prefix,
  then of a second request with the same prefix and another tail, and its cached_tokens.

Both sides run in this process with the same torch thread count (--threads; default torch's
own), alternating --repeat times; the best run of each side counts.

Usage: python tools/bench_engine.py [--model-path DIR] [--skip-server] [--json] [--threads N]
       [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_admin.messages import GenerateReq, SamplingParams  # noqa: E402
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.scheduler.rank.model_step import batch_inputs  # noqa: E402
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from tools.workloads import Workload, mixed_workload, prefix_workload  # noqa: E402


def run_engine(runner: ModelRunner, work: Workload, max_running: int) -> tuple[float, list[list[int]]]:
    """Drive one rank's scheduler and runner in-process; returns (seconds, outputs)."""
    info = runner.info
    sched = Scheduler(
        SchedulerConfig(
            token_capacity=runner.token_capacity,
            max_running_requests=max_running,
            max_prefill_tokens=4096,
            context_length=info.context_length,
            eos_token_ids=tuple(info.eos_token_ids),
        )
    )
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(work.prompts, work.outputs)):
        sched.add_request(
            GenerateReq(f"r{i}", prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
        )
    while not sched.is_idle:
        batch = sched.schedule()
        if batch is None:
            continue
        seqs = batch_inputs(batch)  # exactly as the rank builds them
        results = runner.forward_step(seqs)
        for out in sched.postprocess(batch, results):
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    elapsed = time.perf_counter() - t0
    return elapsed, [outputs[f"r{i}"] for i in range(len(work.prompts))]


def run_transformers(model, work: Workload, pad_id: int) -> tuple[float, list[list[int]]]:
    """One left-padded batched greedy generate; counts only the tokens each asked for."""
    longest = max(len(p) for p in work.prompts)
    ids = torch.full((len(work.prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(work.prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max(work.outputs),
            min_new_tokens=max(work.outputs), do_sample=False, pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - t0
    gen = out[:, longest:].tolist()
    return elapsed, [g[:n] for g, n in zip(gen, work.outputs)]


def server_ttft(model_path: str | None) -> dict[str, float]:
    """TTFT of a 960-token-prefix request, then of a second one sharing the prefix."""
    import grpc

    from sglang_admin.client.testing import free_port, start_server
    from sglang_admin.pb import common_pb2 as pb

    tmp = Path(__import__("tempfile").mkdtemp(prefix="bench-engine-"))
    args = ["--model-path", model_path] if model_path else []
    srv = start_server(tmp, *args, port=free_port())
    try:
        stub = srv.stub()
        vocab = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size
        rng = random.Random(7)
        prefix = [rng.randrange(3, vocab) for _ in range(960)]

        def ttft(tail: list[int]) -> tuple[float, int]:
            req = pb.GenerateRequest(
                tokenized=pb.TokenizedInput(input_ids=prefix + tail),
                sampling_params=pb.SamplingParams(max_new_tokens=4, ignore_eos=True),
                stream=True,
            )
            t0 = time.perf_counter()
            first = None
            cached = 0
            for resp in stub.Generate(req, timeout=120):
                if first is None and resp.HasField("chunk") and resp.chunk.token_ids:
                    first = time.perf_counter() - t0
                    cached = resp.chunk.cached_tokens
            return first or 0.0, cached

        stub.FlushCache(pb.FlushCacheRequest(timeout_s=10), timeout=30)
        cold, _ = ttft([rng.randrange(3, vocab) for _ in range(64)])
        warm, cached = ttft([rng.randrange(3, vocab) for _ in range(64)])
        return {"ttft_cold_ms": cold * 1e3, "ttft_warm_ms": warm * 1e3,
                "ttft_ratio": warm / cold if cold else 0.0, "cached_tokens": cached}
    except grpc.RpcError as exc:
        return {"error": str(exc)}
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the embedded model")
    parser.add_argument("--skip-server", action="store_true", help="skip the TTFT measurement")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for both sides (default: torch's default)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs of each side, alternating; the best of each counts")
    ns = parser.parse_args(argv)

    import os

    import transformers

    if ns.threads:
        torch.set_num_threads(ns.threads)
    load_before = os.getloadavg()
    torch.manual_seed(0)
    runner = ModelRunner(ns.model_path, device="cpu", dtype="float32", max_running_requests=64)
    model_path = runner.info.model_path
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    hf.eval()
    vocab = runner.info.vocab_size
    pad = runner.info.pad_token_id if runner.info.pad_token_id is not None else 0
    print(f"model: {model_path} ({runner.info.architectures[0]}, vocab {vocab}), "
          f"torch threads {torch.get_num_threads()} (both sides), best of {ns.repeat} "
          f"alternating runs each; load average {load_before[0]:.2f}")
    results: dict[str, object] = {"model": model_path}
    rows = []
    for work in (mixed_workload(vocab), prefix_workload(vocab)):
        run_engine(runner, Workload("warmup", work.prompts[:4], [4] * 4), 64)
        ours_s = hf_s = float("inf")
        for _ in range(max(ns.repeat, 1)):  # alternate, so that both see the same load
            runner.reset()
            seconds, ours_out = run_engine(runner, work, 64)
            ours_s = min(ours_s, seconds)
            seconds, hf_out = run_transformers(hf, work, pad)
            hf_s = min(hf_s, seconds)
        same = sum(a == b for a, b in zip(ours_out, hf_out))
        ours_tps = work.output_tokens / ours_s
        hf_tps = work.output_tokens / hf_s
        rows.append((work.name, ours_tps, hf_tps, ours_tps / hf_tps, same, len(work.prompts)))
        results[work.name] = {
            "output_tokens": work.output_tokens, "ours_s": ours_s, "transformers_s": hf_s,
            "ours_tok_s": ours_tps, "transformers_tok_s": hf_tps, "ratio": ours_tps / hf_tps,
            "identical_outputs": same, "requests": len(work.prompts),
        }
    print(f"\n{'workload':<10}{'ours tok/s':>12}{'transformers tok/s':>20}{'ratio':>8}  identical")
    for name, ours, hf_tps, ratio, same, n in rows:
        target = "  (target >= 2.0x)" if name == "mixed" else ""
        print(f"{name:<10}{ours:>12.1f}{hf_tps:>20.1f}{ratio:>7.2f}x  {same}/{n}{target}")
    if not ns.skip_server:
        ttft = server_ttft(ns.model_path)
        results["ttft"] = ttft
        if "error" in ttft:
            print(f"\nttft: {ttft['error']}")
        else:
            print(
                f"\nTTFT through the server, 960-token shared prefix + 64-token tail:\n"
                f"  first request  {ttft['ttft_cold_ms']:8.1f} ms\n"
                f"  second request {ttft['ttft_warm_ms']:8.1f} ms  cached_tokens="
                f"{ttft['cached_tokens']}  ratio {ttft['ttft_ratio']:.2f}x (target <= 0.25x)"
            )
    if ns.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
