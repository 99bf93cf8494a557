"""Time one rank's decode step on a Qwen2.5-0.5B-shaped random model against the memory bound.

A decode step reads every weight once and each sequence's KV cache once, so on a GPU its
floor is (weight bytes + KV bytes read) / memory bandwidth. This builds a random checkpoint
of Qwen2.5-0.5B's shape (or a tiny one with ``--shape tiny`` for a CPU smoke run), admits
``batch`` requests with ``--context``-token prompts through the real scheduler and model
runner, and times the decode steps that follow (each step ends with the sampled tokens read
back to the host, so the timing covers the device work). One line per batch size:

    batch 64: step 3.10 ms (median of 32), bound 0.29 ms (1.37 GB at 4800 GB/s), 10.7x

Usage: python tools/bench_decode.py [--device cuda] [--dtype bfloat16] [--batch 1 64]
       [--context 512] [--steps 32] [--bandwidth-gbs N] [--shape qwen2.5-0.5b|smollm2-135m|tiny]
       [--threads N] [--lanes N] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_admin.messages import GenerateReq, SamplingParams  # noqa: E402
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.scheduler.rank.model_step import batch_inputs  # noqa: E402
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402

SHAPES: dict[str, dict[str, int | float | bool]] = {
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3,
                     "vocab_size": 49152, "tie_word_embeddings": True, "llama": True},
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2,
                     "vocab_size": 151936, "tie_word_embeddings": True},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
             "tie_word_embeddings": True},
}
# Peak memory bandwidth (GB/s) by device name, for the bound; --bandwidth-gbs overrides.
BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0}


def write_checkpoint(directory: Path, shape: dict, dtype: torch.dtype) -> None:
    """A random checkpoint (config.json + model.safetensors) of the given shape: Qwen2 (q/k/v
    biases), or Llama where the shape says ``llama``."""
    shape = dict(shape)
    llama = bool(shape.pop("llama", False))
    hidden, inter = int(shape["hidden_size"]), int(shape["intermediate_size"])
    heads, kv_heads = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    head_dim = hidden // heads
    arch, model_type = ("LlamaForCausalLM", "llama") if llama else ("Qwen2ForCausalLM", "qwen2")
    config = {"architectures": [arch], "model_type": model_type, **shape,
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 32768, "torch_dtype": str(dtype).split(".")[1],
              "bos_token_id": 0, "eos_token_id": 1}
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(int(shape["vocab_size"]), hidden),
               "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    for i in range(int(shape["num_hidden_layers"])):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.q_proj.bias": rand(heads * head_dim),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.k_proj.bias": rand(kv_heads * head_dim),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.bias": rand(kv_heads * head_dim),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        })
        if llama:  # no attention biases
            for name in ("q", "k", "v"):
                del tensors[p + f"self_attn.{name}_proj.bias"]
    if not shape.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = rand(int(shape["vocab_size"]), hidden)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))


def time_decode(runner: ModelRunner, batch_size: int, context: int, steps: int,
                profile: bool = False) -> list[float]:
    """Seconds of each of ``steps`` decode steps of ``batch_size`` sequences at ``context``;
    ``profile``: torch.profiler over the timed steps, its top ops printed."""
    info = runner.info
    sched = Scheduler(SchedulerConfig(
        token_capacity=runner.token_capacity, max_running_requests=runner.max_running_requests,
        max_prefill_tokens=8192, context_length=info.context_length,
        eos_token_ids=tuple(info.eos_token_ids)))
    gen = torch.Generator().manual_seed(batch_size)
    for i in range(batch_size):
        prompt = torch.randint(2, info.vocab_size, (context,), generator=gen).tolist()
        sched.add_request(GenerateReq(f"r{i}", prompt, SamplingParams(
            max_new_tokens=steps + 4, ignore_eos=True, temperature=0.0)))
    times: list[float] = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    while not sched.is_idle:
        batch = sched.schedule()
        if batch is None:
            continue
        timed = batch.is_decode and len(batch.spans) == batch_size
        if profile and timed and len(times) == 2:
            prof.__enter__()
        t0 = time.perf_counter()
        results = runner.forward_step(batch_inputs(batch))  # reads the tokens back: synchronous
        elapsed = time.perf_counter() - t0
        if timed:
            times.append(elapsed)
            if profile and len(times) == 2 + steps:
                prof.__exit__(None, None, None)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        sched.postprocess(batch, results)
    return times[2 : 2 + steps]  # the first decode steps warm up (allocator, kernels)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="peak memory bandwidth for the bound (default: by device name)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--lanes", type=int, default=1, help="the runner's CPU lanes")
    p.add_argument("--profile", action="store_true", help="torch.profiler's top ops")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    dtype = getattr(torch, ns.dtype)
    bandwidth = ns.bandwidth_gbs
    name = "cpu"
    if ns.device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(ns.device))
        if bandwidth is None:
            bandwidth = next((v for k, v in BANDWIDTH_GBS.items() if k in name), None)
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        write_checkpoint(Path(tmp), SHAPES[ns.shape], dtype)
        longest = ns.context + ns.steps + 8
        runner = ModelRunner(tmp, device=ns.device, dtype=ns.dtype,
                             max_running_requests=max(ns.batch),
                             max_total_tokens=max(ns.batch) * longest + 64, lanes=ns.lanes)
        cfg = runner.model.config
        kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        print(f"{ns.shape} ({runner.weight_bytes / 1e9:.2f} GB of {ns.dtype} weights) on "
              f"{name}, context {ns.context}, {ns.steps} timed steps per batch size")
        for b in ns.batch:
            times = time_decode(runner, b, ns.context, ns.steps, ns.profile)
            runner.reset()
            step = statistics.median(times)
            read = runner.weight_bytes + b * (ns.context + ns.steps // 2) * kv_per_token
            line = f"batch {b:3d}: step {step * 1e3:7.3f} ms (median of {len(times)})"
            if bandwidth:
                bound = read / (bandwidth * 1e9)
                line += (f", bound {bound * 1e3:.3f} ms ({read / 1e9:.2f} GB at "
                         f"{bandwidth:.0f} GB/s), {step / bound:.1f}x the bound")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
