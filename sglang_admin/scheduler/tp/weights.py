"""The weight and memory ops across the TP ranks of a replica (--tp-size > 1): what TP
rank 0 asks of its followers, and what a follower does with its own shard.

TP rank 0 runs each op as at tp 1 (scheduler/ops/weight_sync_control.py, weight_control.py) and
sends the followers the command first, through the replica's group (:class:`Followers`).
A trainer's group is joined by every TP rank at its own rank, SGLang's convention:
``rank_offset + dp_rank x tp_size + tp_rank``; every TP rank receives each whole tensor the
trainer broadcasts, or reads it from shared memory, and keeps its shard (model/pushed_weights.py
cuts it as model/loader.py cuts a checkpoint's). Joining and receiving block for as long as
the trainer takes, so a follower runs them on its own weight-sync thread and goes on
following the steps; TP rank 0 collects every follower's outcome when its own is in
(:meth:`Followers.collect`). GetWeightsByName gathers the shards and joins them into the
full tensor; CheckWeights gathers one digest per TP rank; a memory release or resume runs
on every TP rank (a resume that runs out of memory on one is undone on all), and a resume of
the weights reloads every shard from the checkpoint.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from sglang_admin.model.dist_group import join_group
from sglang_admin.model.loader import iter_checkpoint, load_weights
from sglang_admin.model.pushed_weights import check_manifest, load_from_segment, receive_weights
from sglang_admin.model.runner import ModelRunner, ResumeOutOfMemory
from sglang_admin.model.tensor_parallel import TensorParallel
from sglang_admin.model.weight_names import resolve
from sglang_admin.model.weights import weights_digest
from sglang_admin.scheduler.ops.weight_groups import WeightGroups

logger = logging.getLogger(__name__)

JOIN, RECEIVE, COLLECT, DESTROY = "join", "receive", "collect", "destroy"
SEGMENT, READ, DIGEST, MEMORY, LOAD = "segment", "read", "digest", "memory", "load"
WEIGHT_COMMANDS = frozenset({JOIN, RECEIVE, COLLECT, DESTROY, SEGMENT, READ, DIGEST, MEMORY,
                             LOAD})
# The ModelRunner methods a MEMORY command may name, each with the one that undoes it.
MEMORY_OPS = {"release_kv_cache": None, "release_weights": None,
              "resume_kv_cache": "release_kv_cache", "resume_weights": "release_weights"}
COLLECT_MARGIN_S = 5.0  # a follower's job ends by its own budget; this covers the hand-off


def group_rank(rank_offset: int, dp_rank: int, tp_size: int, tp_rank: int) -> int:
    """A TP rank's rank in a trainer's group: SGLang's rank_offset + its global rank."""
    return rank_offset + dp_rank * tp_size + tp_rank


def first_failure(outcomes: list[str | None], first_tp_rank: int = 1) -> str | None:
    """"TP rank k: why" for the first outcome that is an error (None: every one succeeded)."""
    for k, why in enumerate(outcomes, start=first_tp_rank):
        if why is not None:
            return f"TP rank {k}: {why}"
    return None


def replica_digest(digests: list[str]) -> str:
    """One digest of a whole replica: SHA-256 over its TP ranks' digests, in rank order."""
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


class TpResumeOutOfMemory(ResumeOutOfMemory):
    """A TP rank ran out of memory resuming; every TP rank released that memory again."""

    def __init__(self, message: str) -> None:
        RuntimeError.__init__(self, message)


def memory_op(runner: ModelRunner, op: str) -> int | str:
    """``runner.<op>()`` (one of :data:`MEMORY_OPS`): the bytes it released, or why it ran
    out of memory."""
    try:
        return getattr(runner, op)() or 0
    except ResumeOutOfMemory as exc:
        return str(exc)


def load_checkpoint(model: torch.nn.Module, path: str) -> str | None:
    """Load checkpoint ``path`` into this rank's shard; None, or why it failed."""
    try:
        load_weights(model, iter_checkpoint(path))
    except Exception as exc:  # noqa: BLE001 - reported to TP rank 0, which answers
        return _error_text(exc)
    return None


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else exc!r}"


