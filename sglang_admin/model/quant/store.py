"""The model's kept projections by the placeholder tensors that stand for them: the matmuls
routed to them, the LM head's logits, a parameter's dequantized view by name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_admin.model.quant.linear import Projection, QuantLinear, refined_logits


class QuantStore:
    """The model's quantized projections, found by the placeholder tensor the model passes
    as ``weight`` to its ``linear`` (model/llama.py's ``Linear``); other weights go to
    ``fallback``."""

    def __init__(self, summary: str) -> None:
        self.summary = summary  # one line: what is kept, what is dequantized
        self.scheme = "gguf"  # or a --torchao-config name (model/quant/online.py)
        self._by_id: dict[int, tuple[torch.Tensor, Projection]] = {}
        # parameter name -> (projection, first row, end row): a dequantized view by name
        self.by_name: dict[str, tuple[Projection, int, int]] = {}
        # a tied LM head: the embedding's quantized copy (the lookup table stays dense)
        self.tied_head: QuantLinear | None = None
        # --tp-size > 1: the row-parallel weights (by id) whose outputs ``linear_with``
        # sums over the ranks, kept or dense (the modules' all-reduce hooks do not run
        # when a matmul goes through ``linear_with``)
        self._reduced: dict[int, torch.Tensor] = {}
        self._reduce: Callable[[torch.Tensor], None] | None = None

    def reduce_outputs(self, reduce: Callable[[torch.Tensor], None],
                       weights: list[torch.Tensor]) -> None:
        """Sum the outputs of ``weights``' matmuls with ``reduce`` (in place)."""
        self._reduce = reduce
        self._reduced = {id(w): w for w in weights}

    def add(self, placeholder: torch.Tensor, projection: Projection) -> None:
        """Serve ``placeholder``'s matmuls with ``projection``."""
        self._by_id[id(placeholder)] = (placeholder, projection)

    def find(self, weight: torch.Tensor) -> Projection | None:
        """The projection standing for ``weight``, if any."""
        entry = self._by_id.get(id(weight))
        return entry[1] if entry is not None and entry[0] is weight else None

    def linear_with(self, fallback: Callable[..., torch.Tensor]
                    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """A ``Linear`` (x, weight, bias) -> y: quantized weights through their projection,
        any other through ``fallback``."""

        def linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
            projection = self.find(weight)
            out = fallback(x, weight, bias) if projection is None else projection(x, bias)
            if self._reduce is not None and self._reduced.get(id(weight)) is weight:
                self._reduce(out)
            return out

        return linear

    def logits(self, x: torch.Tensor, weight: torch.Tensor,
               fallback: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The LM head's logits of normed rows ``x`` (float32, the top ones refined:
        :func:`refined_logits`)."""
        head = self.find(weight)
        if head is None:
            return fallback(x, weight, None)
        exact = head.exact_logits(x) if isinstance(head, QuantLinear) else None
        return exact if exact is not None else refined_logits(head, x, head(x))

    def projections(self) -> list[Projection]:
        """Each projection once."""
        seen: dict[int, Projection] = {}
        for _, p in self._by_id.values():
            seen[id(p)] = p
        return list(seen.values())

    @property
    def nbytes(self) -> int:
        """Bytes the projections hold (dense copies included)."""
        return sum(p.nbytes for p in self.projections())

    def quantized_bytes(self) -> int:
        """Bytes a batch-1 step reads of them."""
        return sum(p.quantized_bytes() for p in self.projections())

    def dequantized(self, name: str, memo: dict[int, torch.Tensor] | None = None
                    ) -> torch.Tensor | None:
        """A parameter's values, dequantized, by its Hugging Face name (None: not kept);
        ``memo``: the last two projections dequantized, kept across calls that pass the same
        dict (q, k and v are rows of one, read in name order)."""
        entry = self.by_name.get(name)
        if entry is None and name == "lm_head.weight" and self.tied_head is not None:
            return self.tied_head.dequantized()
        if entry is None:
            return None
        projection, a, b = entry
        if memo is None:
            return projection.dequantized()[a:b]
        whole = memo.get(id(projection))
        if whole is None:
            while len(memo) >= 2:  # in name order a projection's parts are at most 2 apart
                memo.pop(next(iter(memo)))
            whole = memo[id(projection)] = projection.dequantized()
        return whole[a:b]
