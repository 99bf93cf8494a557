"""The TP ranks of one replica (--tp-size > 1): the leader's runner and the followers' loop.

TP rank 0 runs the replica's whole rank loop (scheduler/rank/loop.py) with its ModelRunner
wrapped in :class:`LeaderRunner`, which sends every command that touches the model to the
other TP ranks first (the step's batch, a cache reset, a refit, a memory release or
resume, a LoRA adapter written or cleared, stop; the weight-sync and read-back commands are
scheduler/tp/weights.py's, the profile ones scheduler/tp/profile.py's). TP ranks 1..N-1 run
:func:`run_follower`: they own no scheduler and no socket but their heartbeat's, only a
shard of the model and a KV pool of the same slots, and do what rank 0 broadcasts, in the
order it does it, so every forward's all-reduces meet. Why one scheduler per replica:
model/tensor_parallel.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from typing import Any

import torch
import zmq

from sglang_admin.config import ServerArgs
from sglang_admin.disaggregation.rank import follower_shards
from sglang_admin.disaggregation.tp_shards import PD_COMMANDS
from sglang_admin.logging_utils import setup_logging
from sglang_admin.model.device import resolve_device, use_device
from sglang_admin.model.lora import AdapterWeights, LoraBuffers
from sglang_admin.model.runner import InvalidSequence, ModelRunner, SeqInput, SeqOutput
from sglang_admin.model.tensor_parallel import TensorParallel, join_tensor_parallel
from sglang_admin.model.weights import RefitError, refit_from_disk
from sglang_admin.scheduler import late_imports
from sglang_admin.scheduler.profiling.profiler import Profiler
from sglang_admin.scheduler.rank.heartbeat import HeartbeatThread
from sglang_admin.scheduler.tp.profile import PROFILE_COMMANDS, FollowerProfiler, step_stage
from sglang_admin.scheduler.tp.weights import WEIGHT_COMMANDS, Followers, FollowerWeights

logger = logging.getLogger(__name__)

STEP, RESET, REFIT, STOP = "step", "reset", "refit", "stop"
LORA_WRITE, LORA_CLEAR = "lora-write", "lora-clear"


def gpu_index(args: ServerArgs, dp_rank: int, tp_rank: int) -> int:
    """A TP rank's GPU on CUDA, as SGLang numbers them: base + (dp x tp + tp rank) x step."""
    return args.gpu_index(dp_rank * args.tp_size + tp_rank)


def join_replica(args: ServerArgs, dp_rank: int, tp_rank: int) -> TensorParallel:
    """TP rank ``tp_rank`` of replica ``dp_rank`` joins its group; blocks until all join."""
    dev = resolve_device(args.device, gpu_index(args, dp_rank, tp_rank))
    use_device(dev)
    if args.nnodes > 1:  # the group spans hosts (multinode/group.py)
        from sglang_admin.multinode.group import join_across_nodes

        return join_across_nodes(args, dp_rank, tp_rank, dev)
    # one host: the replica's ranks meet through a file of the server's private ipc_dir (no
    # port to pick, so none another process can take first)
    store = os.path.join(args.ipc_dir, f"tp-replica-{dp_rank}.rendezvous")
    return join_tensor_parallel(f"file://{store}", tp_rank, args.tp_size, dev)


def _path_problem(path: str) -> str | None:
    """Why this rank cannot read checkpoint ``path`` (each node reads its own disk), or None."""
    return None if os.path.exists(path) else f"{path} does not exist on this node"


def _refit_result(runner: ModelRunner, path: str, restore_from: str | None) -> tuple[bool, str, bool]:
    """(ok, reason, restored) of one rank's refit of its shard."""
    try:
        refit_from_disk(runner.model, path, restore_from)
    except RefitError as exc:
        return False, str(exc), exc.restored
    return True, "", True


class LeaderLora:
    """TP rank 0's LoRA slots: an adapter written or cleared here is written or cleared on
    every follower first (each cuts its own part of A/B, model/lora.py); the rest is the
    wrapped LoraBuffers'."""

    def __init__(self, buffers: LoraBuffers, tp: TensorParallel) -> None:
        self._buffers = buffers
        self._tp = tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buffers, name)

    def write(self, slot: int, adapter: AdapterWeights) -> None:
        self._tp.broadcast((LORA_WRITE, slot, adapter))  # the whole adapter, A/B uncut
        self._buffers.write(slot, adapter)

    def clear(self, slot: int) -> None:
        self._tp.broadcast((LORA_CLEAR, slot))
        self._buffers.clear(slot)


