"""The runner's lanes on CPU: a step's sequences cut into lanes, each run by a thread of its
own; a decode step's projections and the LM head cut by weight rows among the lane threads;
the logits of the rows that sample."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from sglang_admin.model.batch import ForwardBatch
from sglang_admin.model.lanes import LM_HEAD_SPLIT_PARAMS
from sglang_admin.model.llama import Linear
from sglang_admin.model.packed_linear import packed_linear
from sglang_admin.model.step_io import SeqInput


class RunnerLanes:
    """ModelRunner's lane work (mixed into it: the attributes are the runner's)."""

    def _split_lanes(self, ordered: list[SeqInput]) -> list[tuple[int, int]]:
        """See :meth:`BatchBuilder.split_lanes`."""
        return self.batches.split_lanes(ordered)

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the rows that sample; on CPU with lanes and a large LM head, its
        vocabulary cut in one part per lane, computed at once by the lane threads (the head
        is a step's largest matmul: 2.8 GFLOP of SmolLM2-135M's batch-32 step, one thread)."""
        quant = getattr(self.model, "quant", None)
        if quant is not None and hidden.shape[0] > 0:  # model/quant/: the head kept quantized
            fallback = self._packed_linear if self.packed is not None else F.linear
            return quant.logits(self.model.final_norm(hidden), self.model.output_weight(),
                                fallback)
        if self.packed is not None and hidden.shape[0] > 0:
            return self._packed_linear(self.model.final_norm(hidden), self.model.output_weight(),
                                       None)
        cfg = self.model.config
        parts = self.lanes if cfg.vocab_size * cfg.hidden_size >= LM_HEAD_SPLIT_PARAMS else 1
        if parts <= 1 or self.device.type != "cpu" or hidden.shape[0] == 0:
            return self.model.compute_logits(hidden)
        normed = self.model.final_norm(hidden)
        vocab = cfg.vocab_size
        logits = torch.empty(hidden.shape[0], vocab, dtype=normed.dtype)

        def part(i: int) -> None:
            a, b = vocab * i // parts, vocab * (i + 1) // parts
            self.model.logits_into(normed, logits[:, a:b], a, b)

        futures = [self._lanes_pool().submit(_in_inference_mode, part, i)
                   for i in range(1, parts)]
        part(0)
        for f in futures:
            f.result()
        return logits

    def _split_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with the weight's rows cut in one part per lane, the
        parts computed at once by the lane threads and this one (each streams its part of
        the weights once for every row of x): the C projection in float32, where it measured
        faster than torch's one-thread GEMM at these shapes (SmolLM2-135M's gate/up at 32
        rows: 1.85 vs 2.78 ms of CPU time), torch's elsewhere (bfloat16: oneDNN)."""
        parts, n = self.lanes, weight.shape[0]
        cuts = [n * i // parts for i in range(parts + 1)]
        kernels = self.cpu_kernels
        x = x.contiguous()
        in_c = kernels is not None and x.dtype == torch.float32 and weight.is_contiguous()
        if in_c:
            out = torch.empty(x.shape[0], n, dtype=torch.float32)

            def part(i: int) -> None:
                a, b = cuts[i], cuts[i + 1]
                kernels.linear(x, weight[a:b], None if bias is None else bias[a:b],
                               out=out[:, a:b])
        else:
            outs: list[torch.Tensor | None] = [None] * parts

            def part(i: int) -> None:
                a, b = cuts[i], cuts[i + 1]
                outs[i] = F.linear(x, weight[a:b], None if bias is None else bias[a:b])
        futures = [self._lanes_pool().submit(_in_inference_mode, part, i)
                   for i in range(1, parts)]
        part(0)
        for f in futures:
            f.result()
        return out if in_c else torch.cat(outs, dim=1)  # type: ignore[arg-type]

    def _packed_linear(self, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with packed weights (model/packed_linear.py), the
        weight's rows cut in one part per lane, the parts computed at once by the lane
        threads and this one (each streams its part of the weights once)."""
        assert self.packed is not None
        parts = self.packed.parts(weight, bias, self.lanes)
        x = x.contiguous()
        if len(parts) == 1:
            return packed_linear(x, parts[0])
        outs: list[torch.Tensor | None] = [None] * len(parts)

        def part(i: int) -> None:
            outs[i] = packed_linear(x, parts[i])

        futures = [self._lanes_pool().submit(_in_inference_mode, part, i)
                   for i in range(1, len(parts))]
        part(0)
        for f in futures:
            f.result()
        return torch.cat(outs, dim=1)  # type: ignore[arg-type]

    def _packed_whole(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear`` with packed weights, uncut: what each lane of a step cut into lanes
        runs."""
        assert self.packed is not None
        return packed_linear(x.contiguous(), self.packed.parts(weight, bias, 1)[0])

    def _lanes_pool(self) -> ThreadPoolExecutor:
        """The lane threads (lanes past the first), started at first use."""
        if self._lane_pool is None:
            # a new thread does not inherit torch's thread count: without this, each lane
            # would start an OpenMP team of the machine's size, whose threads spin
            self._lane_pool = ThreadPoolExecutor(
                self.lanes - 1, thread_name_prefix="lane",
                initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        return self._lane_pool

    def _run_lanes(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of every new token: one forward per lane, lanes past the first on
        the lane threads while this thread computes the first; joined in token order."""
        lanes, offsets, metas = batch.lanes, batch.offsets, batch.metas
        ids, positions = batch.input_ids, batch.positions
        decode = metas[0].paged_decode
        if self.graphs is not None and decode is not None and metas[0].num_decode == len(ids):
            hidden = self.graphs.run(ids, positions, metas[0].out_slots, decode.rows,
                                     decode.lengths)
            if hidden is not None:  # a decode batch no larger than the graphs' largest
                return hidden

        def run(i: int, linear: Linear | None = None) -> torch.Tensor:
            a, b = offsets[lanes[i][0]], offsets[lanes[i][1]]
            return self.model(ids[a:b], positions[a:b], metas[i], self.k_caches, self.v_caches,
                              linear)

        quant = getattr(self.model, "quant", None)
        if len(lanes) == 1:
            if quant is not None:  # model/quant/: projections kept quantized
                return run(0, quant.linear_with(
                    self._packed_linear if self.packed is not None else F.linear))
            if self.packed is not None:
                return run(0, self._packed_linear)
            decode_only = ids.shape[0] == len(batch.ordered)
            return run(0, self._split_linear if self.split_matmuls and decode_only else None)
        whole = self._packed_whole if self.packed is not None else None
        if quant is not None:
            whole = quant.linear_with(whole or F.linear)
        futures = [self._lanes_pool().submit(_in_inference_mode, run, i, whole)
                   for i in range(1, len(lanes))]
        first = run(0, whole)
        return torch.cat([first, *(f.result() for f in futures)])


def _in_inference_mode(fn, *args):  # noqa: ANN001, ANN202 - a lane thread's entry
    """Run fn(*args) under torch.inference_mode (a per-thread mode: lane threads need it)."""
    with torch.inference_mode():
        return fn(*args)
