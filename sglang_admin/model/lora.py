"""Multi-LoRA for the Llama family: PEFT adapters read, checked and served in one batch.

Reading (:func:`read_adapter`): a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``, read with safetensors; peft itself is not needed) is checked
against the base model: every target among q/k/v/o/gate/up/down, rank at most
``--max-lora-rank``, every tensor of the shape the base model's projection implies. The
scaling is PEFT's: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

Serving (:class:`LoraBuffers`): the model keeps q/k/v and gate/up fused, so adapters are
grouped the same way. Per layer and group, every slot's A matrices sit side by side in one
``[in, k * slots * R]`` matrix, and per target every slot's B (scaling folded in) in one
``[slots * R, out_j]`` matrix (k: targets of the group, R: ``--max-lora-rank``; a smaller
rank is zero-padded). A forward then adds, for all tokens of the batch at once,
``((x @ A) * onehot(slot)) @ B_j`` into target j's slice of the fused output: one matmul and
a mask per group plus one matmul per target, whatever the mix of adapters (tokens of the
base model get a zero row). No Python loop over requests or adapters runs in a layer.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_admin.model.config import LlamaConfig
from sglang_admin.model.llama import LlamaForCausalLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# group -> its targets, in the order of the fused output
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_GROUP_OF = {t: g for g, ts in GROUPS.items() for t in ts}
# --tp-size > 1: groups whose base projection is split by its input (rows of the math, the
# columns of the weight) and summed over the TP ranks; their LoRA delta is summed too.
ROW_PARALLEL = frozenset({"o", "down"})
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class LoraAdapterError(ValueError):
    """The adapter cannot be served on this base model; the message says why."""


@dataclass
class AdapterWeights:
    """A checked adapter: per (layer, target) its A [r, in] and scaled B [out, r]."""

    rank: int
    scaling: float
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )


def served_config(model: LlamaForCausalLM) -> LlamaConfig:
    """The config adapters are checked against: the checkpoint's whole one (at
    --tp-size > 1 the model is built from a shard's)."""
    tensor_parallel = getattr(model, "tensor_parallel", None)
    return model.config if tensor_parallel is None else tensor_parallel.full_config