class Followers:
    """TP rank 0's handle on the other TP ranks of its replica, for the weight ops."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def send(self, *command: Any) -> None:
        """Every follower starts ``command`` (a follower's command loop reads it next)."""
        self.tp.broadcast(command)

    def gather(self, mine: Any) -> list[Any]:
        """Every TP rank's answer to the command just sent, in TP rank order (``mine`` is
        rank 0's)."""
        return self.tp.gather(mine)

    def collect(self, timeout_s: float) -> list[str | None]:
        """The followers' outcomes of the job they run on their thread (None: it
        succeeded, else why not), waiting at most ``timeout_s`` for each."""
        self.send(COLLECT, timeout_s)
        return self.gather(None)[1:]

    def read(self, model: torch.nn.Module, name: str) -> torch.Tensor:
        """The full tensor ``name`` (which resolves), joined from every TP rank's shard."""
        self.send(READ, name)
        return full_tensor(model, self.tp, name, self.gather(local_part(model, self.tp, name)))

    def digests(self, model: torch.nn.Module) -> list[str]:
        """Every TP rank's digest of its own parameters, in TP rank order."""
        self.send(DIGEST)
        return self.gather(weights_digest(model))

    def memory(self, runner: ModelRunner, op: str) -> int:
        """Run ``op`` (a ModelRunner method of :data:`MEMORY_OPS`) on every TP rank; the
        bytes released on all. A resume that runs out of memory on any TP rank is undone on
        every one, then raises :class:`TpResumeOutOfMemory` naming it."""
        self.send(MEMORY, op)
        answers = self.gather(memory_op(runner, op))
        failed = first_failure([a if isinstance(a, str) else None for a in answers], 0)
        undo = MEMORY_OPS[op]
        if failed is None:
            return sum(answers)
        if undo is not None:
            self.memory(runner, undo)
        raise TpResumeOutOfMemory(failed)

    def load(self, model: torch.nn.Module, path: str) -> None:
        """Every TP rank loads its shard of checkpoint ``path`` (a resume's reload);
        RuntimeError naming the first TP rank that failed."""
        self.send(LOAD, path)
        failed = first_failure(self.gather(load_checkpoint(model, path)), 0)
        if failed is not None:
            raise RuntimeError(failed)


def followers_of(runner: Any) -> Followers | None:
    """The followers of TP rank 0's runner (scheduler/tp/worker.py's LeaderRunner); None
    at tp 1."""
    return getattr(runner, "followers", None)


def local_part(model: torch.nn.Module, tp: TensorParallel, name: str) -> torch.Tensor | None:
    """This rank's shard of ``name`` for a gather (None where every rank holds all of it)."""
    found = resolve(model, name)
    if found.param is None or not tp.is_split(found.param_name or name):
        return None
    quant = getattr(model, "quant", None)
    if found.param.is_meta and quant is not None and found.param_name is not None:
        # kept quantized (model/quant/): this rank's shard, dequantized
        return quant.dequantized(found.param_name).clone()
    return found.param.detach().to("cpu").clone()


def full_tensor(model: torch.nn.Module, tp: TensorParallel, name: str,
                parts: list[torch.Tensor | None]) -> torch.Tensor:
    """``name`` whole, from the gathered parts (rank 0's own parameter when replicated)."""
    found = resolve(model, name)
    assert found.param is not None
    key = found.param_name or name
    if not tp.is_split(key):
        return found.param.detach()
    return tp.unshard(key, [p for p in parts if p is not None])


class FollowerWeights:
    """A follower's side of the weight ops: its trainer groups, its one weight-sync thread
    and the job in flight on it."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel) -> None:
        self.runner = runner
        self.tp = tp
        self.sync = WeightGroups()
        self.pending: Future | None = None

    def handle(self, command: tuple) -> None:
        """Run one weight command from TP rank 0 (one of :data:`WEIGHT_COMMANDS`)."""
        kind = command[0]
        if kind == JOIN:
            self._start(self._join, *command[1:])
        elif kind == RECEIVE:
            self._start(self._receive, *command[1:])
        elif kind == COLLECT:
            self.tp.gather(self._outcome(command[1]))
        elif kind == DESTROY:
            group = self.sync.groups.pop(command[1], None)
            if group is not None:
                self.sync.pool.submit(group.destroy)
        elif kind == SEGMENT:
            self.tp.gather(self._guard(self._segment, *command[1:]))
        elif kind == READ:
            self.tp.gather(local_part(self.runner.model, self.tp, command[1]))
        elif kind == DIGEST:
            self.tp.gather(weights_digest(self.runner.model))
        elif kind == MEMORY:
            self.tp.gather(memory_op(self.runner, command[1]))
        elif kind == LOAD:
            self.tp.gather(load_checkpoint(self.runner.model, command[1]))

    def close(self) -> None:
        """Leave every trainer group (at shutdown)."""
        self.sync.close()

    # ------------------------------------------------------------ jobs

    def _start(self, job: Any, *args: Any) -> None:
        self.pending = self.sync.pool.submit(self._guard, job, *args)

    @staticmethod
    def _guard(job: Any, *args: Any) -> str | None:
        try:
            job(*args)
        except Exception as exc:  # noqa: BLE001 - reported to TP rank 0, which answers
            return _error_text(exc)
        return None

    def _outcome(self, timeout_s: float) -> str | None:
        fut, self.pending = self.pending, None
        if fut is None:
            return "no weight job was started on this rank"
        try:
            return fut.result(timeout_s + COLLECT_MARGIN_S)
        except FutureTimeout:
            return f"its weight job did not end within {timeout_s:.0f}s"

    def _join(self, group_name: str, address: str, port: int, base_rank: int, world: int,
              backend: str, budget_s: float) -> None:
        me = base_rank + self.tp.rank
        self.sync.groups[group_name] = join_group(address, port, me, world, group_name,
                                                  backend, budget_s, self.runner.device)
        logger.info("TP rank %d joined weight group %s as rank %d of %d", self.tp.rank,
                    group_name, me, world)

    def _receive(self, group_name: str, names: list[str], dtypes: list[str],
                 shapes: list[list[int]], load_format: str, budget_s: float) -> None:
        group = self.sync.groups.get(group_name)
        if group is None:
            raise LookupError(f"this TP rank has no weight update group {group_name!r}")
        model = self.runner.model
        specs = check_manifest(model, names, dtypes, shapes, load_format)
        receive_weights(group, specs, load_format, budget_s, self.runner.device, self.tp)

    def _segment(self, shm_name: str, names: list[str], dtypes: list[str],
                 shapes: list[list[int]], offsets: list[int]) -> None:
        model = self.runner.model
        load_from_segment(model, shm_name, check_manifest(model, names, dtypes, shapes),
                          offsets)