class LeaderRunner:
    """TP rank 0's ModelRunner: each model command goes to the followers, then runs here.

    Everything else (sizes, info, the model for read-only use) is the wrapped runner's.
    """

    def __init__(self, runner: ModelRunner, tp: TensorParallel) -> None:
        self._runner = runner
        self.tensor_parallel = tp
        self.followers = Followers(tp)  # the weight ops' commands (scheduler/tp/weights.py)
        self.lora = None if runner.lora is None else LeaderLora(runner.lora, tp)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def forward_step(self, seqs: list[SeqInput]) -> list[SeqOutput | None]:
        """Broadcast the batch (grammar matchers stay here: the followers' sampling is
        discarded), then run it; an InvalidSequence raises on every rank alike."""
        shared = [s if s.grammar is None else dataclasses.replace(s, grammar=None) for s in seqs]
        self.tensor_parallel.broadcast((STEP, shared))
        return self._runner.forward_step(seqs)

    def reset(self) -> None:
        self.tensor_parallel.broadcast((RESET,))
        self._runner.reset()

    def refit_from_disk(self, path: str, restore_from: str | None) -> None:
        """Every TP rank loads its shard of ``path``; RefitError when any rank failed
        (restored only when every rank put its old weights back)."""
        tp = self.tensor_parallel
        tp.broadcast((REFIT, path, restore_from))
        # every rank sees the path first: one that cannot (its node's disk lacks it) fails
        # the refit before any rank loads, so no replica is left half-loaded
        problems = tp.gather(_path_problem(path))
        for tp_rank, why in enumerate(problems):
            if why is not None:
                raise RefitError(f"{tp.name(tp_rank)}: {why}; no TP rank loaded it", True)
        results = tp.gather(_refit_result(self._runner, path, restore_from))
        failed = [(i, why, restored) for i, (ok, why, restored) in enumerate(results) if not ok]
        if not failed:
            return
        tp_rank, why, _ = failed[0]
        restored = len(failed) == len(results) and all(r for _, _, r in failed)
        if len(failed) != len(results):
            why += "; the other TP ranks loaded the new weights, so they are mixed"
        raise RefitError(f"{self.tensor_parallel.name(tp_rank)}: {why}", restored)

    def release_kv_cache(self) -> int:
        return self.followers.memory(self._runner, "release_kv_cache")

    def release_weights(self) -> int:
        return self.followers.memory(self._runner, "release_weights")

    def resume_kv_cache(self) -> None:
        self.followers.memory(self._runner, "resume_kv_cache")

    def resume_weights(self) -> None:
        self.followers.memory(self._runner, "resume_weights")

    def stop_followers(self) -> None:
        """Let the followers leave the group and exit (a clean shutdown; followers already
        gone with the server are left to it)."""
        try:
            self.tensor_parallel.broadcast((STOP,))
            self.tensor_parallel.close()
        except RuntimeError as exc:  # gloo/nccl: a peer is gone
            logger.warning("TP followers not stopped cleanly: %s", exc)


def build_runner(args: ServerArgs, dp_rank: int, tp_rank: int,
                 tensor_parallel: TensorParallel | None) -> ModelRunner:
    """The ModelRunner of TP rank ``tp_rank`` of replica ``dp_rank`` from the server's
    arguments: every rank's, the TP followers' and each replica's rank loop's
    (scheduler/rank/builder.py; ``tensor_parallel`` None at tp 1)."""
    return ModelRunner(
        args.model_path,
        device=args.device,
        dtype=args.dtype,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        seed=args.seed,
        lora_slots=(args.max_loaded_loras, args.max_lora_rank) if args.enable_lora else None,
        lanes=args.rank_lanes,
        lanes_as_threads=not (args.cpu_lanes or args.torch_threads),
        attention_backend=args.attention_backend,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        quantization=args.quantization,
        gpu_index=gpu_index(args, dp_rank, tp_rank),
        mem_fraction_static=args.mem_fraction_static,
        is_embedding=args.is_embedding,
        tensor_parallel=tensor_parallel,
    )


