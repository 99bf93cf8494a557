"""Projections on weights kept quantized: torch's int4 / int8 CPU kernels for a few rows, a
dense copy through oneDNN for batched rows.

Measured at SmolLM2-135M's shapes (``tools/bench_quant_kernels.py``, docs/cpu-performance.md):
``_weight_int4pack_mm_for_cpu`` (4 bits, a scale and zero per 32 inputs) reads 3.6x fewer
bytes than bfloat16 and runs a batch-1 pass 3x faster than oneDNN's packed bfloat16 GEMM,
but its cost grows with the rows (it is a GEMV kernel at heart): from about 16 rows on,
the packed bfloat16 GEMM wins 2-5x. So each :class:`QuantLinear` holds the quantized weight
and, unless asked not to, a bfloat16 (the served dtype's) copy dequantized from the same
values and packed once for oneDNN: steps of at most :data:`KERNEL_MAX_ROWS` rows go through
the quantized kernel, larger ones (batched decode, prefill) through the dense copy; both
compute the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from sglang_admin.model.packed_linear import packing_available
from sglang_admin.model.quant.gguf_blocks import Int4Groups, Int8Rows

# rows up to which a step takes the quantized kernel (measured crossover: 8-16 rows)
KERNEL_MAX_ROWS = 8
_INNER_K_TILES = 2
_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's rows
# an int8 LM head's largest logits per row recomputed in float32 (refined_logits)
REFINE_TOP = 8


class QuantLinear:
    """One projection's weight [N, K], quantized, with the matmul :meth:`__call__`."""

    def __init__(self, weight: Int4Groups | Int8Rows, dtype: torch.dtype,
                 dense_copy: bool = True) -> None:
        self.dtype = dtype
        self.kind = "int4" if isinstance(weight, Int4Groups) else "int8"
        self.pad = 0  # int4: zero rows added to N (the packing wants a multiple of 16)
        self.group = weight.group if isinstance(weight, Int4Groups) else 0
        if isinstance(weight, Int4Groups):
            n, k = weight.q.shape
            self.pad = -n % _N_MULTIPLE
            q = torch.from_numpy(weight.q.astype("int32"))
            scale, zero = torch.from_numpy(weight.scale), torch.from_numpy(weight.zero)
            if dtype != torch.float32:
                # the scale rounded to the served dtype shifts every weight of its group the
                # same way: move the zero so that the group's mean weight stays exact
                rounded = scale.to(dtype).float()
                mean_q = (q.view(n, k // self.group, self.group).float() - 8).mean(-1)
                zero = zero + mean_q * (scale - rounded)
                scale = rounded
            if self.pad:  # q = 8, scale = zero = 0: rows of zeros, cut from the output
                q = torch.cat([q, torch.full((self.pad, k), 8, dtype=torch.int32)])
                scale = torch.cat([scale, torch.zeros(self.pad, k // self.group)])
                zero = torch.cat([zero, torch.zeros(self.pad, k // self.group)])
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
            sz = torch.stack([scale.t(), zero.t()], -1)
            self.scales_zeros = sz.to(dtype).contiguous()  # [K / 32, N + pad, 2]
            self.q8: torch.Tensor | None = None
            self.row_scale: torch.Tensor | None = None
        else:
            n, k = weight.q.shape
            self.q8 = torch.from_numpy(weight.q).contiguous()
            self.row_scale = torch.from_numpy(weight.scale).to(dtype)
            self.row_scale_f32 = torch.from_numpy(weight.scale).float()
        self.shape = (n, k)
        self.dense: torch.Tensor | None = None
        self._dense_packed: torch.Tensor | None = None
        if dense_copy:
            self.set_dense(self.dequantized())

    def set_dense(self, dense: torch.Tensor) -> None:
        """The dense copy batched rows use (``dense`` [N, K] in the served dtype), packed for
        oneDNN where this torch can."""
        if packing_available():
            self._dense_packed = torch.ops.mkldnn._reorder_linear_weight(dense.contiguous(), 32)
            self.dense = None
        else:
            self.dense = dense.contiguous()

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] in the served dtype, computed from the quantized values as the
        kernel computes it (the scales and zeros rounded to the served dtype)."""
        n, k = self.shape
        if self.kind == "int8":
            assert self.q8 is not None and self.row_scale is not None
            return (self.q8.float() * self.row_scale.float()[:, None]).to(self.dtype)
        eye = torch.eye(k, dtype=self.dtype)
        # the kernel itself on the identity: exactly the weights it multiplies with
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group,
                                                         self.scales_zeros)
        return out[:, :n].t().contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes held: the quantized weight, its scales, and the dense copy if any."""
        held = [self.dense, self._dense_packed]
        if self.kind == "int4":
            held += [self.packed, self.scales_zeros]
        else:
            held += [self.q8, self.row_scale]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def quantized_bytes(self) -> int:
        """Bytes of the quantized weight and its scales alone (what batch 1 reads)."""
        if self.kind == "int4":
            return (self.packed.numel() * self.packed.element_size()
                    + self.scales_zeros.numel() * self.scales_zeros.element_size())
        assert self.q8 is not None and self.row_scale is not None
        return self.q8.numel() + self.row_scale.numel() * self.row_scale.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] (+ bias)."""
        x = x.contiguous()
        if x.dtype != self.dtype:
            raise TypeError(f"activations are {x.dtype}, the quantized weight serves {self.dtype}")
        rows = x.shape[0]
        if rows > KERNEL_MAX_ROWS and self._dense_packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._dense_packed, bias, "none", [], "")
        if rows > KERNEL_MAX_ROWS and self.dense is not None:
            return F.linear(x, self.dense, bias)
        if self.kind == "int4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                             self.scales_zeros)
            if self.pad:
                out = out[:, : self.shape[0]]
        else:
            out = torch.ops.aten._weight_int8pack_mm(x, self.q8, self.row_scale)
        return out if bias is None else out + bias


def refined_logits(head: QuantLinear | ConcatLinear | None, x: torch.Tensor,
                   logits: torch.Tensor, top: int = REFINE_TOP) -> torch.Tensor:
    """float32 logits whose ``top`` largest per row are computed again in float32 from the
    int8 head's rows: bfloat16 logits of magnitude 16-32 are 0.125 apart, so near-ties
    of greedy decoding would be decided by rounding (the rest keep the served precision)."""
    out = logits.float()
    if not isinstance(head, QuantLinear) or head.kind != "int8" or top <= 0:
        return out
    k = min(top, out.shape[1])
    idx = out.topk(k, dim=-1).indices  # [M, k]
    rows = head.q8[idx].float() * head.row_scale_f32[idx].unsqueeze(-1)  # [M, k, K]
    exact = torch.einsum("mk,mjk->mj", x.float(), rows)
    return out.scatter_(1, idx, exact)


class ConcatLinear:
    """Projections of different quantized kinds fused along N (q/k/v of another type each):
    each part computed, the outputs concatenated."""

    def __init__(self, parts: list[QuantLinear | torch.Tensor]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        outs = [p(x) if isinstance(p, QuantLinear) else F.linear(x, p) for p in self.parts]
        out = torch.cat(outs, dim=-1)
        return out if bias is None else out + bias

    def dequantized(self) -> torch.Tensor:
        """The fused weight [N, K] in the served dtype."""
        return torch.cat([p.dequantized() if isinstance(p, QuantLinear) else p
                          for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes if isinstance(p, QuantLinear) else p.numel() * p.element_size()
                   for p in self.parts)

    def quantized_bytes(self) -> int:
        return sum(p.quantized_bytes() if isinstance(p, QuantLinear)
                   else p.numel() * p.element_size() for p in self.parts)


Projection = QuantLinear | ConcatLinear


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
            if projection is None:
                return fallback(x, weight, bias)
            return projection(x, bias)

        return linear

    def logits(self, x: torch.Tensor, weight: torch.Tensor,
               fallback: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The LM head's logits of normed rows ``x`` (float32, the top ones refined:
        :func:`refined_logits`)."""
        head = self.find(weight)
        if head is None:
            return fallback(x, weight, None)
        return refined_logits(head, x, head(x))

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

    def dequantized(self, name: str) -> torch.Tensor | None:
        """A parameter's values, dequantized, by its Hugging Face name (None: not kept)."""
        entry = self.by_name.get(name)
        if entry is None and name == "lm_head.weight" and self.tied_head is not None:
            return self.tied_head.dequantized()
        if entry is None:
            return None
        projection, a, b = entry
        return projection.dequantized()[a:b]
