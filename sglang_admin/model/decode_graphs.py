"""CUDA graphs for decode steps: the model's forward over a decode batch, captured once per
padded batch size and replayed, so a step costs a few copies and one launch instead of a
Python-issued launch per op (hundreds per step on a small model, more than the GPU's work).

Off by default (``--cuda-graph-max-bs``); used on CUDA with the Triton decode kernel
(model/attention/choice.py), without LoRA or tensor parallelism. A decode batch of ``n``
sequences runs the graph of the smallest captured size ``>= n`` (:func:`graph_sizes`): its
inputs are copied into static buffers and the rows past ``n`` padded with a harmless
sequence (token 0 at position 0, its K/V written to the pool's scratch slot 0, attending to
one position of table row 0); the hidden states of the first ``n`` rows are returned. Each
size uses a fixed split count (the one a full-context batch of that size gets), so the
graph does not depend on the batch's lengths.

Without capture (``capture=False``: the CPU tests) the same static-buffer forward runs
eagerly, which is how the padding is checked without a GPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from sglang_admin.model.attention import AttentionMetadata, PagedDecode

__all__ = ["DecodeGraphs", "graph_sizes", "padded_size"]

logger = logging.getLogger(__name__)

# the forward a graph captures: (input ids, positions, metadata) -> hidden states
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_sizes(max_bs: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, 8, then every 8, up to ``max_bs`` (which is
    always one of them). A batch pads to at most 7 rows more (past 8)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs]
    sizes += list(range(8, max_bs, 8))
    return sizes + [max_bs] if max_bs >= 1 else []


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n`` rows; None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Decode forwards over static buffers, one per padded size, captured as CUDA graphs.

    ``forward`` is the model's forward; ``table`` the request-to-token table; ``splits`` the
    split count of each size (model/attention/triton_decode.py's ``split_count`` at the full
    context). Call :meth:`capture` once the weights and the KV pool are in place, and
    :meth:`drop` when either is reallocated (memory release); :meth:`run` recaptures then.
    """

    def __init__(self, forward: Forward, table: torch.Tensor, max_bs: int,
                 splits: Callable[[int], int], num_heads: int, head_dim: int,
                 device: torch.device, capture: bool = True) -> None:
        self.forward = forward
        self.table = table
        self.sizes = graph_sizes(max_bs)
        self.splits = {size: splits(size) for size in self.sizes}
        self.capture_enabled = capture
        self.device = device
        # static inputs: ids, positions, out slots, table rows, lengths (one buffer, one copy)
        self.inputs = torch.zeros(5, max_bs, dtype=torch.int64, device=device)
        part = max(size * num_heads * self.splits[size] for size in self.sizes)
        self._part_out = torch.empty(part * head_dim, dtype=torch.float32, device=device)
        self._part_lse = torch.empty(part, dtype=torch.float32, device=device)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # the device memory the captures reserved (their pool and outputs; 0 when none are
        # captured): GetLoads' memory.graph_gb
        self.graph_bytes = 0

    def _metadata(self, size: int) -> AttentionMetadata:
        """The metadata of a decode batch of ``size`` rows, read from the static buffers."""
        _, _, out_slots, rows, lengths = self.inputs[:, :size]
        s, h, d = self.splits[size], self.num_heads, self.head_dim
        decode = PagedDecode(self.table, rows, lengths, longest=0, num_splits=s,
                             part_out=self._part_out[: size * h * s * d].view(size, h, s, d),
                             part_lse=self._part_lse[: size * h * s].view(size, h, s))
        return AttentionMetadata(out_slots=out_slots, num_decode=size, paged_decode=decode)

    def _run_static(self, size: int) -> torch.Tensor:
        ids, positions = self.inputs[0, :size], self.inputs[1, :size]
        return self.forward(ids, positions, self._metadata(size))

    def capture(self) -> None:
        """Capture every size (largest first, sharing one memory pool), after a warm-up run
        of each on a side stream (Triton compiles there, not inside a capture)."""
        if not self.capture_enabled:
            return
        self._pad(0, self.sizes[-1])
        before = torch.cuda.memory_reserved(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in self.sizes:
                self._run_static(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._run_static(size)
            self.graphs[size] = graph
        self.graph_bytes = max(0, torch.cuda.memory_reserved(self.device) - before)
        logger.info("CUDA graphs captured for decode batches of %s", self.sizes)

    def drop(self) -> None:
        """Forget the captured graphs (the weights or the KV pool moved); :meth:`run`
        captures again at its next call."""
        self.graphs.clear()
        self.outputs.clear()
        self.graph_bytes = 0

    def _pad(self, n: int, size: int) -> None:
        """Rows [n, size) of the static inputs: token 0 at position 0, K/V to the scratch
        slot 0, one position of table row 0."""
        if size > n:
            self.inputs[:, n:size] = 0
            self.inputs[4, n:size] = 1

    def run(self, ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
            rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a decode batch of n sequences, through the graph of
        its padded size; None when n is past the largest size (the caller runs it eagerly)."""
        n = ids.shape[0]
        size = padded_size(n, self.sizes)
        if size is None:
            return None
        if self.capture_enabled and not self.graphs:  # dropped by a memory release
            try:
                self.capture()
            except Exception as exc:  # noqa: BLE001 - run eagerly rather than fail the step
                logger.warning("CUDA graph capture failed (%s: %s): decode steps run eagerly",
                               type(exc).__name__, exc)
                self.capture_enabled = False
                self.drop()
        for i, values in enumerate((ids, positions, out_slots, rows, lengths)):
            self.inputs[i, :n].copy_(values, non_blocking=True)
        self._pad(n, size)
        graph = self.graphs.get(size)
        if graph is None:  # not captured (CPU tests): the same forward, eagerly
            return self._run_static(size)[:n]
        graph.replay()
        return self.outputs[size][:n]