def follow(runner: ModelRunner, tp: TensorParallel, profiler: Profiler,
           shards: Any = None) -> None:
    """Run rank 0's commands until it says stop (``shards``: this rank's PD transfer
    backend, disaggregation/tp_shards.py; None without --disaggregation-mode)."""
    weights = FollowerWeights(runner, tp)
    try:
        remote = bool(tp.ranks_per_node) and tp.rank >= tp.ranks_per_node  # not on node 0
        _follow(runner, tp, weights, FollowerProfiler(profiler, ship=remote), shards)
    finally:
        weights.close()
        if shards is not None:
            shards.close()


def _follow(runner: ModelRunner, tp: TensorParallel, weights: FollowerWeights,
            profiler: FollowerProfiler, shards: Any) -> None:
    resent = False  # the last step raised InvalidSequence: rank 0 resends it, less that one
    stage = "prefill"
    while True:
        command = tp.broadcast()
        kind = command[0]
        if kind in WEIGHT_COMMANDS:
            weights.handle(command)
        elif kind in PROFILE_COMMANDS:
            profiler.handle(command, tp.gather)
        elif kind in PD_COMMANDS:  # only a PD leader sends them: shards is set
            shards.handle(command, tp.gather)
        elif kind == STEP:
            if not resent:  # rank 0's profiler counts the step once, at its first try
                stage = step_stage(command[1])
                profiler.before_step(stage)
            try:
                runner.forward_step(command[1])
            except InvalidSequence:
                resent = True  # rank 0 raised the same before any device work: it resends
                continue
            resent = False
            profiler.after_step(stage)
        elif kind == RESET:
            runner.reset()
        elif kind == LORA_WRITE:
            assert runner.lora is not None  # --enable-lora is the server's: every rank has it
            runner.lora.write(command[1], command[2])
        elif kind == LORA_CLEAR:
            assert runner.lora is not None
            runner.lora.clear(command[1])
        elif kind == REFIT:
            if all(p is None for p in tp.gather(_path_problem(command[1]))):
                tp.gather(_refit_result(runner, command[1], command[2]))
        elif kind == STOP:
            return


def run_follower(args: ServerArgs, dp_rank: int, tp_rank: int, parent_pid: int) -> None:
    """Entry point of TP rank ``tp_rank`` (> 0) of replica ``dp_rank`` (spawned by launch)."""
    from sglang_admin.model.runner import keep_freed_cpu_memory
    from sglang_admin.scheduler.rank.lifetime import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(args.log_level, prefix=f"rank{dp_rank}-tp{tp_rank}")
    torch.set_num_threads(args.rank_threads)
    keep_freed_cpu_memory()
    torch.manual_seed(args.seed + dp_rank)
    ctx = zmq.Context(1)
    heartbeat = HeartbeatThread(ctx, args, dp_rank, _NotStepping(), tp_rank)
    heartbeat.start()  # a stopped follower falls silent: the watchdog takes its replica down
    try:
        tp = join_replica(args, dp_rank, tp_rank)
        runner = build_runner(args, dp_rank, tp_rank, tp)
        late_imports.import_before_ready(args.watchdog_probe_timeout_s, grammar=False)
        shards = follower_shards(args, tp_rank, runner)
        tp.barrier()
        logger.info("TP rank %d of replica %d ready on %s", tp_rank, dp_rank, runner.device)
        # what its profiler needs, at once: rank 0 waits for its answer to a StartProfile
        late_imports.start_in_background(grammar=False, delay_s=0)
        follow(runner, tp, Profiler(dp_rank, str(runner.device), args.profile_max_steps,
                                    tp_rank=tp_rank), shards)
    except Exception as exc:  # noqa: BLE001 - the server sees the exit and goes down
        logger.error("TP rank %d of replica %d failed: %s: %s", tp_rank, dp_rank,
                     type(exc).__name__, exc)
        sys.exit(1)
    finally:
        heartbeat.stop()
        ctx.term()
    tp.close()


class _NotStepping:
    """A follower's clock for its heartbeat: alive, never judged by step time (its rank 0
    is, and a follower that hangs in a step holds rank 0 in the same step)."""

    step_started = 0.0
    forward_steps = 0
    state_confirmed = 0.0
