"""Projections on weights kept quantized: torch's int4 / int8 CPU kernels for a few rows, a
dense copy through oneDNN for batched rows. int8 in blocks of 32 (GGUF's Q8_0) runs through
the int4 kernel as two 4-bit halves of each value (gguf_blocks.nibble_halves): exact, with
the block scales as stored.

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

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sglang_admin.model.packed_linear import packing_available
from sglang_admin.model.quant import amx, gemv
from sglang_admin.model.quant.gguf_blocks import (
    GROUP,
    Int4Groups,
    Int8Blocks,
    Int8Rows,
    nibble_halves,
)

# rows up to which a step takes the quantized kernel (measured crossover: 8-16 rows)
KERNEL_MAX_ROWS = 8
# float32 activations: the int4 kernel has no vectorized float32 path in torch's CPU build
# (measured 75-300x slower than its bfloat16 path, _weight_int8pack_mm 4x): every step of
# a float32 model with a dense copy takes the copy
_INNER_K_TILES = 2
_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's rows
# an int8 LM head's largest logits per row recomputed in float32 (refined_logits)
REFINE_TOP = 8
# rows up to which the few-row kernel (model/quant/gemv.py) serves where it applies
# (its cost grows with the rows as torch's int4 kernel's does: measured 1.5-2x faster at 1-2
# rows, about even at 4)
GEMV_MAX_ROWS = 2


@functools.lru_cache(maxsize=4)
def _identity(k: int, dtype: torch.dtype) -> torch.Tensor:
    """The [k, k] identity matrix, read (never written) by :meth:`QuantLinear.dequantized`
    (``torch.eye`` in bfloat16 takes milliseconds)."""
    return torch.eye(k).to(dtype)


class QuantLinear:
    """One projection's weight [N, K], quantized, with the matmul :meth:`__call__`.

    ``keep_rows``: an :class:`Int8Blocks` or :class:`Int4Groups` weight also keeps its
    values and float32 scales (and zeros), from which an LM head's top logits are computed
    again (:func:`refined_logits`); an :class:`Int8Rows` weight always has them."""

    def __init__(self, weight: Int4Groups | Int8Rows | Int8Blocks, dtype: torch.dtype,
                 dense_copy: bool = True, keep_rows: bool = False) -> None:
        self.dtype = dtype
        self.pad = 0  # int4: zero rows added to N (the packing wants a multiple of 16)
        self.repeat = 1  # int8x32: the int4 kernel's inputs are [x, x] (nibble_halves)
        self.group = 0
        self.packed: torch.Tensor | None = None
        self.scales_zeros: torch.Tensor | None = None
        self.q8: torch.Tensor | None = None
        self.row_scale: torch.Tensor | None = None
        self.row_scale_f32: torch.Tensor | None = None
        self.block_scale_f32: torch.Tensor | None = None
        self.q4: torch.Tensor | None = None  # int4 with keep_rows: uint8 [N, K], 0..15
        self.group_scale_f32: torch.Tensor | None = None
        self.group_zero_f32: torch.Tensor | None = None
        # the few-row kernel's layout (model/quant/gemv.py) where it serves this weight
        self.gemv_w: torch.Tensor | None = None
        self.gemv_s: torch.Tensor | None = None
        # the AMX kernel's layout (model/quant/amx.py) where it serves this weight's
        # batched steps (MIN_ROWS..MAX_ROWS rows) in place of the dense copy
        self.amx_codes: torch.Tensor | None = None
        self.amx_sz: torch.Tensor | None = None
        self._amx: amx.AmxKernel | None = None
        n, k = weight.q.shape
        use_gemv = (dtype == torch.bfloat16 and not isinstance(weight, Int8Rows)
                   and gemv.shape_applies(k, getattr(weight, "group", GROUP))
                   and gemv.gemv_kernel() is not None)
        if isinstance(weight, Int8Blocks):
            self.kind, self.group, self.repeat = "int8x32", GROUP, 2
            if use_gemv:
                packed = gemv.pack_int8(weight.q, weight.scale)
                if packed is not None:
                    self.gemv_w, self.gemv_s = packed
            if keep_rows:
                self.q8 = torch.from_numpy(weight.q.copy())
                self.block_scale_f32 = torch.from_numpy(weight.scale.astype("float32"))
                if (dtype == torch.bfloat16 and amx.shape_applies(n, k, GROUP)
                        and amx.amx_kernel() is not None):  # an LM head's exact logits
                    self._amx = amx.amx_kernel()
                    self.amx_codes, self.amx_sz = amx.pack_int8(weight.q, weight.scale)
            self._pack_int4(nibble_halves(weight), dtype, weight)
        elif isinstance(weight, Int4Groups):
            self.kind, self.group = "int4", weight.group
            if keep_rows:
                self.q4 = torch.from_numpy(weight.q.copy())
                self.group_scale_f32 = torch.from_numpy(weight.scale.astype("float32"))
                self.group_zero_f32 = torch.from_numpy(weight.zero.astype("float32"))
            self._pack_int4(weight, dtype, None, use_gemv)
        else:
            self.kind = "int8"
            self.q8 = torch.from_numpy(weight.q).contiguous()
            self.row_scale = torch.from_numpy(weight.scale).to(dtype)
            self.row_scale_f32 = torch.from_numpy(weight.scale).float()
        self.shape = (n, k)
        # rows up to which a step takes the quantized kernel when there is a dense copy
        self.kernel_rows = KERNEL_MAX_ROWS if dtype != torch.float32 else 0
        self.dense: torch.Tensor | None = None
        self._dense_packed: torch.Tensor | None = None
        self.dense_is_values = False  # whether the dense copy was made from these values
        if dense_copy:
            self.set_dense(self.dequantized(), from_values=True)

    def _pack_int4(self, weight: Int4Groups, dtype: torch.dtype,
                   blocks: Int8Blocks | None, use_gemv: bool = False) -> None:
        """``weight`` packed for ``_weight_int4pack_mm_for_cpu``, its scales and zeros in
        ``dtype`` (``blocks``: the int8 blocks ``weight`` holds the halves of); ``use_gemv``:
        and for the few-row kernel, with the same scales and zeros."""
        n, k = weight.q.shape
        self.pad = -n % _N_MULTIPLE
        q = torch.from_numpy(weight.q.astype("int32"))
        scale, zero = torch.from_numpy(weight.scale), torch.from_numpy(weight.zero).clone()
        if dtype != torch.float32:
            rounded = scale.to(dtype).float()
            if blocks is None:
                # the scale rounded to the served dtype shifts every weight of its group the
                # same way: move the zero so that the group's mean weight stays exact
                mean_q = (q.view(n, k // self.group, self.group).float() - 8).mean(-1)
                zero = zero + mean_q * (scale - rounded)
            else:
                # both halves' scales (16 d and d) round alike, and the low half's zero (8 d)
                # with them: the block serves rounded(d) * q; the high half's zero (0)
                # takes the block's mean error, so that its mean weight stays exact
                g = k // 2 // GROUP
                d = torch.from_numpy(blocks.scale).float()
                mean_q = torch.from_numpy(blocks.q).float().view(n, g, GROUP).mean(-1)
                zero[:, :g] = mean_q * (d - d.to(dtype).float())
            scale = rounded
        if use_gemv:
            self.gemv_w, self.gemv_s = gemv.pack_int4(weight.q, scale, zero)
        if (blocks is None and dtype == torch.bfloat16 and amx.shape_applies(n, k, self.group)
                and amx.amx_kernel() is not None):
            self._amx = amx.amx_kernel()
            self.amx_codes, self.amx_sz = amx.pack_int4(weight.q, scale, zero)
        if self.pad:  # q = 8, scale = zero = 0: rows of zeros, cut from the output
            q = torch.cat([q, torch.full((self.pad, k), 8, dtype=torch.int32)])
            scale = torch.cat([scale, torch.zeros(self.pad, k // self.group)])
            zero = torch.cat([zero, torch.zeros(self.pad, k // self.group)])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        sz = torch.stack([scale.t(), zero.t()], -1)
        self.scales_zeros = sz.to(dtype).contiguous()  # [K / group, N + pad, 2]

    def set_dense(self, dense: torch.Tensor, from_values: bool = False) -> None:
        """The dense copy batched rows use (``dense`` [N, K] in the served dtype), packed for
        oneDNN where this torch can; ``from_values``: ``dense`` is :meth:`dequantized`'s
        (a tied LM head's copy is the embedding instead), which it then reads back."""
        self.dense_is_values = from_values
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
        if self.dense_is_values and self.dense is not None:
            return self.dense.clone()
        if self.dense_is_values and self._dense_packed is not None:
            # oneDNN on the identity: the copy's values exactly, in a fraction of the int4
            # kernel's time on it (the release of SmolLM2's kept weights digests them all)
            eye = _identity(k, self.dtype)
            return torch.ops.mkldnn._linear_pointwise(eye, self._dense_packed, None, "none", [],
                                                      "").t().contiguous()
        if self.dtype == torch.float32:  # exact scales: (q - 8) * scale + zero directly
            return self._unpacked_float32()
        # the kernel itself on the identity: exactly the weights it multiplies with
        return self._int4(_identity(k, self.dtype)).t().contiguous()

    def _unpacked_float32(self) -> torch.Tensor:
        """float32 [N, K] of the packed int4 weight, its float32 scales and zeros applied
        (the kernel's values; its own float32 path is slow, see ``kernel_rows``)."""
        n, k = self.shape
        assert self.packed is not None and self.scales_zeros is not None
        kk = k * self.repeat
        # the kernel on the identity in bfloat16 recovers the 4-bit values exactly (0..15)
        ones = torch.stack([torch.ones_like(self.scales_zeros[..., 0]),
                            torch.zeros_like(self.scales_zeros[..., 1])], -1)
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(
            torch.eye(kk, dtype=torch.bfloat16), self.packed, self.group,
            ones.to(torch.bfloat16)).float().t()  # [N + pad, kk]: q - 8
        sz = self.scales_zeros.float()  # [kk / group, N + pad, 2]
        w = (q.view(-1, kk // self.group, self.group) * sz[..., 0].t().unsqueeze(-1)
             + sz[..., 1].t().unsqueeze(-1)).reshape(-1, kk)[:n]
        return w.view(n, self.repeat, k).sum(1) if self.repeat > 1 else w.contiguous()

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] through the int4 kernel (int4 and int8x32 kinds)."""
        if self.repeat > 1:
            x = torch.cat([x] * self.repeat, dim=1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                         self.scales_zeros)
        return out[:, : self.shape[0]] if self.pad else out

    @property
    def _gemv_call(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The table kernel bound to this weight's layout (None: not kept in it)."""
        bound = self.__dict__.get("_gemv_bound")
        if bound is not None and bound.keep[0] is self.gemv_w and bound.keep[1] is self.gemv_s:
            return bound
        if self.gemv_w is None or self.gemv_s is None:
            return None
        kernel = gemv.loaded()  # the layouts exist only where it loaded
        assert kernel is not None
        bound = kernel.bind(self.kind, self.gemv_w, self.gemv_s, self.shape[0])
        self.__dict__["_gemv_bound"] = bound
        return bound

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] through the few-row kernel: bfloat16 (int4), float32 (int8x32)."""
        call = self._gemv_call
        assert call is not None
        return call(x)

    def exact_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [M, N] of bfloat16 rows ``x`` computed from the int8 blocks as
        stored (float32 products and sums: nothing left for :func:`refined_logits` to
        refine), where the few-row kernel (1-2 rows) or the AMX kernel (model/quant/amx.py,
        its rows) serves this weight; else None."""
        if self.kind != "int8x32" or x.dtype != self.dtype:
            return None
        rows = x.shape[0]
        if self.gemv_w is not None and rows <= GEMV_MAX_ROWS:
            return self._gemv(x.contiguous())
        if self._amx is not None and amx.MIN_ROWS <= rows <= amx.MAX_ROWS:
            assert self.amx_codes is not None and self.amx_sz is not None
            return self._amx.q8(x.contiguous(), self.amx_codes, self.amx_sz, self.shape[0])
        return None

    def rows_float(self, idx: torch.Tensor) -> torch.Tensor | None:
        """float32 rows ``idx`` [M, j] -> [M, j, K] of the stored int8 values times their
        scales; None where they are not kept (int4 and int8x32 without ``keep_rows``)."""
        if self.kind == "int8":
            assert self.q8 is not None and self.row_scale_f32 is not None
            return self.q8[idx].float() * self.row_scale_f32[idx].unsqueeze(-1)
        if self.kind == "int4":
            if self.q4 is None or self.group_scale_f32 is None or self.group_zero_f32 is None:
                return None
            m, j = idx.shape
            k, g = self.shape[1], self.group
            rows = self.q4[idx].float().view(m, j, k // g, g) - 8
            return (rows * self.group_scale_f32[idx].unsqueeze(-1)
                    + self.group_zero_f32[idx].unsqueeze(-1)).view(m, j, k)
        if self.q8 is None or self.block_scale_f32 is None:
            return None
        m, j = idx.shape
        k = self.shape[1]
        rows = self.q8[idx].float().view(m, j, k // GROUP, GROUP)
        return (rows * self.block_scale_f32[idx].unsqueeze(-1)).view(m, j, k)

    @property
    def nbytes(self) -> int:
        """Bytes held: the quantized weight, its scales, and the dense copy if any."""
        held = [self.dense, self._dense_packed, self.packed, self.scales_zeros, self.q8,
                self.row_scale, self.block_scale_f32, self.q4, self.group_scale_f32,
                self.group_zero_f32, self.gemv_w, self.gemv_s, self.amx_codes, self.amx_sz]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def quantized_bytes(self) -> int:
        """Bytes of the quantized weight and its scales alone (what batch 1 reads)."""
        if self.gemv_w is not None and self.gemv_s is not None:
            return (self.gemv_w.numel() * self.gemv_w.element_size()
                    + self.gemv_s.numel() * self.gemv_s.element_size())
        if self.packed is not None and self.scales_zeros is not None:
            return (self.packed.numel() * self.packed.element_size()
                    + self.scales_zeros.numel() * self.scales_zeros.element_size())
        assert self.q8 is not None and self.row_scale is not None
        return self.q8.numel() + self.row_scale.numel() * self.row_scale.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] (+ bias)."""
        if (self._gemv_call is not None and bias is None and x.shape[0] <= GEMV_MAX_ROWS
                and x.dtype == self.dtype and self.kind == "int4" and x.is_contiguous()):
            return self._gemv_call(x)  # batch 1's path, with as few checks as it needs
        x = x.contiguous()
        if x.dtype != self.dtype:
            raise TypeError(f"activations are {x.dtype}, the quantized weight serves {self.dtype}")
        rows = x.shape[0]
        if (self._amx is not None and self.kind == "int4"
                and amx.MIN_ROWS <= rows <= amx.MAX_ROWS):
            assert self.amx_codes is not None and self.amx_sz is not None
            out = self._amx.q4(x, self.amx_codes, self.amx_sz, self.shape[0])
            return out if bias is None else out + bias
        if rows > self.kernel_rows and self._dense_packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._dense_packed, bias, "none", [], "")
        if rows > self.kernel_rows and self.dense is not None:
            return F.linear(x, self.dense, bias)
        if rows <= GEMV_MAX_ROWS and self.gemv_w is not None:
            out = self._gemv(x)
            out = out if out.dtype == self.dtype else out.to(self.dtype)
        elif self.kind != "int8":
            out = self._int4(x)
        else:
            out = torch.ops.aten._weight_int8pack_mm(x, self.q8, self.row_scale)
        return out if bias is None else out + bias


def refined_logits(head: QuantLinear | ConcatLinear | None, x: torch.Tensor,
                   logits: torch.Tensor, top: int = REFINE_TOP) -> torch.Tensor:
    """float32 logits whose ``top`` largest per row are computed again in float32 from the
    quantized head's stored rows (:meth:`QuantLinear.rows_float`): bfloat16 logits of magnitude
    16-32 are 0.125 apart, so near-ties of greedy decoding would be decided by rounding
    (the rest keep the served precision)."""
    out = logits.float()
    if not isinstance(head, QuantLinear) or top <= 0:
        return out
    k = min(top, out.shape[1])
    idx = out.topk(k, dim=-1).indices  # [M, k]
    rows = head.rows_float(idx)  # [M, k, K]
    if rows is None:
        return out
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
