"""CPU projections through oneDNN with each weight packed once into the layout its GEMM
wants, and packed again only when the weight changes.

``F.linear`` on CPU hands oneDNN a plain ``[out, in]`` weight, which it reorders into its
blocked layout on every call. Packing once at first use (torch's own
``mkldnn._reorder_linear_weight`` / ``mkldnn._linear_pointwise``, what torch's inductor
uses for frozen CPU models) measured at SmolLM2-135M's shapes, 32 rows, weights out of
cache: 1.3-1.5x faster in bfloat16 and 2x in float32, results bit-identical in bfloat16
(docs/cpu-performance.md). A packed weight is a second copy, so a model that packs holds its
weights twice; :meth:`PackedWeights.clear` drops them (ReleaseMemoryOccupation).

A weight is re-packed when it is no longer the tensor it was packed from: another object,
other storage, or written in place since (torch's version counter, which a view shares with
its base, so a refit that copies into ``gate_proj.weight`` also marks the fused
``gate_up_weight``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# the batch size oneDNN is told to expect when packing (the layout does not depend on it
# for these kernels; any number of rows runs on a packed weight)
_BATCH_HINT = 32


def packing_available() -> bool:
    """Whether this torch build packs linear weights for oneDNN on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(4, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8), packed, None, "none", [], "")
        return bool(torch.equal(out, torch.full((1, 4), 8.0)))
    except (RuntimeError, AttributeError) as exc:
        logger.info("oneDNN weight packing unavailable (%s): plain F.linear", exc)
        return False


class PackedWeights:
    """The packed copies of a model's projection weights, each cut into ``parts`` row
    ranges (one per lane thread) and packed per range."""

    def __init__(self) -> None:
        # id(weight), parts -> (weight, its data_ptr, its version, [(packed, bias part)])
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, int, int,
                                                 list[tuple[torch.Tensor, torch.Tensor | None]]]] = {}

    def parts(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: int
              ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``weight``'s rows cut into ``parts`` ranges, each packed, with the matching bias
        slices; packed now when absent or stale."""
        key = (id(weight), parts)
        entry = self._cache.get(key)
        if (entry is not None and entry[0] is weight and entry[1] == weight.data_ptr()
                and entry[2] == weight._version):
            return entry[3]
        n = weight.shape[0]
        cuts = [n * i // parts for i in range(parts + 1)]
        packed = [
            (torch.ops.mkldnn._reorder_linear_weight(weight[a:b].contiguous(), _BATCH_HINT),
             None if bias is None else bias[a:b].contiguous())
            for a, b in zip(cuts, cuts[1:])
        ]
        self._cache[key] = (weight, weight.data_ptr(), weight._version, packed)
        return packed

    def clear(self) -> None:
        """Drop every packed copy (they are made again at next use)."""
        self._cache.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies hold."""
        return sum(p.numel() * p.element_size()
                   for entry in self._cache.values() for p, _ in entry[3])


def packed_linear(x: torch.Tensor, part: tuple[torch.Tensor, torch.Tensor | None]
                  ) -> torch.Tensor:
    """``F.linear`` of ``x`` [M, K] with one packed part of :meth:`PackedWeights.parts`."""
    return torch.ops.mkldnn._linear_pointwise(x, part[0], part[1], "none", [], "")
