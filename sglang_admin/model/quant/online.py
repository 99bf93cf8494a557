"""Weight-only quantization of a dense checkpoint at load, under SGLang's
``--torchao-config`` names: ``int8wo`` (int8, one scale per output row) and
``int4wo-<group>`` (4 bits, a scale and a zero per ``group`` inputs, group 32, 64, 128 or
256). The same kernels and dense copy as GGUF weights kept quantized (model/quant/linear.py);
torchao itself is not needed (its CPU paths call these same torch kernels)."""

from __future__ import annotations

from typing import Any

import torch

from sglang_admin.model.quant.gguf_blocks import int4_quantize, int8_rows
from sglang_admin.model.quant.gguf_load import install, projection_groups
from sglang_admin.model.quant.linear import QuantLinear
from sglang_admin.model.quant.shard import sum_row_parallel
from sglang_admin.model.quant.store import QuantStore

TORCHAO_CONFIGS = ("int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256")


def _quantized(weight: torch.Tensor, scheme: str, dtype: torch.dtype,
               keep_rows: bool = False) -> QuantLinear | None:
    values = weight.detach().float().numpy()
    if scheme == "int8wo":
        return QuantLinear(int8_rows(values), dtype)
    group = int(scheme.split("-")[1])
    if values.shape[1] % group:
        return None  # stays dense: its inputs are not whole groups
    # keep_rows (the LM head): its top logits refined in float32 (linear.refined_logits)
    return QuantLinear(int4_quantize(values, group), dtype, keep_rows=keep_rows)


def quantize_loaded(model: Any, scheme: str, dtype: torch.dtype,
                    head: bool = True) -> QuantStore:
    """Quantize a loaded model's projections and LM head (not with ``head`` false: an
    embedding model's, never multiplied with) as ``scheme`` says, in place; the store that
    serves them."""
    if scheme not in TORCHAO_CONFIGS:
        raise ValueError(f"torchao config {scheme!r} is not supported "
                         f"(supported: {', '.join(TORCHAO_CONFIGS)})")
    store = QuantStore("")
    kept = dense = 0
    # a base model's checkpoint (model/embedding_spec.py's unprefixed): its names, as the
    # model's parameters are named, lack "model."
    prefix = "" if getattr(getattr(model, "spec", None), "unprefixed", False) else "model."
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            pre = f"{prefix}layers.{i}."
            for owner, fused_attr, modules, names in projection_groups(layer):
                weight = getattr(owner, fused_attr) if fused_attr else modules[0].weight
                projection = _quantized(weight, scheme, dtype)
                if projection is None:
                    dense += 1
                    continue
                install(store, owner, fused_attr, modules, [f"{pre}{n}.weight" for n in names],
                        projection, dtype)
                kept += 1
        lm_head = (_quantized(model.output_weight(), scheme, dtype, keep_rows=True)
                   if head else None)
        if lm_head is None:
            dense += head
        elif model.config.tie_word_embeddings:
            lm_head.set_dense(model.model.embed_tokens.weight.detach())
            store.add(model.model.embed_tokens.weight, lm_head)
            store.tied_head = lm_head
            kept += 1
        else:
            install(store, model, None, [model.lm_head], ["lm_head.weight"], lm_head, dtype)
            kept += 1
    # --tp-size > 1: each rank quantized its shard (a row-parallel shard's groups and
    # per-row scales over its own inputs); the row-parallel outputs summed over the ranks
    sum_row_parallel(store, model)
    store.summary = (f"weights quantized at load ({scheme}): {kept} projections kept "
                     f"quantized, {dense} dense (inputs not whole groups); norms and the "
                     "embedding lookup dense")
    store.scheme = scheme
    return store
