"""Tensor parallelism: one model replica split across ``--tp-size`` rank processes.

Design (docs/tensor-parallel.md). The ranks of a replica join one torch.distributed
process group (gloo on CPU, nccl on CUDA) at ``tcp://127.0.0.1:PORT``, a fresh port per
replica chosen by the server at launch. TP rank 0 owns the replica's scheduler, its ZMQ
sockets and every decision: each step it broadcasts the step's batch (the ``SeqInput``
list, as msgpack bytes in a tensor: multinode/wire.py, never pickle) and every other TP rank
runs the same forward
on its shard and discards what it sampled (scheduler/tp/worker.py). SGLang instead runs
the whole scheduler on every TP rank with rank 0's inputs broadcast; here one scheduler per
replica is simpler and cannot drift: the followers hold no scheduling state at all, only
the KV pool slots the batch names. Every forward then runs its all-reduces in one order
on every rank (one lane per step: ``ServerArgs.rank_lanes`` is 1 at tp > 1).

Sharding (Megatron style): q/k/v and gate/up are split by heads and columns, o_proj and
down_proj by rows, each followed by a sum all-reduce (their biases are kept by TP rank 0
alone so that the sum adds them once). KV heads are split too, or replicated when the
TP ranks outnumber them (as SGLang does: each rank keeps the one KV head its query heads
read). The embedding, the final norm and the LM head are replicated: the simplest choice,
and for the small vocabularies served on CPU the LM head is a small share of the step.
A model built from :meth:`TensorParallel.shard_config` has exactly the shard shapes, and
``load_weights`` (model/loader.py) cuts each full checkpoint tensor through
:meth:`TensorParallel.shard_weights`, so start-up and every weight update load the same way.

Nothing here runs at tp 1: the model has no hooks and ``load_weights`` no extra step.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from sglang_admin.model.config import LlamaConfig
from sglang_admin.multinode import wire

# A follower waits for its leader's next step for as long as the server runs: an idle
# worker must not time out (a dead leader ends the server, whose death kills the rank).
_IDLE_TIMEOUT = datetime.timedelta(days=365)

_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks; the message says why."""


