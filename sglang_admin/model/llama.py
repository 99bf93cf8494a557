"""One torch implementation of the Llama family of decoder-only transformers.

LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM differ only in
details (attention bias, per-head q/k RMSNorm, sliding windows, RoPE scaling), so one
module tree covers them all. Parameter names follow the Hugging Face checkpoints
(``model.layers.N.self_attn.q_proj.weight`` ...), so a safetensors state dict loads as is.

This module wires the model together; its parts live apart: model/config.py (the config),
model/rotary.py (RoPE), model/layers.py (RMSNorm, MLP) and model/attention/ (the metadata
the runner builds per forward, and the paged attention paths). A forward handles a whole
continuous batch at once: the new tokens of all sequences are flattened into one ``[T]``
axis, decode sequences (one new token each) first, then extend sequences (prefill chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_admin.model.attention import AttentionMetadata, paged_attention
from sglang_admin.model.config import LlamaConfig
from sglang_admin.model.decode_batch import DecodeLayerWeights
from sglang_admin.model.layers import MLP, RMSNorm
from sglang_admin.model.rotary import RotaryEmbedding, apply_rope, rope_inv_freq

# F.linear's signature: (x [M, K], weight [N, K], bias [N] or None) -> [M, N]
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

__all__ = ["Attention", "DecoderLayer", "LlamaConfig", "LlamaForCausalLM", "LlamaModel"]


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV pool."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.lora: Any = None  # model/lora.py's LayerLora once LoRA is enabled
        self.kernels: Any = None  # model/cpu_kernels.py's CpuKernels (CPU float32, bfloat16)

    def fuse(self) -> None:
        """Concatenate q/k/v weights into one matrix; the HF-named params become views of it."""
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        self.qkv_weight = weight
        sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        for proj, part in zip((self.q_proj, self.k_proj, self.v_proj), weight.split(sizes)):
            proj.weight = nn.Parameter(part, requires_grad=False)
        if self.q_proj.bias is not None:
            bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
            self.qkv_bias = bias
            for proj, part in zip((self.q_proj, self.k_proj, self.v_proj), bias.split(sizes)):
                proj.bias = nn.Parameter(part, requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        linear: Linear | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the new K/V into the pool first. ``linear``:
        what computes the projections in place of ``F.linear`` (the runner's, cut among
        threads), where there is no LoRA or the weight is kept quantized."""
        n_tok = x.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None and linear is not None and (
                self.lora is None or self.qkv_weight.is_meta):
            # with LoRA only a weight kept quantized (model/quant/: a meta placeholder) goes
            # through ``linear``, the store's matmul; the delta is added below either way
            qkv = linear(x, self.qkv_weight, self.qkv_bias)
        elif self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.lora is not None:
            qkv = self.lora.delta("qkv", x, qkv)
        qkv = qkv.view(n_tok, h + 2 * kv, d)
        v = qkv[:, h + kv :]
        if self.kernels is not None and not self.qk_norm:
            # q and k rotated and the new k and v written to the pool, in one pass
            rotated = self.kernels.rope_store(qkv, cos, sin, h, k_cache, v_cache, meta.out_slots)
            q, k = rotated.split([h, kv], dim=1)
        else:
            rope = apply_rope if self.kernels is None else self.kernels.rope
            if self.qk_norm:
                q = rope(self.q_norm(qkv[:, :h]), cos, sin)
                k = rope(self.k_norm(qkv[:, h : h + kv]), cos, sin)
            else:  # rotate q and k heads in one go
                q, k = rope(qkv[:, : h + kv], cos, sin).split([h, kv], dim=1)
            k_cache.index_copy_(0, meta.out_slots, k)
            v_cache.index_copy_(0, meta.out_slots, v)
        out = paged_attention(q, k, v, meta, k_cache, v_cache, self.scale, self.sliding_window,
                              self.kernels)
        if self.lora is not None:
            base = (linear(out, self.o_proj.weight, self.o_proj.bias)
                    if linear is not None and self.o_proj.weight.is_meta else self.o_proj(out))
            return self.lora.delta("o", out, base)
        if linear is not None:
            return linear(out, self.o_proj.weight, self.o_proj.bias)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        linear: Linear | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache, linear)
        norm = self.post_attention_layernorm
        if norm.kernels is not None and x.is_contiguous() and attn.is_contiguous():
            # the residual add and the norm in one pass, x updated in place (a fresh tensor:
            # the embedding's output or the previous layer's sum)
            h = norm.kernels.add_rms_norm(x, attn, norm.weight, norm.eps)
            return x.add_(self.mlp(h, linear))
        x = x + attn
        return x + self.mlp(norm(x), linear)

    def forward_deferred(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        linear: Linear | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` with the residual adds left to the norms after them: ``delta``,
        the previous layer's MLP output not yet added to x (None: none), is added by this
        layer's input norm in the same pass (the CPU kernels' ``add_rms_norm``, x updated in
        place), and this layer's MLP output is handed back unadded. Returns (x, delta): the
        layer's output is x + delta (delta None: x). The same arithmetic as :meth:`forward`
        (one bfloat16 rounding per add either way), one pass over the activations less per
        layer."""
        norm = self.input_layernorm
        if delta is None:
            h = norm(x)
        elif norm.kernels is not None and x.is_contiguous() and delta.is_contiguous():
            h = norm.kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        else:
            x = x.add_(delta)
            h = norm(x)
        attn = self.self_attn(h, cos, sin, meta, k_cache, v_cache, linear)
        norm = self.post_attention_layernorm
        if norm.kernels is not None and x.is_contiguous() and attn.is_contiguous():
            h = norm.kernels.add_rms_norm(x, attn, norm.weight, norm.eps)
            return x, self.mlp(h, linear)
        x = x + attn
        return x + self.mlp(norm(x), linear), None

    def decodes_in_bf16_kernels(self) -> bool:
        """Whether a bfloat16 decode step can run this layer through
        :meth:`LlamaForCausalLM.decode_bf16` (the CPU kernels, fused weights, no LoRA, no
        per-head q/k norms)."""
        attn, mlp = self.self_attn, self.mlp
        return (attn.kernels is not None and attn.lora is None and mlp.lora is None
                and not attn.qk_norm and attn.qkv_weight is not None
                and mlp.gate_up_weight is not None
                and attn.qkv_weight.dtype == torch.bfloat16)

    def decode_weights(self) -> DecodeLayerWeights | None:
        """This layer as ``CpuKernels.decode_layer`` reads it; None where that does not apply
        (torch's ops, LoRA, per-head q/k norms, weights not fused or not contiguous)."""
        attn, mlp = self.self_attn, self.mlp
        if (attn.kernels is None or attn.lora is not None or mlp.lora is not None
                or attn.qk_norm or attn.qkv_weight is None or mlp.gate_up_weight is None
                or attn.qkv_weight.dtype != torch.float32):  # its projections: float32 only
            return None
        weights = DecodeLayerWeights(
            self.input_layernorm.weight, attn.qkv_weight, attn.qkv_bias, attn.o_proj.weight,
            attn.o_proj.bias, self.post_attention_layernorm.weight, mlp.gate_up_weight,
            mlp.gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias, attn.num_heads,
            attn.num_kv_heads, attn.head_dim, mlp.down_proj.in_features,
            self.input_layernorm.eps, attn.scale, attn.sliding_window,
            lambda: attn.lora is not None or mlp.lora is not None)
        tensors = (weights.ln1, weights.w_qkv, weights.b_qkv, weights.w_o, weights.b_o,
                   weights.ln2, weights.w_gate_up, weights.b_gate_up, weights.w_down,
                   weights.b_down)
        if not all(t is None or t.is_contiguous() for t in tensors):
            return None
        return weights


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of checkpoints)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        # built on the meta device and loaded next: no random init (normal_ on a meta tensor
        # imports torch._dynamo, ~2 s of a rank's start-up)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size,
            _weight=torch.empty(cfg.vocab_size, cfg.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The causal LM for every supported architecture, over a paged KV pool."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        # every layer as CpuKernels.decode_layer reads it, built at the first decode step;
        # weights change in place (copy_), and whatever replaces tensors drops it
        self._decode_layers: list[DecodeLayerWeights] | None = None
        # model/quant/'s QuantStore when projections are kept quantized (their parameters
        # are then placeholders on the meta device, multiplied through it)
        self.quant: Any = None

    def output_weight(self) -> torch.Tensor:
        """The LM head matrix (the embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def weight_bytes(self) -> int:
        """Bytes held by the parameters (a fused matrix counted once, through its views), and
        by the quantized projections when some are kept quantized."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters() if not p.is_meta)
        return dense + (self.quant.nbytes if self.quant is not None else 0)

    def materialize_buffers(self, device: torch.device) -> None:
        """Recompute non-persistent buffers (RoPE frequencies, float32) on device.

        Needed after building the model on the meta device and assigning loaded weights.
        """
        self.rotary.inv_freq = rope_inv_freq(self.config)[0].to(device)

    def release_parameters(self) -> None:
        """Free every weight; shapes and dtypes stay (on the meta device).

        :meth:`allocate_parameters` gives the model storage again; weights are loaded next.
        """
        for layer in self.model.layers:
            layer.self_attn.qkv_weight = layer.self_attn.qkv_bias = None
            layer.mlp.gate_up_weight = layer.mlp.gate_up_bias = None
        self._decode_layers = None
        self.to_empty(device="meta")

    def allocate_parameters(self, device: torch.device) -> None:
        """Fresh, uninitialised parameters on device, fused as the forward wants them."""
        # to_empty(device) without its empty_like: on a meta tensor that runs torch's Python
        # reference, which imports sympy (~2 s of a rank's start-up); same sizes and strides
        self._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype,
                                                  device=device))
        self.materialize_buffers(device)
        self.fuse_projections()

    def use_cpu_kernels(self, kernels: Any) -> None:
        """RMSNorm, RoPE and SwiGLU through model/cpu_kernels.py's CpuKernels (None: torch's
        ops). The caller checks that they apply: float32 or bfloat16 weights on the CPU."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = kernels
        self._decode_layers = None

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up matmuls (call after loading weights; names keep working)."""
        with torch.no_grad():
            for layer in self.model.layers:
                layer.self_attn.fuse()
                layer.mlp.fuse()
        self._decode_layers = None

    def decode_layers(self) -> list[DecodeLayerWeights] | None:
        """Every layer for ``CpuKernels.decode_layer``, or None when one of them cannot go
        that way (see ``DecoderLayer.decode_weights``; LoRA is looked at every time)."""
        if self._decode_layers is None:
            layers = [layer.decode_weights() for layer in self.model.layers]
            self._decode_layers = [w for w in layers if w is not None]
        if len(self._decode_layers) != self.config.num_layers:
            return None
        if any(w.lora_hooks() for w in self._decode_layers):
            return None
        return self._decode_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        linear: Linear | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) of the flattened new tokens.
        ``linear``: the projections' matmul in place of ``F.linear`` (the runner's, which cuts
        each weight's rows among threads at real shapes); a decode step then takes the
        per-op path, each op through the CPU kernels where they apply."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        batch = meta.decode_batch
        if (batch is not None and meta.num_decode == x.shape[0] and x.dtype == torch.bfloat16
                and all([layer.decodes_in_bf16_kernels() for layer in self.model.layers])):
            return self.decode_bf16(x, cos, sin, meta, k_caches, v_caches, linear or F.linear)
        if batch is not None and meta.num_decode == x.shape[0] and linear is None:
            # decode only, CPU kernels: each layer in one call (no per-op dispatch)
            layers = self.decode_layers()
            if layers is not None:
                for i, weights in enumerate(layers):
                    batch.kernel.decode_layer(x, weights, cos, sin, k_caches[i], v_caches[i],
                                              meta.out_slots, batch)
                return x
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, delta = layer.forward_deferred(x, delta, cos, sin, meta, k_caches[i],
                                              v_caches[i], linear)
        return x if delta is None else x.add_(delta)

    def decode_bf16(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    meta: AttentionMetadata, k_caches: list[torch.Tensor],
                    v_caches: list[torch.Tensor], linear: Linear) -> torch.Tensor:
        """A bfloat16 decode step's layers through the CPU kernels, the projections through
        ``linear``: per layer two norms, each with the residual add before it (the MLP's add
        is the next layer's input norm's), RoPE + the K/V write + attention in one call, and
        SwiGLU's product, all into buffers made once per step; the same arithmetic as
        :class:`DecoderLayer` with the kernels, without its modules and per-op dispatch."""
        if self.quant is not None:  # every layer in one C call (batch 1-2, and 5-64 rows)
            from sglang_admin.model.quant import decode_step

            if decode_step.run(self, x, cos, sin, meta, k_caches, v_caches) is not None:
                return x
        batch = meta.decode_batch
        kernels = batch.kernel
        rows, hidden = x.shape
        normed = batch.buffer("normed", rows, hidden, x.dtype)
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm
            if delta is None:
                h = kernels.rms_norm(x, norm.weight, norm.eps, out=normed)
            else:
                h = kernels.add_rms_norm(x, delta, norm.weight, norm.eps, out=normed)
            qkv = linear(h, attn.qkv_weight, attn.qkv_bias)
            qkv = qkv.view(rows, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
            out = batch.rope_attend(qkv, cos, sin, attn.num_heads, k_caches[i], v_caches[i],
                                    meta.out_slots, attn.scale, attn.sliding_window)
            o = linear(out, attn.o_proj.weight, attn.o_proj.bias)
            norm = layer.post_attention_layernorm
            h = kernels.add_rms_norm(x, o, norm.weight, norm.eps, out=normed)
            gate_up = linear(h, mlp.gate_up_weight, mlp.gate_up_bias)
            act = batch.buffer("swiglu", rows, gate_up.shape[1] // 2, x.dtype)
            delta = linear(kernels.silu_mul(gate_up, out=act), mlp.down_proj.weight,
                           mlp.down_proj.bias)
        if delta is not None:
            x.add_(delta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for selected hidden rows (applies the final norm)."""
        kernels = self.model.norm.kernels
        weight = self.output_weight()
        if self.quant is not None:  # model/quant/: the head may be kept quantized
            return self.quant.logits(self.model.norm(hidden).contiguous(), weight, F.linear)
        if (kernels is not None and weight.is_contiguous()
                and weight.dtype == torch.float32):  # a few rows: see CpuKernels.linear
            return kernels.linear(self.model.norm(hidden).contiguous(), weight)
        return F.linear(self.model.norm(hidden), weight)

    def compute_logits_normed(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits of rows the final norm was applied to, through the quantized head."""
        return self.quant.logits(normed, self.output_weight(), F.linear)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of selected hidden rows, contiguous (for :meth:`logits_into`)."""
        return self.model.norm(hidden).contiguous()

    def logits_into(self, normed: torch.Tensor, out: torch.Tensor, start: int, end: int) -> None:
        """Vocabulary columns [start, end) of the logits of ``normed`` (:meth:`final_norm`'s)
        written to ``out`` [N, end - start] (a column slice of the whole logits): threads
        each computing a part of the LM head (model/runner.py)."""
        kernels = self.model.norm.kernels
        if self.quant is not None:  # model/quant/: the whole head, then the columns
            out.copy_(self.compute_logits_normed(normed)[:, start:end])
            return
        weight = self.output_weight()[start:end]
        if kernels is not None and weight.is_contiguous() and weight.dtype == torch.float32:
            kernels.linear(normed, weight, out=out)
        else:
            out.copy_(F.linear(normed, weight))
