"""Load a GGUF file's projections kept quantized into a model built from its converted
directory (model/gguf.py's conversion still provides config, tokenizer and the tensors that
stay dense: norms, the embedding, any projection of a type that is not kept).

:func:`attach_gguf` reads the quantized tensors straight from the file, repacks them
(model/quant/gguf_blocks.py) and replaces the model's projection weights with placeholders
on the meta device, whose matmuls the returned :class:`QuantStore` serves
(``QuantStore.linear_with``): any path that is not routed through it fails loudly on a
meta tensor instead of computing with stale numbers. What it repacks is saved for the next
start (model/quant/prepared.py).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np
import torch
from torch import nn

from sglang_admin.model.gguf import _PERMUTED_QK, GgufError, hf_name, open_gguf, unpermute_rows
from sglang_admin.model.quant import amx, gemv, linear
from sglang_admin.model.quant.flags import gguf_source
from sglang_admin.model.quant.gguf_blocks import (
    Int4Groups,
    Int8Blocks,
    Int8Rows,
    int4_groups,
    int8_blocks,
    int8_rows,
    plan_for,
)
from sglang_admin.model.quant.linear import ConcatLinear, Projection, QuantLinear
from sglang_admin.model.quant.prepared import Prepared, prepared_once
from sglang_admin.model.quant.shard import Kept, shard_kept, sum_row_parallel
from sglang_admin.model.quant.store import QuantStore

QUANTIZATION_GGUF = "gguf"
__all__ = ["QUANTIZATION_GGUF", "attach_gguf", "finish_tied_head", "gguf_source"]
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _read(g: Any, tensor: Any, target: str, heads: int, kv_heads: int
          ) -> Kept:
    """One tensor as its plan wants it, q/k rows unpermuted like the conversion does."""
    from gguf import GGMLQuantizationType, quants

    type_name = GGMLQuantizationType(int(tensor.tensor_type)).name
    n, k = (int(d) for d in reversed(tensor.shape.tolist()))
    plan = plan_for(type_name)
    try:
        if plan == "int4":
            value: Kept = int4_groups(np.asarray(tensor.data), type_name, n, k)
        elif plan == "int8x32":
            value = int8_blocks(np.asarray(tensor.data), n, k)
        else:
            dense = np.asarray(quants.dequantize(np.asarray(tensor.data), tensor.tensor_type),
                               dtype=np.float32).reshape(n, k)
            value = int8_rows(dense) if plan == "int8" else dense
    except Exception as exc:  # noqa: BLE001 - a short or corrupt block
        raise GgufError(f"{os.path.basename(g.path)}: cannot read {tensor.name} "
                        f"({type(exc).__name__}: {exc})") from None
    if g.arch in _PERMUTED_QK and target.endswith(("q_proj.weight", "k_proj.weight")):
        order = unpermute_rows(np.arange(n), heads if "q_proj" in target else kv_heads)
        value = value[order] if isinstance(value, np.ndarray) else value.take_rows(order)
    return value


def _fuse(parts: list[Kept], dtype: torch.dtype, dense_copy: bool,
          keep_rows: bool = False) -> Projection | None:
    """One projection for row-concatenated parts; None when none of them is quantized
    (``keep_rows``: an LM head's, see QuantLinear)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return None
    if all(isinstance(p, Int4Groups) for p in parts) and len({p.group for p in parts}) == 1:
        return QuantLinear(Int4Groups(np.concatenate([p.q for p in parts]),
                                      np.concatenate([p.scale for p in parts]),
                                      np.concatenate([p.zero for p in parts]),
                                      parts[0].group),
                           dtype, dense_copy, keep_rows)
    if all(isinstance(p, Int8Blocks) for p in parts):
        return QuantLinear(Int8Blocks(np.concatenate([p.q for p in parts]),
                                      np.concatenate([p.scale for p in parts])),
                           dtype, dense_copy, keep_rows)
    if all(isinstance(p, Int8Rows) for p in parts):
        return QuantLinear(Int8Rows(np.concatenate([p.q for p in parts]),
                                    np.concatenate([p.scale for p in parts])),
                           dtype, dense_copy)
    return ConcatLinear([torch.from_numpy(p).to(dtype) if isinstance(p, np.ndarray)
                         else QuantLinear(p, dtype, dense_copy) for p in parts])


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def projection_groups(layer: Any) -> tuple[tuple[Any, str | None, list[Any], list[str]], ...]:
    """A decoder layer's projections as they are kept quantized: (the module owning the fused
    weight, its attribute or None, the projections, their checkpoint names in the layer)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        (attn, "qkv_weight", [attn.q_proj, attn.k_proj, attn.v_proj],
         ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        (attn, None, [attn.o_proj], ["self_attn.o_proj"]),
        (mlp, "gate_up_weight", [mlp.gate_proj, mlp.up_proj], ["mlp.gate_proj", "mlp.up_proj"]),
        (mlp, None, [mlp.down_proj], ["mlp.down_proj"]),
    )


def attach_gguf(model: Any, gguf_file: str, dtype: torch.dtype, *, dense_copy: bool = True,
                head: bool = True) -> tuple[QuantStore, set[str]]:
    """Load ``gguf_file``'s kept projections into ``model`` (a LlamaForCausalLM already
    allocated and fused); (the store, the Hugging Face names it loaded). The caller loads
    every other name dense and then calls :func:`finish_tied_head`. ``head`` false (an
    embedding model, which never computes logits): the LM head is not kept quantized.

    The projections come prepared from the file's converted directory when an earlier start
    saved them there (model/quant/prepared.py), else they are read and repacked from the
    file and saved for the next start. At --tp-size > 1 (``model.tensor_parallel``) each
    rank reads the file and keeps its shard (model/quant/shard.py; nothing is saved), and
    the row-parallel projections' outputs are summed over the ranks
    (``QuantStore.reduce_outputs``)."""
    from sglang_admin.model.gguf import converted_dir

    tensor_parallel = getattr(model, "tensor_parallel", None)
    try:
        model_dir: str | None = converted_dir(gguf_file)
    except OSError:
        model_dir = None
    if (model_dir is not None and os.path.isdir(model_dir) and dense_copy
            and tensor_parallel is None):
        prepared = prepared_once(model_dir, dtype, lambda: read_projections(
            model, gguf_file, dtype, dense_copy))
    else:
        prepared = read_projections(model, gguf_file, dtype, dense_copy)
    store = QuantStore(prepared.summary)
    loaded: set[str] = set()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            pre = f"model.layers.{i}."
            for owner, fused_attr, modules, names in projection_groups(layer):
                names = [f"{pre}{n}.weight" for n in names]
                projection = prepared.projections.get(tuple(names))
                if projection is not None:
                    install(store, owner, fused_attr, modules, names, projection, dtype)
                    loaded.update(names)
        lm_head = prepared.projections.get(("lm_head.weight",)) if head else None
        if lm_head is not None and not model.config.tie_word_embeddings:
            install(store, model, None, [model.lm_head], ["lm_head.weight"], lm_head, dtype)
            loaded.add("lm_head.weight")
        if prepared.tied_head is not None and head:
            # tied: the embedding stays dense for lookups, the LM head reads it quantized
            store.add(model.model.embed_tokens.weight, prepared.tied_head)
            store.tied_head = prepared.tied_head
    sum_row_parallel(store, model)
    return store, loaded


def read_projections(model: Any, gguf_file: str, dtype: torch.dtype,
                     dense_copy: bool) -> Prepared:
    """``gguf_file``'s kept projections read and repacked, fused as ``model`` fuses them."""
    g = open_gguf(gguf_file)
    heads = int(g.arch_key("attention.head_count"))
    kv_heads = int(g.arch_key("attention.head_count_kv", heads))
    values: dict[str, Kept] = {}
    types: Counter[str] = Counter()
    from gguf import GGMLQuantizationType

    for tensor in g.reader.tensors:
        target = hf_name(tensor.name)
        if target is None:
            raise GgufError(f"{os.path.basename(g.path)}: tensor {tensor.name!r} has no "
                            f"counterpart in a {g.arch} model", "FAILED_PRECONDITION")
        type_name = GGMLQuantizationType(int(tensor.tensor_type)).name
        is_proj = target == "lm_head.weight" or any(f".{p}.weight" in target for p in _PROJ)
        tied_head = target == "model.embed_tokens.weight" and model.config.tie_word_embeddings
        if not (is_proj or tied_head) or len(tensor.shape) != 2:
            continue
        plan = plan_for(type_name)
        types[f"{type_name}->{plan}"] += 1
        if plan == "dense" and not is_proj:
            continue
        values[target] = shard_kept(_read(g, tensor, target, heads, kv_heads), target,
                                    getattr(model, "tensor_parallel", None))
    prepared = Prepared()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            pre = f"model.layers.{i}."
            for _, _, _, names in projection_groups(layer):
                names = [f"{pre}{n}.weight" for n in names]
                if any(n not in values for n in names):
                    continue
                projection = _fuse([values[n] for n in names], dtype, dense_copy)
                if projection is not None:
                    prepared.projections[tuple(names)] = projection
        if "lm_head.weight" in values and not model.config.tie_word_embeddings:
            projection = _fuse([values["lm_head.weight"]], dtype, dense_copy, keep_rows=True)
            if projection is not None:
                prepared.projections[("lm_head.weight",)] = projection
        embed = values.get("model.embed_tokens.weight")
        if embed is not None and not isinstance(embed, np.ndarray):
            prepared.tied_head = QuantLinear(embed, dtype, dense_copy=False, keep_rows=True)
    kept = ", ".join(f"{n} x{c}" for n, c in sorted(types.items()))
    if dtype == torch.float32:
        kept += " (float32 activations: every step through the dense copy, see linear.py)"
    elif gemv.gemv_kernel() is not None:
        kept += (f"; steps of up to {linear.GEMV_MAX_ROWS} rows of int4 and int8x32 through "
                 "the few-row AVX512_VNNI kernel (model/quant/gemv.py)")
    if dtype == torch.bfloat16 and amx.amx_kernel() is not None:
        kept += (f"; steps of {amx.MIN_ROWS}-{amx.MAX_ROWS} rows of int4 (and an int8x32 LM "
                 "head's logits) through the AMX kernel (model/quant/amx.py)")
    prepared.summary = (f"GGUF weights kept quantized ({os.path.basename(gguf_file)}): {kept}; "
                        "int4: torch's _weight_int4pack_mm_for_cpu (groups of 32), int8x32: "
                        "the same kernel on two 4-bit halves (the blocks' scales as stored), "
                        "int8: _weight_int8pack_mm (per row, requantized); norms and the "
                        "embedding lookup dense")
    return prepared


def install(store: QuantStore, owner: Any, fused_attr: str | None, modules: list[nn.Linear],
             names: list[str], projection: Projection, dtype: torch.dtype) -> None:
    """Replace the modules' weights by meta placeholders served by ``projection``."""
    sizes = [m.out_features for m in modules]
    k = modules[0].in_features
    whole = _placeholder((sum(sizes), k), dtype)
    if fused_attr is not None:
        setattr(owner, fused_attr, whole)
        parts = whole.split(sizes)
    else:
        parts = (whole,)
    row = 0
    for module, part, name, size in zip(modules, parts, names, sizes):
        module.weight = nn.Parameter(part, requires_grad=False)
        store.by_name[name] = (projection, row, row + size)
        row += size
    store.add(whole if fused_attr is not None else modules[0].weight, projection)


def finish_tied_head(model: Any, store: QuantStore, dense_copy: bool) -> None:
    """After the dense load: a tied LM head's batched rows read the (dense) embedding."""
    head = store.tied_head
    if head is not None and dense_copy:
        head.set_dense(model.model.embed_tokens.weight.detach())