def target_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA target of the base model."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isdir(path):
        raise LoraAdapterError(f"adapter path {path!r} is not a directory")
    if not os.path.isfile(cfg_path):
        raise LoraAdapterError(f"missing file: {ADAPTER_CONFIG} not found in {path!r}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"{ADAPTER_CONFIG} in {path!r} is unreadable: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoraAdapterError(f"{ADAPTER_CONFIG} in {path!r} is not a JSON object")
    return cfg


def _targets(cfg: dict) -> tuple[str, ...]:
    raw = cfg.get("target_modules")
    if raw in ("all-linear", "all_linear"):
        return TARGETS
    if isinstance(raw, str):  # PEFT: a regex over module names
        found = tuple(t for t in TARGETS if re.fullmatch(raw, t) or re.search(raw, f".{t}"))
        if not found:
            raise LoraAdapterError(f"target_modules {raw!r} matches no supported module")
        return found
    if not isinstance(raw, list) or not raw:
        raise LoraAdapterError("adapter_config.json has no target_modules")
    names = [str(n).rsplit(".", 1)[-1] for n in raw]
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        raise LoraAdapterError(
            f"unknown target module(s) {', '.join(unknown)}: this base model takes LoRA on "
            f"{', '.join(TARGETS)}"
        )
    return tuple(t for t in TARGETS if t in names)


def _check_supported(cfg: dict) -> None:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraAdapterError(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise LoraAdapterError(f"{key}={bad} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraAdapterError(f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoraAdapterError(f"{key} is not supported (one rank and alpha per adapter)")
    for key in ("modules_to_save", "lora_bias", "target_parameters", "trainable_token_indices",
                "layer_replication"):
        if cfg.get(key):
            raise LoraAdapterError(f"{key} is not supported")


def read_adapter(path: str, model_cfg: LlamaConfig, max_rank: int) -> AdapterWeights:
    """Read and check a PEFT LoRA adapter against the base model; raises LoraAdapterError.

    Tensors come back in float32 on the CPU, B already multiplied by the scaling.
    """
    cfg = _read_config(path)
    _check_supported(cfg)
    try:
        rank = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError):
        raise LoraAdapterError("adapter_config.json lacks a valid rank r") from None
    if rank <= 0:
        raise LoraAdapterError(f"rank r={rank} must be positive")
    if rank > max_rank:
        raise LoraAdapterError(f"rank r={rank} exceeds --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = _targets(cfg)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        raise LoraAdapterError(f"missing file: {ADAPTER_WEIGHTS} not found in {path!r}")
    tensors = _load_tensors(weights_path)
    shapes = target_shapes(model_cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _KEY.search(name)
        if m is None:
            raise LoraAdapterError(f"unsupported tensor {name!r} (only LoRA A/B of projections)")
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS:
            raise LoraAdapterError(f"unknown target module {target!r} in tensor {name!r}")
        if target not in targets:
            raise LoraAdapterError(f"tensor {name!r} targets {target}, not in target_modules")
        if layer >= model_cfg.num_layers:
            raise LoraAdapterError(
                f"tensor {name!r}: layer {layer} does not exist (the base model has "
                f"{model_cfg.num_layers} layers)"
            )
        fan_in, fan_out = shapes[target]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise LoraAdapterError(
                f"shape mismatch: {name} is {list(tensor.shape)}, the base model expects "
                f"{list(want)} (r={rank})"
            )
        pairs.setdefault((layer, target), {})[which] = tensor
    if not pairs:
        raise LoraAdapterError(f"{ADAPTER_WEIGHTS} in {path!r} holds no LoRA weights")
    out = AdapterWeights(rank=rank, scaling=scaling, targets=targets)
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            lacking = "B" if "A" in ab else "A"
            raise LoraAdapterError(f"layers.{layer}.{target}: lora_{lacking} is missing")
        out.weights[(layer, target)] = (
            ab["A"].to(torch.float32), ab["B"].to(torch.float32) * scaling
        )
    return out


def _load_tensors(weights_path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(weights_path, device="cpu")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LoraAdapterError(f"{weights_path}: unreadable safetensors: {exc}") from None


@dataclass
class LoraBatch:
    """Which slot each token of the current forward uses (set by the runner)."""

    onehot: torch.Tensor | None = None  # [T, 1, slots, 1] in the model dtype; None: none uses one


class LayerLora:
    """The LoRA delta of one decoder layer, called from its projections.

    Per group, A is ``[in, k * slots * R]`` (target-major: target j's columns for every
    slot are one block) and each target's B is ``[slots * R, out_j]``, so the delta of
    target j is one matmul that adds into its own slice of the fused output.
    """

    def __init__(
        self, batch: LoraBatch, slots: int, rank: int,
        a: dict[str, torch.Tensor], b: dict[str, list[tuple[int, int, torch.Tensor]]],
        reduce: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        self.batch = batch
        self.reduce = reduce  # --tp-size > 1: sums a row-parallel group's delta over ranks
        self.slots = slots
        self.rank = rank
        self.a = a  # group -> [in, k * slots * R]
        self.b = b  # group -> per target: (start, size) of its output slice, B [slots * R, size]
        self.active: dict[str, int] = dict.fromkeys(GROUPS, 0)  # group -> adapters using it

    def delta(self, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add into out [T, out] the LoRA delta of every token's adapter for this group's
        input x [T, in] (tokens of the base model have a zero one-hot row); returns out."""
        onehot = self.batch.onehot
        if onehot is None or not self.active[group]:
            return out
        n = x.shape[0]
        targets = self.b[group]
        h = torch.mm(x, self.a[group]).view(n, len(targets), self.slots, self.rank)
        h = (h * onehot).view(n, len(targets), self.slots * self.rank)
        if self.reduce is not None and group in ROW_PARALLEL:
            # this rank's input is a slice: its delta is a part, summed over the TP ranks
            # (the base output it adds to was summed already)
            (_, _, b), = targets
            part = torch.mm(h[:, 0], b)
            self.reduce(part)
            return out.add_(part)
        for j, (start, size, b) in enumerate(targets):
            out[:, start : start + size].addmm_(h[:, j], b)
        return out


class LoraBuffers:
    """Every slot's adapter weights, stacked per layer and group, hooked into the model."""

    def __init__(
        self, model: LlamaForCausalLM, slots: int, max_rank: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.cfg = model.config
        self.tensor_parallel = getattr(model, "tensor_parallel", None)  # tp > 1: cut A/B
        self.slots, self.max_rank = slots, max_rank
        self.dtype, self.device = dtype, device
        self.batch = LoraBatch()
        self._arange = torch.arange(slots, device=device)
        shapes = target_shapes(self.cfg)
        self.layers: list[LayerLora] = []
        width = slots * max_rank
        for layer in model.model.layers:
            a: dict[str, torch.Tensor] = {}
            b: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
            for group, targets in GROUPS.items():
                fan_in = shapes[targets[0]][0]
                a[group] = torch.zeros(fan_in, len(targets) * width, dtype=dtype, device=device)
                b[group], start = [], 0
                for t in targets:
                    size = shapes[t][1]
                    b[group].append((start, size, torch.zeros(width, size, dtype=dtype,
                                                              device=device)))
                    start += size
            reduce = None if self.tensor_parallel is None else self.tensor_parallel.all_reduce
            hook = LayerLora(self.batch, slots, max_rank, a, b, reduce)
            self.layers.append(hook)
            layer.self_attn.lora = hook
            layer.mlp.lora = hook
        self.slot_targets: list[tuple[str, ...]] = [() for _ in range(slots)]

    def nbytes(self) -> int:
        """Bytes held by the stacked buffers."""
        tensors = [t for h in self.layers for t in h.a.values()]
        tensors += [b for h in self.layers for parts in h.b.values() for _, _, b in parts]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Put an adapter into a slot (whatever the slot held before is overwritten)."""
        self.clear(slot)
        r, rows = adapter.rank, slot * self.max_rank
        width = self.slots * self.max_rank
        with torch.no_grad():
            for (layer, target), (a, b) in adapter.weights.items():
                a, b = self._shard(layer, target, a, b)
                group = _GROUP_OF[target]
                j = GROUPS[group].index(target)
                hook = self.layers[layer]
                col = j * width + rows
                hook.a[group][:, col : col + r] = a.t().to(self.dtype)
                hook.b[group][j][2][rows : rows + r] = b.t().to(self.dtype)
        self.slot_targets[slot] = adapter.targets
        self._count(adapter.targets, +1)

    def _shard(self, layer: int, target: str, a: torch.Tensor,
               b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This TP rank's part of a target's (A, B), cut as the base weight is: B's rows
        for a column-parallel projection (q/k/v, gate/up), A's columns for a row-parallel
        one (o, down); the whole pair at tp 1."""
        tp = self.tensor_parallel
        if tp is None:
            return a, b
        module = "self_attn" if target in GROUPS["qkv"] or target == "o_proj" else "mlp"
        base = f"model.layers.{layer}.{module}.{target}.weight"
        if _GROUP_OF[target] in ROW_PARALLEL:
            return tp.shard(base, a), b
        return a, tp.shard(base, b)

    def clear(self, slot: int) -> None:
        """Zero a slot and stop counting its targets."""
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        width = self.slots * self.max_rank
        with torch.no_grad():
            for hook in self.layers:
                for group, parts in hook.b.items():
                    for j, (_, _, b) in enumerate(parts):
                        b[rows] = 0
                        hook.a[group][:, j * width + rows.start : j * width + rows.stop] = 0
        self._count(self.slot_targets[slot], -1)
        self.slot_targets[slot] = ()

    def _count(self, targets: tuple[str, ...], step: int) -> None:
        for group in {_GROUP_OF[t] for t in targets}:
            for hook in self.layers:
                hook.active[group] += step

    def prepare(self, token_slots: list[int]) -> None:
        """Set the slot of every token of the next forward (-1: the base model)."""
        if max(token_slots, default=-1) < 0:
            self.batch.onehot = None
            return
        idx = torch.tensor(token_slots, dtype=torch.int64).to(self.device, non_blocking=True)
        onehot = (idx.unsqueeze(1) == self._arange).to(self.dtype)
        self.batch.onehot = onehot.view(len(token_slots), 1, self.slots, 1)
