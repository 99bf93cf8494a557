"""CPU kernels of the forward pass in float32: decode attention, RMSNorm, RoPE, silu * up,
small-batch projections, and a decode step's whole decoder layer in one call; and in
bfloat16 the non-matmul ops of a layer (decode attention read in place from the pool,
prefill attention as a flash kernel on AVX512_BF16, RMSNorm, RoPE with the new K/V written,
SwiGLU's product) and argmax.

Torch's decode path gathers every sequence's K and V rows into padded tensors and runs
``scaled_dot_product_attention`` per group of similar length: on a CPU step that copy and the
kernel's per-call cost were a third of a decode step at 64 streams. ``csrc/cpu_kernels.c``
reads the rows where they are, through the request-to-token table. It also does RMSNorm, RoPE
and SwiGLU's product in one pass each, where torch spends several ops (a memory pass and a few
microseconds of dispatch each; silu on the strided gate half alone took 10 ms of a 2048-token
prefill layer). At decode batch sizes even that is most of a step: ``decode_layer`` runs a
layer's ~15 ops in one call, with projections blocked for a few rows (torch's GEMM repacks
every weight matrix per call, which costs more than the arithmetic at 1-16 rows).

This module calls the kernels through ctypes (which releases the GIL, so lanes run them at
once); model/cpu_kernels_build.py builds, checks and loads the library.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from sglang_admin.model.decode_batch import DecodeBatch, DecodeLayerWeights

logger = logging.getLogger(__name__)

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
class CpuKernels:
    """The built library: decode attention (``attend``), prefill attention
    (``extend_attend``), ``rms_norm``, ``rope``, ``silu_mul``, ``linear`` (small
    batches), ``argmax`` (greedy tokens) and a decode step's whole decoder layer
    (``decode_layer``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        self._fn = lib.decode_attention
        self._fn.restype = None
        self._fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                             _I64, ctypes.c_float, _I64, _PTR, _PTR]
        self._norm = lib.rms_norm
        self._norm.restype = None
        self._norm.argtypes = [_PTR, _PTR, _I64, _I64, ctypes.c_float, _PTR]
        self._silu_mul = lib.silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_PTR, _I64, _I64, _PTR]
        self._rope = lib.rope
        self._rope.restype = None
        self._rope.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR]
        self._linear = lib.linear_nt
        self._linear.restype = None
        self._linear.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64,
                                 ctypes.c_int, _PTR]
        self._argmax = lib.argmax_rows
        self._argmax.restype = None
        self._argmax.argtypes = [_PTR, _I64, _I64, _PTR]
        self._extend = lib.extend_attention
        self._extend.restype = ctypes.c_int
        self._extend.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                                 ctypes.c_float, _I64, _PTR, _PTR]
        self._extend_applies = lib.extend_attention_applies
        self._extend_applies.restype = ctypes.c_int
        self._extend_applies.argtypes = [_I64]
        self._extend_bf16 = lib.extend_attention_bf16
        self._extend_bf16.restype = ctypes.c_int
        self._extend_bf16.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                                      ctypes.c_float, _I64, _PTR]
        self._extend_bf16_seqs = lib.extend_attention_bf16_seqs  # model/extend_batch.py
        self._extend_bf16_seqs.restype = ctypes.c_int
        self._extend_bf16_seqs.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64,
                                           _I64, _I64, _I64, ctypes.c_float, _I64, _PTR]
        self._extend_bf16_amx = lib.extend_attention_bf16_amx  # model/extend_batch.py
        self._extend_bf16_amx.restype = ctypes.c_int
        self._extend_bf16_amx.argtypes = [ctypes.c_int]
        self._extend_bf16_applies = lib.extend_attention_bf16_applies
        self._extend_bf16_applies.restype = ctypes.c_int
        self._extend_bf16_applies.argtypes = [_I64]
        self._rope_store = lib.rope_store
        self._rope_store.restype = None
        self._rope_store.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR,
                                     _PTR, _PTR]
        self._add_norm = lib.add_rms_norm
        self._add_norm.restype = None
        self._add_norm.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _PTR]
        # bfloat16 (uint16 storage), float32 inside (csrc/cpu_kernels.c's second half)
        self._norm_bf16 = lib.rms_norm_bf16
        self._norm_bf16.restype = None
        self._norm_bf16.argtypes = self._norm.argtypes
        self._add_norm_bf16 = lib.add_rms_norm_bf16
        self._add_norm_bf16.restype = None
        self._add_norm_bf16.argtypes = self._add_norm.argtypes
        self._silu_mul_bf16 = lib.silu_mul_bf16
        self._silu_mul_bf16.restype = None
        self._silu_mul_bf16.argtypes = self._silu_mul.argtypes
        self._rope_store_bf16 = lib.rope_store_bf16
        self._rope_store_bf16.restype = None
        self._rope_store_bf16.argtypes = self._rope_store.argtypes
        self._argmax_bf16 = lib.argmax_rows_bf16
        self._argmax_bf16.restype = None
        self._argmax_bf16.argtypes = self._argmax.argtypes
        self._attend_bf16 = lib.decode_attention_bf16
        self._attend_bf16.restype = None
        self._attend_bf16.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64,
                                      _I64, _I64, ctypes.c_float, _I64, _PTR, _I64, _PTR]
        self._rope_attend_bf16 = lib.rope_attend_bf16
        self._rope_attend_bf16.restype = None
        self._rope_attend_bf16.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR,
                                           _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR,
                                           ctypes.c_float, _I64, _PTR, _I64, _PTR]
        # whether the bfloat16 kernels agreed with torch at load (load_cpu_kernels sets it)
        self.bf16 = False
        self._layer = lib.decode_layer
        self._layer.restype = None
        self._layer.argtypes = ([_PTR, _I64, _I64, _I64, ctypes.c_float] + [_PTR] * 16
                                + [_I64, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_float, _I64,
                                   _PTR, _PTR])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x**2, -1) + eps))`` of a contiguous float32 or bfloat16
        x (bfloat16: normalised in float32, rounded, then times the weight, as
        transformers' LlamaRMSNorm); ``out``: where to write it (x's shape and dtype,
        contiguous), else a new tensor."""
        fn = self._norm if x.dtype == torch.float32 else self._norm_bf16
        _check_dtypes("rms_norm", x, weight)
        if not (x.is_contiguous() and weight.is_contiguous()) or weight.numel() != x.shape[-1]:
            raise ValueError("rms_norm kernel: a tensor is not laid out as expected")
        out = _out_like(x, out, "rms_norm")
        dim = x.shape[-1]
        fn(x.data_ptr(), weight.data_ptr(), x.numel() // dim if dim else 0, dim, eps,
           out.data_ptr())
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """The residual add and the next norm in one pass: ``x += delta`` in place (rounded
        as torch's add in x's dtype), then :meth:`rms_norm` of the new x (into ``out`` when
        given). x, delta [T, D] contiguous, float32 or bfloat16."""
        fn = self._add_norm if x.dtype == torch.float32 else self._add_norm_bf16
        _check_dtypes("add_rms_norm", x, delta, weight)
        if not (x.is_contiguous() and delta.is_contiguous() and weight.is_contiguous()
                and delta.shape == x.shape and weight.numel() == x.shape[-1]):
            raise ValueError("add_rms_norm kernel: a tensor is not laid out as expected")
        out = _out_like(x, out, "add_rms_norm")
        dim = x.shape[-1]
        fn(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), x.numel() // dim if dim else 0,
           dim, eps, out.data_ptr())
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """rotary.apply_rope: x [T, H, D] (heads contiguous, any token stride), cos and signed
        sin [T, 1, D] contiguous -> a contiguous [T, H, D]; float32 or bfloat16 (each
        product and the sum rounded, as torch's bfloat16 ops)."""
        tokens, heads, dim = x.shape
        _check_dtypes("rope", x, cos, sin)
        if not (x.stride(2) == 1 and x.stride(1) == dim and dim % 2 == 0
                and cos.is_contiguous() and sin.is_contiguous()
                and cos.numel() == tokens * dim == sin.numel()):
            raise ValueError("rope kernel: a tensor is not laid out as expected")
        out = torch.empty(tokens, heads, dim, dtype=x.dtype)
        if x.dtype == torch.float32:
            self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads,
                       dim, out.data_ptr())
        else:
            self._rope_store_bf16(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                                  tokens, heads, 0, dim, out.data_ptr(), None, None, None)
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   out_slots: torch.Tensor) -> torch.Tensor:
        """A fused qkv [T, H + 2 KV, D] (heads contiguous, any token stride): its q and k heads
        rotated (:meth:`rope`) -> a contiguous [T, H + KV, D], and the rotated k and the v
        heads written to the pools [slots, KV, D] at ``out_slots`` [T] (int64). The caller
        guarantees the slots are in the pools (the runner validated the table)."""
        tokens, width, dim = qkv.shape
        kv_heads = k_cache.shape[1]
        _check_dtypes("rope_store", qkv, cos, sin, k_cache, v_cache)
        if not (qkv.stride(2) == 1 and qkv.stride(1) == dim and dim % 2 == 0
                and width == heads + 2 * kv_heads and k_cache.is_contiguous()
                and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                and k_cache.shape[2] == dim and cos.is_contiguous() and sin.is_contiguous()
                and cos.numel() == tokens * dim == sin.numel()
                and out_slots.dtype == torch.int64 and out_slots.is_contiguous()
                and out_slots.numel() == tokens):
            raise ValueError("rope_store kernel: a tensor is not laid out as expected")
        rotated = heads + kv_heads
        out = torch.empty(tokens, rotated, dim, dtype=qkv.dtype)
        fn = self._rope_store if qkv.dtype == torch.float32 else self._rope_store_bf16
        fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, rotated,
           kv_heads, dim, out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
           out_slots.data_ptr())
        return out

    def rope_attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor,
                    table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, scale: float,
                    window: int | None, scores: torch.Tensor,
                    rotated: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    longest: int | None = None) -> torch.Tensor:
        """A bfloat16 decode step's attention in one call: :meth:`rope_store` of the fused qkv
        [n, H + 2 KV, D] (into ``rotated`` [n, H + KV, D] when given), then :meth:`attend` of
        the rotated q heads (table, rows, lens, scores as there) -> [n, H * D] (into ``out``
        when given); ``longest``: max(lens) where the caller knows it. The caller guarantees the slots are in the pools and the lengths within
        the table (the runner validated them)."""
        n, width, dim = qkv.shape
        kv_heads = k_cache.shape[1]
        _check_dtypes("rope_attend", qkv, cos, sin, k_cache, v_cache)
        if not (qkv.dtype == torch.bfloat16 and qkv.stride(2) == 1 and qkv.stride(1) == dim
                and dim % 2 == 0 and width == heads + 2 * kv_heads and kv_heads
                and heads % kv_heads == 0 and k_cache.is_contiguous()
                and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                and k_cache.shape[2] == dim and cos.is_contiguous() and sin.is_contiguous()
                and cos.numel() == n * dim == sin.numel() and out_slots.dtype == torch.int64
                and out_slots.is_contiguous() and out_slots.numel() == n
                and table.is_contiguous() and rows.is_contiguous() and lens.is_contiguous()
                and rows.numel() == n == lens.numel()):
            raise ValueError("rope_attend kernel: a tensor is not laid out as expected")
        if longest is None:
            longest = int(lens.max()) if n else 0
        if scores.numel() < (heads // kv_heads) * longest:
            raise ValueError(f"rope_attend kernel: scores scratch of {scores.numel()} floats "
                             f"for {heads // kv_heads} heads x {longest} keys")
        if rotated is None:
            rotated = torch.empty(n, heads + kv_heads, dim, dtype=qkv.dtype)
        elif not (rotated.shape == (n, heads + kv_heads, dim) and rotated.dtype == qkv.dtype
                  and rotated.is_contiguous()):
            raise ValueError("rope_attend kernel: rotated is not laid out as expected")
        if out is None:
            out = torch.empty(n, heads * dim, dtype=qkv.dtype)
        elif not (out.shape == (n, heads * dim) and out.dtype == qkv.dtype
                  and out.is_contiguous()):
            raise ValueError("rope_attend kernel: out is not laid out as expected")
        if n:
            self._rope_attend_bf16(
                qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), n, heads,
                kv_heads, dim, rotated.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                out_slots.data_ptr(), table.data_ptr(), table.shape[1], rows.data_ptr(),
                lens.data_ptr(), scale, window or 0, scores.data_ptr(), scores.numel(),
                out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of a contiguous [T, 2 * I] float32 or bfloat16 (gate first) ->
        [T, I] (bfloat16: silu rounded, then the product), into ``out`` when given."""
        _check_dtypes("silu_mul", gate_up)
        if not gate_up.is_contiguous() or gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError("silu_mul kernel: a tensor is not laid out as expected")
        rows, half = gate_up.shape[0], gate_up.shape[1] // 2
        if out is None:
            out = torch.empty(rows, half, dtype=gate_up.dtype)
        elif not (out.shape == (rows, half) and out.dtype == gate_up.dtype
                  and out.is_contiguous()):
            raise ValueError("silu_mul kernel: out is not laid out as expected")
        fn = self._silu_mul if gate_up.dtype == torch.float32 else self._silu_mul_bf16
        fn(gate_up.data_ptr(), rows, half, out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` of a contiguous float32 x [M, K], weight [N, K]: a
        few rows at a time against each block of weight rows (what decode batches need).
        ``out``: where to write it, an [M, N] float32 whose rows may be a wider tensor's (a
        column slice: threads each writing their part of the logits)."""
        if not (x.dim() == 2 and x.is_contiguous() and weight.is_contiguous()
                and weight.shape[1] == x.shape[1]
                and (bias is None or (bias.is_contiguous() and bias.numel() == weight.shape[0]))):
            raise ValueError("linear kernel: a tensor is not laid out as expected")
        rows, k = x.shape
        n = weight.shape[0]
        if out is None:
            out = torch.empty(rows, n, dtype=torch.float32)
        elif not (out.shape == (rows, n) and out.dtype == torch.float32
                  and (n <= 1 or out.stride(1) == 1)):
            raise ValueError("linear kernel: out is not laid out as expected")
        pack = torch.empty(_packed_floats(rows, k), dtype=torch.float32)
        self._linear(x.data_ptr(), k, rows, k, weight.data_ptr(), n,
                     None if bias is None else bias.data_ptr(), out.data_ptr(),
                     out.stride(0) if rows > 1 else n, 0, pack.data_ptr())
        return out

    def argmax(self, x: torch.Tensor) -> list[int]:
        """``x.argmax(dim=-1).tolist()`` of a contiguous float32 or bfloat16 x [R, C] (the
        greedy tokens of a step's logits), without torch's per-row reduction cost."""
        if not (x.dim() == 2 and x.is_contiguous() and x.dtype in _DTYPES):
            raise ValueError("argmax kernel: a tensor is not laid out as expected")
        rows = x.shape[0]
        out = (ctypes.c_int64 * rows)()
        fn = self._argmax if x.dtype == torch.float32 else self._argmax_bf16
        fn(x.data_ptr(), rows, x.shape[1], out)
        return list(out)

    def extend_applies(self, head_dim: int, dtype: torch.dtype = torch.float32) -> bool:
        """Whether :meth:`extend_attend` runs for this head size and dtype in this build:
        float32 with AVX2 and a multiple of 32; bfloat16 with AVX512_BF16, a multiple of 32 up
        to 256, and the bfloat16 kernels checked against torch at load (``bf16``)."""
        if dtype == torch.bfloat16:
            return self.bf16 and bool(self._extend_bf16_applies(head_dim))
        return dtype == torch.float32 and bool(self._extend_applies(head_dim))

    def extend_attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor, prefix: int, scale: float,
                      window: int | None) -> torch.Tensor:
        """Causal attention of a prefill chunk: q [n, H, D] (a token stride of its own, heads
        contiguous) at positions prefix..prefix+n-1 against the keys and values of positions
        [0, prefix + n), read from the pools [slots, KV, D] (the chunk's rows already written)
        at ``slots`` (int64, the sequence's table row) -> [n, H * D]; a sliding window keeps
        each query's last ``window`` keys. Where :meth:`extend_applies` (else ValueError);
        when it is the faster path is the caller's to decide (model/attention/choice.py's :func:`extend_kernel_takes`).

        float32: one thread. bfloat16 (q and pools): a flash-attention kernel on AVX512_BF16
        spread over torch's threads, with the numerics of torch's CPU flash kernel in
        bfloat16 (float32 scores and softmax, probabilities rounded to bfloat16 for P.V, the
        output rounded once) -> [n, H * D] bfloat16.

        The caller guarantees the slots are in the pools (the runner validated them when it
        wrote the table)."""
        n, heads, dim = q.shape
        _check_dtypes("extend attention", q, k_cache, v_cache)
        kv_heads = k_cache.shape[1]
        length = prefix + n
        if not (q.stride(2) == 1 and q.stride(1) == dim and k_cache.is_contiguous()
                and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                and k_cache.dim() == 3 and k_cache.shape[2] == dim
                and slots.dtype == torch.int64 and slots.is_contiguous()
                and slots.numel() == length and prefix >= 0):
            raise ValueError("extend attention kernel: a tensor is not laid out as expected")
        if q.dtype == torch.bfloat16:
            out = torch.empty(n, heads * dim, dtype=torch.bfloat16)
            if not (n and heads % max(kv_heads, 1) == 0 and self._extend_bf16_applies(dim)
                    and self._extend_bf16(q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                                          v_cache.data_ptr(), slots.data_ptr(), prefix, n,
                                          heads, kv_heads, dim, scale, window or 0,
                                          out.data_ptr())):
                raise ValueError(f"extend attention kernel: no bfloat16 path for {n} tokens of "
                                 f"{heads} heads of {dim} over {kv_heads} kv heads here")
            return out
        padded = -(-length // 16) * 16
        group = heads // max(kv_heads, 1)
        scratch = torch.empty(dim * padded + dim * length + group * padded, dtype=torch.float32)
        out = torch.empty(n, heads * dim, dtype=torch.float32)
        if not self._extend(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                            slots.data_ptr(), prefix, n, heads, kv_heads, dim, scale,
                            window or 0, scratch.data_ptr(), out.data_ptr()):
            raise ValueError(f"extend attention kernel: no fast path for {heads} heads of "
                             f"{dim} over {kv_heads} kv heads in this build")
        return out

    def decode_layer(self, x: torch.Tensor, layer: DecodeLayerWeights, cos: torch.Tensor,
                     sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out_slots: torch.Tensor, batch: DecodeBatch) -> None:
        """One decoder layer of a decode step, in place on the residual stream x [M, hidden]:
        the new K/V are written at ``out_slots``, then attended with the batch's sequences.
        cos/sin: rotary.RotaryEmbedding's [M, 1, D]. The caller guarantees float32 CPU tensors,
        contiguous, shaped as ``layer`` says (``LlamaForCausalLM`` checks once per step)."""
        rows = x.shape[0]
        heads, kv_heads, dim = layer.heads, layer.kv_heads, layer.head_dim
        need = rows * (x.shape[1] + (2 * heads + 3 * kv_heads) * dim + heads * dim
                       + 3 * layer.intermediate)
        need += _packed_floats(rows, max(x.shape[1], heads * dim, layer.intermediate))
        scratch = batch.layer_scratch(need)
        batch.check_scores(heads)
        ptr = _ptr
        self._layer(x.data_ptr(), rows, x.shape[1], layer.intermediate, layer.eps,
                    ptr(layer.ln1), ptr(layer.w_qkv), ptr(layer.b_qkv), ptr(layer.w_o),
                    ptr(layer.b_o), ptr(layer.ln2), ptr(layer.w_gate_up), ptr(layer.b_gate_up),
                    ptr(layer.w_down), ptr(layer.b_down), cos.data_ptr(), sin.data_ptr(),
                    k_cache.data_ptr(), v_cache.data_ptr(), out_slots.data_ptr(),
                    batch.table.data_ptr(), batch.table.shape[1], batch.rows.data_ptr(),
                    batch.lens.data_ptr(), heads, kv_heads, dim, layer.scale,
                    layer.window or 0, batch.scores.data_ptr(), scratch.data_ptr())

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, scale: float,
               window: int | None, scores: torch.Tensor) -> torch.Tensor:
        """q [n, H, D] (heads contiguous), pools [slots, KV, D], table [R, ctx] int64 slots,
        rows/lens [n] int64 (each sequence's table row and length, its new token included),
        scores a float32 scratch of at least H * max(lens) -> [n, H * D]. q and the pools in
        float32, or all three in bfloat16 (computed in float32, the output rounded; each
        sequence x kv head a task, spread over torch's threads: as many as the scores scratch
        holds G * max(lens) floats for, so the kv heads at least; in bfloat16 with AVX512_BF16,
        a batch of 4 sequences a thread or more goes a sequence a task, the scores in a
        buffer of each thread's own, the same bits).

        The caller guarantees what C cannot check: CPU tensors, rows and slots in range, lens
        within the table's width (the runner validates every sequence first).
        """
        n, heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        _check_dtypes("attention", q, k_cache, v_cache)
        if not (q.stride(2) == 1 and q.stride(1) == dim and k_cache.is_contiguous()
                and v_cache.is_contiguous() and table.is_contiguous()
                and rows.is_contiguous() and lens.is_contiguous()):
            raise ValueError("cpu kernels: a tensor is not laid out as expected")
        out = torch.empty(n, heads * dim, dtype=q.dtype)
        if n and q.dtype == torch.bfloat16:
            self._attend_bf16(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                              table.data_ptr(), table.shape[1], rows.data_ptr(), lens.data_ptr(),
                              n, heads, kv_heads, dim, scale, window or 0, scores.data_ptr(),
                              scores.numel(), out.data_ptr())
        elif n:
            self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                     table.data_ptr(), table.shape[1], rows.data_ptr(), lens.data_ptr(), n,
                     heads, kv_heads, dim, scale, window or 0, scores.data_ptr(),
                     out.data_ptr())
        return out


_DTYPES = (torch.float32, torch.bfloat16)


def _check_dtypes(name: str, first: torch.Tensor, *others: torch.Tensor) -> None:
    """Every tensor float32, or every one bfloat16; ValueError otherwise (a plain loop: it
    runs before every kernel call of a bfloat16 step)."""
    dtype = first.dtype
    if dtype is torch.float32 or dtype is torch.bfloat16:
        for t in others:
            if t.dtype is not dtype:
                break
        else:
            return
    raise ValueError(f"{name} kernel: float32 or bfloat16 tensors of one dtype, got "
                     f"{', '.join(str(t.dtype) for t in (first, *others))}")


def _out_like(x: torch.Tensor, out: torch.Tensor | None, name: str) -> torch.Tensor:
    """``out`` checked to be a contiguous tensor of x's shape and dtype, or a new one."""
    if out is None:
        return torch.empty_like(x)
    if not (out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()):
        raise ValueError(f"{name} kernel: out is not laid out as expected")
    return out


def _packed_floats(rows: int, width: int) -> int:
    """linear_nt's scratch for ``rows`` inputs of ``width``: panels of 16 rows."""
    return -(-rows // 16) * 16 * width


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