@dataclasses.dataclass
class TensorParallel:
    """This process's place in its replica's TP group, and how it cuts the model."""

    rank: int
    size: int
    group: dist.ProcessGroup | None
    device: torch.device
    full_config: LlamaConfig | None = None  # set by load_model: the checkpoint's config
    # --nnodes > 1: TP ranks per node (rank t lives on node t // ranks_per_node); 0: one host
    ranks_per_node: int = 0
    # bytes this rank has broadcast (rank 0) or received (the others) as commands
    wire_bytes: list[int] = dataclasses.field(default_factory=lambda: [0])

    # ---------------------------------------------------------------- shapes

    def shard_config(self) -> LlamaConfig:
        """The per-rank config: heads, KV heads and the MLP width divided by ``size``."""
        cfg = self.full_config
        n = self.size
        if cfg.num_heads % n:
            raise TensorParallelError(
                f"--tp-size {n} does not divide the {cfg.num_heads} attention heads")
        if cfg.intermediate_size % n:
            raise TensorParallelError(
                f"--tp-size {n} does not divide the MLP width {cfg.intermediate_size}")
        kv = cfg.num_kv_heads
        if kv % n and n % kv:
            raise TensorParallelError(
                f"--tp-size {n} and the {kv} KV heads: one must divide the other")
        return dataclasses.replace(
            cfg, num_heads=cfg.num_heads // n, num_kv_heads=max(1, kv // n),
            intermediate_size=cfg.intermediate_size // n)

    def _kv_heads(self) -> tuple[int, int]:
        """(first KV head, count) this rank keeps: a slice, or the one its queries read."""
        kv, n = self.full_config.num_kv_heads, self.size
        if kv >= n:
            return self.rank * (kv // n), kv // n
        return self.rank // (n // kv), 1

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor ``name`` (replicated ones whole)."""
        match = _LAYER.match(name)
        if match is None:
            return tensor
        proj, kind = match.group(2), match.group(3)
        cfg, r, n = self.full_config, self.rank, self.size
        if proj == "q_proj":
            rows = cfg.num_heads // n * cfg.head_dim
            return tensor.narrow(0, r * rows, rows)
        if proj in ("k_proj", "v_proj"):
            first, count = self._kv_heads()
            return tensor.narrow(0, first * cfg.head_dim, count * cfg.head_dim)
        if proj in ("gate_proj", "up_proj"):
            rows = cfg.intermediate_size // n
            return tensor.narrow(0, r * rows, rows)
        if proj in ("o_proj", "down_proj"):
            if kind == "bias":  # added once: by rank 0, before the sum
                # new_zeros, not zeros_like: on a meta tensor (a refit's shape check) that
                # runs torch's Python reference, whose first call imports sympy
                return tensor if r == 0 else tensor.new_zeros(tensor.shape)
            cols = tensor.shape[1] // n
            return tensor.narrow(1, r * cols, cols)
        return tensor  # q_norm / k_norm (per head_dim): replicated

    def full_shape(self, name: str, shard_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The full checkpoint shape of ``name``, whose shard on this rank is
        ``shard_shape`` (the shape a trainer sends: every rank receives the whole tensor)."""
        match = _LAYER.match(name)
        if match is None:
            return tuple(shard_shape)
        proj, kind = match.group(2), match.group(3)
        cfg, n, shape = self.full_config, self.size, list(shard_shape)
        if proj in ("q_proj", "gate_proj", "up_proj"):
            shape[0] *= n
        elif proj in ("k_proj", "v_proj"):
            shape[0] = cfg.num_kv_heads * cfg.head_dim
        elif proj in ("o_proj", "down_proj") and kind == "weight":
            shape[1] *= n
        return tuple(shape)

    def is_split(self, name: str) -> bool:
        """Whether ranks hold different parts of ``name`` (else each holds all of it)."""
        match = _LAYER.match(name)
        return match is not None and match.group(2) in (
            "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj")

    def unshard(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor ``name`` from every rank's shard (TP rank order): the inverse
        of :meth:`shard` (GetWeightsByName reads it whole)."""
        match = _LAYER.match(name)
        if match is None or not self.is_split(name):
            return shards[0]
        proj, kind = match.group(2), match.group(3)
        if proj in ("o_proj", "down_proj"):
            return shards[0] if kind == "bias" else torch.cat(shards, dim=1)
        kv, n = self.full_config.num_kv_heads, self.size
        if proj in ("k_proj", "v_proj") and kv < n:  # replicated: one copy per KV head
            return torch.cat([shards[i * (n // kv)] for i in range(kv)], dim=0)
        return torch.cat(shards, dim=0)

    def shard_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` (full tensors, Hugging Face names) cut to this rank's shards."""
        for name, tensor in weights:
            yield name, self.shard(name, tensor)

    # ---------------------------------------------------------------- the model

    def install(self, model: torch.nn.Module) -> None:
        """Sum the row-parallel outputs (o_proj, down_proj) over the group after each call,
        and let ``load_weights`` find this object (``model.tensor_parallel``)."""
        model.tensor_parallel = self
        for layer in model.model.layers:
            layer.self_attn.o_proj.register_forward_hook(self._sum_output)
            layer.mlp.down_proj.register_forward_hook(self._sum_output)

    def _sum_output(self, _module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=self.group)
        return output

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place (a row-parallel LoRA delta)."""
        dist.all_reduce(tensor, group=self.group)

    # ---------------------------------------------------------------- control

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (msgpack, multinode/wire.py); the others pass
        nothing."""
        return wire.broadcast(obj, self.rank, self.group, self.device, self.wire_bytes)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in TP rank order, on every rank (msgpack, as above)."""
        return wire.gather(obj, self.size, self.group, self.device)

    def name(self, tp_rank: int) -> str:
        """How a message names TP rank ``tp_rank``: "TP rank 1", with its node when the
        replica spans several ("TP rank 1 (node 1)")."""
        if not self.ranks_per_node:
            return f"TP rank {tp_rank}"
        return f"TP rank {tp_rank} (node {tp_rank // self.ranks_per_node})"

    def barrier(self) -> None:
        """Wait until every rank of the replica got here (start-up: all models loaded)."""
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Leave the group (at shutdown)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def join_tensor_parallel(init_method: str, tp_rank: int, tp_size: int,
                         dev: torch.device) -> TensorParallel:
    """Join this replica's group on ``dev`` (every TP rank calls it; blocks until all have)
    through ``init_method`` (torch.distributed's: ``file://PATH``, ``tcp://HOST:PORT``):
    nccl on CUDA, gloo on the CPU."""
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method,
                            rank=tp_rank, world_size=tp_size, timeout=_IDLE_TIMEOUT)
    return TensorParallel(tp_rank, tp_size, dist.group.WORLD, dev)
