"""The CUDA attention path against torch's, on one device: equal outputs, and the time of each.

model/attention/choice.py picks, on CUDA, the Triton paged decode kernel (K/V read through the
slot table) and mask-free prefix prefill (SDPA's bottom-right causal bias); torch's path
gathers a padded copy of the K/V rows and masks. This builds both paths' metadata for the
same batch over the same random pool (a decode batch of mixed lengths, slots interleaved as
decode steps hand them out; then one prefill chunk after a cached prefix), checks that the
outputs agree, and times one layer's attention on each, one line per check:

    PASS decode: ...            the two paths agree on the decode batch
    TIME decode torch: ...      one layer's decode attention, torch's path
    TIME decode triton: ...     the same through the kernel, with the K/V bytes/s it reached
    PASS prefill: ...           (on CUDA in a half type: with SDPA's math backend turned
                                off, so it proves that a fused kernel took it)
    TIME prefill torch: ...  /  TIME prefill bottom-right: ...

With ``--graphs``, whole decode steps of a random model (tools/bench_decode.py's shapes) too,
eager and through CUDA graphs (``--cuda-graph-max-bs``): the same tokens, and a time each:

    PASS graphs: ...            both runners produced the same greedy tokens
    TIME graphs eager bs N: ... /  TIME graphs captured bs N: ...

It runs on the CPU too (the kernel in Triton's interpreter; small shapes), which is how the
tests keep it working. Exit status 1 when a check fails.

Usage: python tools/check_attention.py [--device cuda|cpu] [--dtype bfloat16] [--batch 64]
       [--context 4096] [--heads 14] [--kv-heads 2] [--head-dim 64] [--window N]
       [--prefix 2048] [--chunk 512] [--iters 20] [--graphs [--shape qwen2.5-0.5b]
       [--graph-batch 1 64] [--graph-context 512] [--graph-steps 16]]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_admin.messages import SamplingParams  # noqa: E402
from sglang_admin.model.attention import paged_attention  # noqa: E402
from sglang_admin.model.batch import BatchBuilder, ForwardBatch  # noqa: E402
from sglang_admin.model.runner import SeqInput  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def _sequences(lengths: list[tuple[int, int]], capacity: int, seed: int) -> list[SeqInput]:
    """(cached prefix, new tokens) per sequence, the slots a random draw from the pool."""
    gen = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(capacity, generator=gen) + 1).tolist()
    seqs = []
    for row, (prefix, new) in enumerate(lengths):
        own, slots = slots[: prefix + new], slots[prefix + new :]
        seqs.append(SeqInput(req_idx=row, prefix_len=prefix, token_ids=[5] * new,
                             table_start=0, table_slots=own, sampling=SamplingParams(),
                             prompt_ids=[5], output_ids=[]))
    return seqs


class Case:
    """One batch through one path: its metadata and the inputs of one layer's attention."""

    def __init__(self, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 seqs: list[SeqInput], capacity: int, cuda_attention: bool) -> None:
        rows = len(seqs)
        context = max(s.prefix_len + len(s.token_ids) for s in seqs)
        builder = BatchBuilder(
            device=device, dtype=dtype, max_running_requests=rows, context_length=context,
            token_capacity=capacity, sliding_window=args.window, num_heads=args.heads,
            kv_width=args.kv_heads * args.head_dim, cpu_kernels=None, extend_kernel=False,
            lanes=1, cuda_attention=cuda_attention)
        decode = [s for s in seqs if len(s.token_ids) == 1]
        extend = [s for s in seqs if len(s.token_ids) > 1]
        self.batch: ForwardBatch = builder.prepare(list(seqs), decode, extend, one_lane=True)
        self.args = args
        # the builder's token order (decode sequences sorted), as an index into the tokens
        # laid out in the sequences' own order
        starts, at = {}, 0
        for s in seqs:
            starts[id(s)] = at
            at += len(s.token_ids)
        self.order = torch.tensor(
            [starts[id(s)] + i for s in self.batch.ordered for i in range(len(s.token_ids))],
            device=device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One layer's attention of the new tokens, in the builder's order (what is timed;
        the kernel's scratch is sized at the first call, as by a forward's first layer)."""
        return paged_attention(q, k, v, self.batch.metas[0], k_cache, v_cache,
                               self.args.head_dim**-0.5, self.args.window, None)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> torch.Tensor:
        """:meth:`attend` with q, k, v and the output in the sequences' own order."""
        order = self.order
        out = self.attend(q[order], k[order], v[order], k_cache, v_cache)
        back = torch.empty_like(out)
        back[order] = out
        return back


def _time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median milliseconds of fn() after warm-up (compiles, caches)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _compare(name: str, seqs: list[SeqInput], args: argparse.Namespace, device: torch.device,
             dtype: torch.dtype, strict_kernel: bool, rate: Callable[[float], str]) -> bool:
    """Both paths on the same batch and pool: a PASS/FAIL line, then a TIME line each
    (``rate``: what a time in ms amounts to)."""
    tokens = sum(len(s.token_ids) for s in seqs)
    capacity = sum(s.prefix_len + len(s.token_ids) for s in seqs)
    gen = torch.Generator(device=device).manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    k_cache = rand(capacity + 1, args.kv_heads, args.head_dim)
    v_cache = rand(capacity + 1, args.kv_heads, args.head_dim)
    q = rand(tokens, args.heads, args.head_dim)
    k, v = rand(tokens, args.kv_heads, args.head_dim), rand(tokens, args.kv_heads, args.head_dim)
    old = Case(args, device, dtype, seqs, capacity, cuda_attention=False)
    new = Case(args, device, dtype, seqs, capacity, cuda_attention=True)
    # the new keys sit in the pool at the slots the batch gives them (the same for both)
    k_cache.index_copy_(0, old.batch.metas[0].out_slots, k[old.order])
    v_cache.index_copy_(0, old.batch.metas[0].out_slots, v[old.order])
    with torch.inference_mode():
        ref = old.run(q, k, v, k_cache, v_cache)
        guard = nullcontext()
        if strict_kernel and device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            guard = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                 SDPBackend.CUDNN_ATTENTION])
        try:
            with guard:
                got = new.run(q, k, v, k_cache, v_cache)
        except Exception as exc:  # noqa: BLE001 - a compile error or no kernel: one line
            print(f"FAIL {name}: the CUDA path raised {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0]}")
            return False
        err = (got.float() - ref.float()).abs().max().item()
        tol = TOLERANCE.get(dtype, 1e-2)
        ok = err <= tol
        kernel_note = " (SDPA's math backend off: a fused kernel took it)" if (
            strict_kernel and device.type == "cuda") else ""
        print(f"{'PASS' if ok else 'FAIL'} {name}: CUDA path equals torch's, max abs err "
              f"{err:.2e} (tolerance {tol:.0e}){kernel_note}", flush=True)
        base = None
        for label, case in (("torch", old), ("cuda-path", new)):
            qo, ko, vo = q[case.order], k[case.order], v[case.order]
            ms = _time_ms(lambda case=case, qo=qo, ko=ko, vo=vo:
                          case.attend(qo, ko, vo, k_cache, v_cache), device, args.iters)
            speed = "" if base is None else f", {base / ms:.1f}x torch's"
            base = ms
            print(f"TIME {name} {label}: {ms:.3f} ms per layer (median of {args.iters}), "
                  f"{rate(ms)}{speed}", flush=True)
    return ok


