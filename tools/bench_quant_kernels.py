#!/usr/bin/env python
"""Matmul kernels for weights kept quantized, side by side in one run, on a model's shapes.

Every decoder layer's projections (fused q/k/v, o, fused gate/up, down) with distinct
weights per layer (so the weights stream from memory as in a real step, not from cache),
plus the LM head, at batch 1 and batch 32 rows, bfloat16 activations, for:

- ``bf16``: dense bfloat16 ``F.linear``;
- ``bf16-packed``: dense bfloat16 through oneDNN with weights packed once (model/packed_linear.py,
  what a large model serves with today);
- ``int4-g32``: torch's ``_weight_int4pack_mm_for_cpu`` (4-bit, a scale and a zero per 32
  inputs: Q4_0 / Q4_1 / Q4_K's sub-blocks exactly);
- ``int8-ch``: torch's ``_weight_int8pack_mm`` (8-bit, one scale per output row);
- ``int8x32``: int8 with a scale per 32 inputs (GGUF's Q8_0 as stored) through
  ``_weight_int4pack_mm_for_cpu`` on two 4-bit halves of each value over the input
  repeated (model/quant/linear.py's ``QuantLinear`` above its few-row kernel's rows);
- ``gemv-int4`` / ``gemv-int8x32``: the few-row kernel of model/quant/gemv.py (AVX512_VNNI,
  our C) on the same two kinds, at any row count (the server takes it up to
  ``GEMV_MAX_ROWS`` rows), where the CPU has it;
- ``deq-int4``: the 4-bit weight dequantized to bfloat16 at each call, then the GEMM
  (dequantize-and-GEMM in torch ops);
- ``torchao-int8``: torchao's ``Int8WeightOnlyConfig`` on ``nn.Linear``s, where torchao
  imports (its int4 CPU layout, prototype ``Int4OpaqueTensor``, calls the same aten kernel
  as ``int4-g32``).

Ratios in brackets: ``bf16``'s time over the method's (above 1: faster).

``--model-path FILE.gguf``: instead, the in-process batch-1 decode step of that file kept
quantized (bfloat16; the real runner and scheduler, bench_decode.py's ``time_decode``),
with torch's kernels, the few-row kernel through the layer loop, and every layer in one C
call (model/quant/decode_step.py), rounds alternating: each round's
median step (wall) and the process's CPU time a step (what a busy machine's cores give).

Usage: python tools/bench_quant_kernels.py [--shape smollm2-135m] [--threads 2] [--rounds 5]
       [--model-path FILE.gguf [--steps 48]]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # hidden, intermediate, layers, q heads, kv heads, vocab
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936),
}


def layer_shapes(shape: str) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """(N, K) of one layer's projections, the LM head's, and the layer count."""
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    d = hidden // heads
    return ([(hidden + 2 * kv * d, hidden), (hidden, hidden), (2 * inter, hidden),
             (hidden, inter)], (vocab, hidden), layers)


def int4_weight(n: int, k: int, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A random 4-bit weight packed for ``_weight_int4pack_mm_for_cpu`` and its scales/zeros."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scales = torch.rand(k // group, n) * 0.01 + 0.001
    zeros = torch.randn(k // group, n) * 0.01
    return packed, torch.stack([scales, zeros], -1).to(torch.bfloat16).contiguous()


def dequant_int4(packed_q: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """bfloat16 [N, K] from 4-bit values [N, K/2] (two per byte) and scales/zeros."""
    n = packed_q.shape[0]
    lo = (packed_q & 0x0F).to(torch.bfloat16)
    hi = (packed_q >> 4).to(torch.bfloat16)
    q = torch.stack([lo, hi], -1).view(n, -1, group)
    s = sz[..., 0].t().unsqueeze(-1)
    z = sz[..., 1].t().unsqueeze(-1)
    return ((q - 8) * s + z).view(n, -1)


def build(method: str, n: int, k: int):  # noqa: ANN201 - a closure x -> y
    """A function computing x [M, K] -> [M, N] with one weight of ``method``."""
    if method == "bf16":
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        return lambda x: F.linear(x, w)
    if method == "bf16-packed":
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if method == "int4-g32":
        packed, sz = int4_weight(n, k)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    if method == "int8-ch":
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        s = torch.rand(n, dtype=torch.bfloat16) * 0.01
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, w, s)
    if method == "int8x32":
        import numpy as np

        from sglang_admin.model.quant.gguf_blocks import Int8Blocks
        from sglang_admin.model.quant.linear import QuantLinear

        rng = np.random.default_rng(n * 7 + k)
        blocks = Int8Blocks(rng.integers(-127, 128, (n, k), dtype=np.int8),
                            rng.uniform(1e-4, 1e-2, (n, k // 32)).astype(np.float32))
        return QuantLinear(blocks, torch.bfloat16, dense_copy=False)._int4
    if method in ("gemv-int4", "gemv-int8x32"):
        import numpy as np

        from sglang_admin.model.quant import gemv

        kernel = gemv.gemv_kernel()
        if kernel is None:
            raise RuntimeError("no AVX512_VNNI + AVX512_BF16 kernel on this CPU")
        rng = np.random.default_rng(n * 7 + k)
        if method == "gemv-int4":
            q = rng.integers(0, 16, (n, k), dtype=np.uint8)
            scale = torch.rand(n, k // 32) * 0.01 + 0.001
            w, s = gemv.pack_int4(q, scale, torch.randn(n, k // 32) * 0.01)
            return kernel.bind("int4", w, s, n)
        packed = gemv.pack_int8(rng.integers(-127, 128, (n, k), dtype=np.int8),
                                rng.uniform(1e-4, 1e-2, (n, k // 32)).astype(np.float16))
        assert packed is not None
        return kernel.bind("int8x32", *packed, n)
    if method == "deq-int4":
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        _, sz = int4_weight(n, k)
        return lambda x: F.linear(x, dequant_int4(q, sz, 32))
    if method in ("torchao-int4", "torchao-int8"):
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        config = (Int4WeightOnlyConfig(group_size=32, int4_packing_format="opaque")
                  if method == "torchao-int4" else Int8WeightOnlyConfig())
        quantize_(lin, config)
        return lin
    raise ValueError(method)


def sweep(fns: list, rows: int, k_of: list[int], rounds: int) -> float:
    """Best time (ms) of one pass over every weight at ``rows`` rows."""
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in set(k_of)}
    best = float("inf")
    with torch.inference_mode():
        for fn, k in zip(fns, k_of):  # warm
            fn(xs[k])
        for _ in range(rounds):
            t0 = time.perf_counter()
            for fn, k in zip(fns, k_of):
                fn(xs[k])
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def decode_step_ab(model_path: str, rounds: int, steps: int) -> None:
    """The batch-1 decode step of a kept GGUF model, alternating: torch's kernels, the
    few-row kernel through decode_bf16's layer loop, and every layer in one C call
    (model/quant/decode_step.py)."""
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import time_decode

    from sglang_admin.model.gguf import ensure_converted
    from sglang_admin.model.quant import decode_step, gemv, linear
    from sglang_admin.model.runner import ModelRunner

    runner = ModelRunner(ensure_converted(model_path), device="cpu", dtype="bfloat16",
                         max_total_tokens=1024, max_running_requests=2, quantization="gguf")
    on = linear.GEMV_MAX_ROWS
    print(f"{model_path}: {runner.model.quant.quantized_bytes() / 1e6:.1f} MB of weights a "
          f"token; few-row kernel {'built' if gemv.gemv_kernel() else 'not available'}; "
          f"{torch.get_num_threads()} threads, {steps} steps a round")
    real_step = decode_step.run
    modes = (("torch's kernels", 0, False), ("few-row kernel", on, False),
             ("+ C step", on, True))
    for r in range(rounds):
        for label, rows, c_step in modes:
            linear.GEMV_MAX_ROWS = rows
            decode_step.run = real_step if c_step else (lambda *a: None)
            cpu0 = time.process_time()
            times = time_decode(runner, 1, 32, steps)
            cpu = (time.process_time() - cpu0) / (steps + 5)  # + warm-up and prefill steps
            runner.reset()
            print(f"round {r + 1} {label:<16} step median {statistics.median(times) * 1e3:6.2f}"
                  f" ms, min {min(times) * 1e3:6.2f} ms; CPU a step {cpu * 1e3:6.2f} ms",
                  flush=True)
    linear.GEMV_MAX_ROWS = on
    decode_step.run = real_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,4,8,16,32", help="row counts (batch sizes)")
    ap.add_argument("--methods", default="bf16,bf16-packed,int4-g32,gemv-int4,int8-ch,"
                    "int8x32,gemv-int8x32,deq-int4,torchao-int8")
    ap.add_argument("--model-path", default="", help="a GGUF file: its decode step instead")
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model_path:
        decode_step_ab(args.model_path, args.rounds, args.steps)
        return
    per_layer, head, layers = layer_shapes(args.shape)
    print(f"{args.shape}: {layers} layers x {per_layer} (N, K) + LM head {head}; "
          f"{args.threads} threads, best of {args.rounds}, bfloat16 activations")
    rows_list = [int(r) for r in args.rows.split(",")]
    print("ms per pass over all layers' projections + the LM head, at each row count")
    print(f"{'method':<14}" + "".join(f"{'rows ' + str(r):>16}" for r in rows_list))
    base: list[float] = []
    for method in args.methods.split(","):
        try:
            fns = [build(method, n, k) for _ in range(layers) for n, k in per_layer]
            fns.append(build(method, *head))
        except Exception as exc:  # noqa: BLE001 - a kernel this torch or CPU lacks
            print(f"{method:<14} unavailable: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        ks = [k for _ in range(layers) for _, k in per_layer] + [head[1]]
        row = [sweep(fns, rows, ks, args.rounds) for rows in rows_list]
        if method == "bf16":
            base = row
        cells = [f"{t:7.2f} ({base[i] / t:4.2f}x)" if base else f"{t:16.2f}"
                 for i, t in enumerate(row)]
        print(f"{method:<14}" + "".join(f"{c:>16}" for c in cells))
        del fns


if __name__ == "__main__":
    main()
