"""A tensor-parallel rank's shard of a projection kept quantized (model/tensor_parallel.py's
cut, applied to the quantized values): a column-parallel projection (q/k/v, gate/up) keeps
its rows with their scales and zeros; a row-parallel one (o, down) keeps its inputs, cut on
whole groups of the scales (a cut inside a group is refused: one line says so). And the
sum over the ranks of the row-parallel outputs, which the store's matmul does
(:func:`sum_row_parallel`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sglang_admin.model.gguf import GgufError
from sglang_admin.model.quant.gguf_blocks import GROUP, Int4Groups, Int8Blocks, Int8Rows

Kept = Int4Groups | Int8Blocks | Int8Rows | np.ndarray
_ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")


def shard_kept(value: Kept, name: str, tensor_parallel: Any) -> Kept:
    """This rank's part of checkpoint tensor ``name`` read as ``value`` (whole where the
    ranks hold all of it, or at tp 1). Raises GgufError where a row-parallel cut would
    split a group of inputs sharing a scale."""
    tp = tensor_parallel
    if tp is None or not tp.is_split(name):
        return value
    if isinstance(value, np.ndarray):
        return _cut(tp, name, value)
    if not name.endswith(_ROW_PARALLEL):  # column-parallel: the same rows of every part
        if isinstance(value, Int4Groups):
            return Int4Groups(_cut(tp, name, value.q), _cut(tp, name, value.scale),
                              _cut(tp, name, value.zero), value.group)
        if isinstance(value, Int8Blocks):
            return Int8Blocks(_cut(tp, name, value.q), _cut(tp, name, value.scale))
        return Int8Rows(_cut(tp, name, value.q), _cut(tp, name, value.scale))
    k = value.q.shape[1]
    if isinstance(value, Int8Rows):  # one scale per output row: every rank keeps them all
        return Int8Rows(_cut(tp, name, value.q), value.scale)
    group = value.group if isinstance(value, Int4Groups) else GROUP
    if (k // group) % tp.size:
        raise GgufError(
            f"--tp-size {tp.size} cuts {name} (K={k}) inside its groups of {group} inputs "
            "that share a scale; serve with --gguf-dequantize", "FAILED_PRECONDITION")
    if isinstance(value, Int4Groups):
        return Int4Groups(_cut(tp, name, value.q), _cut(tp, name, value.scale),
                          _cut(tp, name, value.zero), value.group)
    return Int8Blocks(_cut(tp, name, value.q), _cut(tp, name, value.scale))


def _cut(tp: Any, name: str, array: np.ndarray) -> np.ndarray:
    """TensorParallel.shard on an array: the rows, or the columns (a row-parallel weight's
    values and its per-group scales alike: the same share of each)."""
    return np.ascontiguousarray(tp.shard(name, torch.from_numpy(array)).numpy())


def sum_row_parallel(store: Any, model: Any) -> None:
    """At --tp-size > 1 (``model.tensor_parallel``): ``store`` (a QuantStore) sums the
    outputs of every o_proj and down_proj matmul over the ranks, kept or dense (the
    modules' all-reduce hooks do not run when a matmul goes through the store); at tp 1
    nothing."""
    tp = getattr(model, "tensor_parallel", None)
    if tp is None:
        return
    store.reduce_outputs(tp.all_reduce, [
        w for layer in model.model.layers
        for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)])