def _graphs(args: argparse.Namespace, dtype: torch.dtype) -> bool:
    """Decode steps of a random model, eager and through CUDA graphs: a PASS/FAIL line on
    their tokens, then a TIME line per batch size and runner."""
    from sglang_admin.model.runner import ModelRunner
    from tools.bench_decode import SHAPES, time_decode, write_checkpoint

    batches = args.graph_batch
    tokens: dict[str, list[int]] = {}
    times: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="check-attention-") as tmp:
        write_checkpoint(Path(tmp), SHAPES[args.shape], dtype)
        longest = args.graph_context + args.graph_steps + 8
        for label, max_bs in (("eager", 0), ("captured", max(batches))):
            runner = ModelRunner(tmp, device=args.device, dtype=args.dtype,
                                 max_running_requests=max(batches),
                                 max_total_tokens=max(batches) * longest + 64,
                                 cuda_graph_max_bs=max_bs)
            if max_bs and runner.graphs is None and runner.device.type == "cuda":
                print("FAIL graphs: the runner did not take --cuda-graph-max-bs (see the log)")
                return False
            seen = tokens.setdefault(label, [])
            step = runner.forward_step

            def recorded(seqs: list, step=step, seen=seen) -> list:  # noqa: ANN001
                outs = step(seqs)
                seen.extend(o.token_id for o in outs if o is not None)
                return outs

            runner.forward_step = recorded  # type: ignore[method-assign]
            for b in batches:
                steps = time_decode(runner, b, args.graph_context, args.graph_steps)
                times[label, b] = statistics.median(steps) * 1e3
                runner.reset()
            del runner
    same = tokens["eager"] == tokens["captured"]
    print(f"{'PASS' if same else 'FAIL'} graphs: {'the same' if same else 'different'} greedy "
          f"tokens eager and captured ({len(tokens['eager'])} tokens, {args.shape}, "
          f"{args.dtype})" + ("" if args.device.startswith("cuda") else
                               " (no CUDA: both ran eagerly, the check's plumbing only)"),
          flush=True)
    for b in batches:
        for label in ("eager", "captured"):
            speed = (f", {times['eager', b] / times[label, b]:.1f}x eager"
                     if label == "captured" else "")
            print(f"TIME graphs {label} bs {b}: {times[label, b]:.3f} ms per decode step "
                  f"(median of {args.graph_steps}){speed}", flush=True)
    return same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=64, help="decode sequences")
    p.add_argument("--context", type=int, default=4096, help="the longest decode sequence")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=None, help="a sliding window")
    p.add_argument("--prefix", type=int, default=2048, help="the prefill chunk's cached prefix")
    p.add_argument("--chunk", type=int, default=512, help="the prefill chunk's new tokens")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graphs", action="store_true",
                   help="also whole decode steps, eager against CUDA graphs")
    p.add_argument("--shape", default="qwen2.5-0.5b", help="--graphs: the model's shape "
                   "(tools/bench_decode.py's SHAPES)")
    p.add_argument("--graph-batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--graph-context", type=int, default=512)
    p.add_argument("--graph-steps", type=int, default=16)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    # decode lengths spread over [context / 8, context]: torch's path pads each group
    low = max(2, args.context // 8)
    lengths = torch.randint(low, args.context + 1, (args.batch,), generator=gen).tolist()
    lengths[0] = args.context
    decode = _sequences([(n - 1, 1) for n in lengths], sum(lengths), seed=1)
    print(f"attention: {args.heads}/{args.kv_heads} heads x {args.head_dim}, {args.dtype}, "
          f"{device}; decode batch {args.batch}, lengths {min(lengths)}..{max(lengths)}; "
          f"prefill {args.chunk} tokens after {args.prefix} cached"
          + (f"; window {args.window}" if args.window else ""), flush=True)
    elem = torch.empty(0, dtype=dtype).element_size()
    read = [min(n, args.window or n) for n in lengths]  # keys a query reads
    kv_bytes = sum(read) * 2 * args.kv_heads * args.head_dim * elem
    ok = _compare("decode", decode, args, device, dtype, strict_kernel=False,
                  rate=lambda ms: f"{kv_bytes / ms / 1e6:.0f} GB/s of K/V read")
    prefill = _sequences([(args.prefix, args.chunk)], args.prefix + args.chunk, seed=2)
    # causal: each new token's scores and weighted sum against its keys, 4 flops a key-dim
    flops = 4 * args.chunk * (args.prefix + (args.chunk + 1) / 2) * args.heads * args.head_dim
    # float32: SDPA's fused kernels take no float32 with grouped heads (flash: half types
    # only; memory-efficient: no GQA), so only half types must avoid the math backend
    ok = _compare("prefill", prefill, args, device, dtype, strict_kernel=dtype != torch.float32,
                  rate=lambda ms: f"{flops / ms / 1e9:.2f} TFLOP/s") and ok
    if args.graphs:
        try:
            ok = _graphs(args, dtype) and ok
        except Exception as exc:  # noqa: BLE001 - a capture that fails: one line
            print(f"FAIL graphs: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
