"""Rank-side handlers of the weights a trainer pushes: join / leave its process group,
receive a broadcast, load tensors from shared memory.

Joining a group and receiving from it block for as long as the trainer takes, so they run
on this rank's one weight-sync thread while the loop goes on (heartbeat, health, state,
other admin ops); the answer goes out through ``reply_when_done``, and what the outcome
changes in the rank (validity, version, admission, cache) is applied on the loop's own
thread (:class:`_FinishOnLoop`). Every wait is bounded by the call's deadline.

An update waits for in-flight requests like a refit from disk (or runs at once when
paused) and holds admission while it receives. A broadcast that fails part-way cannot be
rolled back: the rank then refuses Generate with FAILED_PRECONDITION until a good update or
a reload from disk. A manifest that does not fit the model is refused before anything
moves (a :class:`RejectedResult` the server turns into INVALID_ARGUMENT).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_admin.messages import (
    DestroyWeightsGroupReq,
    InitWeightsGroupReq,
    RejectedResult,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
    WeightsResult,
)
from sglang_admin.model.dist_group import BACKENDS, GroupJoinError, WeightGroup, join_group
from sglang_admin.model.pushed_weights import (
    ManifestError,
    TensorSpec,
    check_manifest,
    check_segment,
    load_from_segment,
    receive_weights,
)
from sglang_admin.scheduler.ops.registry import handles
from sglang_admin.scheduler.ops.weight_control import weights_now_served
from sglang_admin.scheduler.tp.weights import (
    DESTROY,
    JOIN,
    RECEIVE,
    SEGMENT,
    first_failure,
    followers_of,
    group_rank,
)

if TYPE_CHECKING:
    from sglang_admin.scheduler.rank.loop import Rank

logger = logging.getLogger(__name__)

OP = "update_weights"  # queues with UpdateWeightsFromDisk behind the same drain
RECEIVING = "receiving weights"
NO_DEADLINE_S = 3600.0
PARTIAL = ("the weights are partially updated and cannot be rolled back: Generate is refused "
           "(FAILED_PRECONDITION) until a successful weight update or UpdateWeightsFromDisk")


class _FinishOnLoop(Future):
    """A worker thread's outcome whose effects belong to the rank loop: the loop's
    ``answer_deferred`` reads ``result()`` on its own thread, and the first read runs
    ``finish(outcome)``, which returns the (success, message, result) to answer with."""

    def __init__(self, finish: Callable[[Any], tuple[bool, str, Any]]) -> None:
        super().__init__()
        self._finish = finish
        self._answer: tuple[bool, str, Any] | None = None

    def result(self, timeout: float | None = None) -> tuple[bool, str, Any]:
        if self._answer is None:
            self._answer = self._finish(super().result(timeout))
        return self._answer


@dataclass
class _Outcome:
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0


def _budget_s(deadline: float | None) -> float:
    """Seconds a blocking step may take so that the answer still beats the deadline."""
    if deadline is None:
        return NO_DEADLINE_S
    left = deadline - time.time()
    return max(0.1, left - min(1.0, 0.2 * left))


def _run_on_thread(rank: Rank, job: Callable[[], Any], finish: Callable[[Any], tuple],
                   msg: Any) -> None:
    fut = _FinishOnLoop(finish)

    def work() -> None:
        try:
            fut.set_result(job())
        except BaseException as exc:  # noqa: BLE001 - delivered to the loop, never lost
            fut.set_result(exc)

    rank.weight_sync.pool.submit(work)
    rank.reply_when_done(msg, fut)


def _reject(rank: Rank, msg: Any, code: str, reason: str) -> None:
    rank.reply(msg, False, reason, RejectedResult(code, reason))


# ---------------------------------------------------------------- groups


@handles(InitWeightsGroupReq)
def on_init_group(rank: Rank, msg: InitWeightsGroupReq) -> None:
    sync = rank.weight_sync
    device = rank.runner.device.type
    backend = msg.backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in BACKENDS:
        _reject(rank, msg, "INVALID_ARGUMENT",
                f"backend {msg.backend!r} is not supported; use gloo (CPU) or nccl (CUDA)")
        return
    if (backend == "nccl") != (device == "cuda"):
        _reject(rank, msg, "INVALID_ARGUMENT",
                f"backend {backend} does not match this worker's device {device}; use "
                f"{'nccl' if device == 'cuda' else 'gloo'}")
        return
    if msg.group_name in sync.groups or msg.group_name in sync.joining:
        _reject(rank, msg, "ALREADY_EXISTS",
                f"weight update group {msg.group_name!r} already exists; "
                "DestroyWeightsUpdateGroup it first or use another name")
        return
    tp_size = rank.args.tp_size
    base = group_rank(msg.rank_offset, rank.rank, tp_size, 0)  # TP rank 0's; followers follow
    sync.joining.add(msg.group_name)
    budget = _budget_s(msg.deadline)
    followers = followers_of(rank.runner)
    if followers is not None:  # each TP rank joins at its own rank, on its own thread
        followers.send(JOIN, msg.group_name, msg.master_address, msg.master_port, base,
                       msg.world_size, backend, budget)

    def join() -> WeightGroup:
        return join_group(msg.master_address, msg.master_port, base, msg.world_size,
                          msg.group_name, backend, budget, rank.runner.device)

    def finish(outcome: Any) -> tuple[bool, str, Any]:
        sync.joining.discard(msg.group_name)
        if followers is not None:  # the replica is in the group whole or not at all
            failed = first_failure(followers.collect(budget))
            if failed is not None or not isinstance(outcome, WeightGroup):
                followers.send(DESTROY, msg.group_name)
            if failed is not None and isinstance(outcome, WeightGroup):
                outcome.destroy()
                outcome = GroupJoinError(failed)
        if isinstance(outcome, WeightGroup):
            sync.groups[msg.group_name] = outcome
            logger.info("rank %d joined weight group %s as rank %d of %d", rank.rank,
                        msg.group_name, base, msg.world_size)
            ranks = str(base) if tp_size == 1 else f"{base}..{base + tp_size - 1}"
            return True, (f"joined group {msg.group_name!r} as rank {ranks} of "
                          f"{msg.world_size}"), None
        text = str(outcome) if isinstance(outcome, GroupJoinError) else (
            f"{type(outcome).__name__}: {outcome}")
        logger.warning("rank %d: joining weight group %s failed: %s", rank.rank,
                       msg.group_name, text)
        return False, text, None

    _run_on_thread(rank, join, finish, msg)


@handles(DestroyWeightsGroupReq)
def on_destroy_group(rank: Rank, msg: DestroyWeightsGroupReq) -> None:
    group = rank.weight_sync.groups.pop(msg.group_name, None)
    if group is None:
        _reject(rank, msg, "NOT_FOUND", f"no weight update group named {msg.group_name!r}")
        return
    followers = followers_of(rank.runner)
    if followers is not None:
        followers.send(DESTROY, msg.group_name)

    def finish(outcome: Any) -> tuple[bool, str, Any]:
        if isinstance(outcome, BaseException):
            return True, f"group {msg.group_name!r} left ({outcome})", None
        return True, f"group {msg.group_name!r} destroyed", None

    _run_on_thread(rank, group.destroy, finish, msg)


# ---------------------------------------------------------------- updates


def _checked(rank: Rank, msg: Any, names: list[str], dtypes: list[str],
             shapes: list[list[int]], load_format: str = "") -> list[TensorSpec] | None:
    if rank.runner.weights_released:
        rank.reply(msg, False, "the weights are released: ResumeMemoryOccupation first")
        return None
    try:
        return check_manifest(rank.runner.model, names, dtypes, shapes, load_format)
    except ManifestError as exc:
        _reject(rank, msg, "INVALID_ARGUMENT", str(exc))
        return None


def _when_drained(rank: Rank, msg: Any, run: Callable[[int], None]) -> None:
    aborted = rank.scheduler.abort_all("weights update") if msg.abort_all_requests else 0
    rank.quiesce.when_drained(
        msg.rid, OP, _budget_s(msg.deadline), lambda: run(aborted),
        lambda reason: rank.reply(msg, False, reason, WeightsResult(rank.model_info, aborted)),
    )
    rank.publish_state(force=True)


def _succeeded(rank: Rank, msg: Any, aborted: int, what: str) -> tuple[bool, str, Any]:
    """The loaded weights are what the rank serves now (they came from no checkpoint)."""
    info = rank.model_info
    rank.weights_source = None
    text = weights_now_served(rank, msg, "Succeeded to update parameter online.")
    logger.info("rank %d: %s (version %s)", rank.rank, what, info.weight_version)
    return True, text, WeightsResult(info, aborted)


def _failed(rank: Rank, aborted: int, reason: str) -> tuple[bool, str, Any]:
    rank.weights_valid = False
    rank.weights_source = None
    rank.scheduler.fail_all(PARTIAL, "FAILED_PRECONDITION")
    logger.warning("rank %d: weight update failed part-way: %s", rank.rank, reason)
    return False, f"{reason}; {PARTIAL}", WeightsResult(rank.model_info, aborted)


@handles(UpdateWeightsFromDistributedReq)
def on_update_from_distributed(rank: Rank, msg: UpdateWeightsFromDistributedReq) -> None:
    specs = _checked(rank, msg, msg.names, msg.dtypes, msg.shapes, msg.load_format)
    if specs is None:
        return
    group = rank.weight_sync.groups.get(msg.group_name)
    if group is None:
        _reject(rank, msg, "NOT_FOUND", f"no weight update group named {msg.group_name!r}: "
                "InitWeightsUpdateGroup first")
        return

    followers = followers_of(rank.runner)

    def start(aborted: int) -> None:
        rank.weight_sync.receiving = msg.group_name
        rank.quiesce.hold(RECEIVING)
        rank.publish_state(force=True)
        budget = _budget_s(msg.deadline)
        if followers is not None:  # every TP rank receives each tensor and keeps its shard
            followers.send(RECEIVE, msg.group_name, msg.names, msg.dtypes, msg.shapes,
                           msg.load_format, budget)

        def receive() -> _Outcome:
            t0 = time.perf_counter()
            try:
                nbytes = receive_weights(group, specs, msg.load_format, budget,
                                         rank.runner.device,
                                         getattr(rank.runner.model, "tensor_parallel", None))
            except Exception as exc:  # noqa: BLE001 - gloo's errors are RuntimeErrors
                return _Outcome(False, f"receiving from group {msg.group_name!r} failed: "
                                f"{str(exc).strip().splitlines()[0] if str(exc) else exc!r}")
            return _Outcome(True, nbytes=nbytes, seconds=time.perf_counter() - t0)

        def finish(outcome: Any) -> tuple[bool, str, Any]:
            rank.weight_sync.receiving = None
            rank.quiesce.lift(RECEIVING)
            rank.publish_state(force=True)
            if not isinstance(outcome, _Outcome):
                outcome = _Outcome(False, f"{type(outcome).__name__}: {outcome}")
            failed = None if followers is None else first_failure(followers.collect(budget))
            if outcome.ok and failed is not None:
                outcome = _Outcome(False, f"receiving from group {msg.group_name!r} failed "
                                   f"on {failed}")
            if not outcome.ok:
                return _failed(rank, aborted, outcome.error)
            return _succeeded(rank, msg, aborted, f"received {len(specs)} tensors "
                              f"({outcome.nbytes} bytes) in {outcome.seconds:.2f}s")

        _run_on_thread(rank, receive, finish, msg)

    _when_drained(rank, msg, start)


@handles(UpdateWeightsFromTensorReq)
def on_update_from_tensor(rank: Rank, msg: UpdateWeightsFromTensorReq) -> None:
    busy = rank.weight_sync.busy()
    if busy is not None:
        rank.reply(msg, False, busy)
        return
    specs = _checked(rank, msg, msg.names, msg.dtypes, msg.shapes)
    if specs is None:
        return
    try:
        check_segment(msg.shm_name, specs, msg.offsets)
    except ManifestError as exc:
        _reject(rank, msg, "INVALID_ARGUMENT", str(exc))
        return

    followers = followers_of(rank.runner)

    def run(aborted: int) -> None:
        t0 = time.perf_counter()
        if followers is not None:  # every TP rank reads the segment and keeps its shard
            followers.send(SEGMENT, msg.shm_name, msg.names, msg.dtypes, msg.shapes,
                           msg.offsets)
        unchanged, error = False, None  # unchanged: refused before a byte was copied
        try:
            nbytes = load_from_segment(rank.runner.model, msg.shm_name, specs, msg.offsets)
        except ManifestError as exc:  # the segment changed since it was checked
            unchanged, error = True, str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever broke, nothing half-updated serves
            error = f"{type(exc).__name__}: {exc}"
        if followers is not None:  # the other TP ranks may have loaded theirs: all or none
            failed = first_failure(followers.gather(error)[1:])
            unchanged = False
            error = error if error is not None else failed
        if error is not None and unchanged:
            rank.reply(msg, False, error, WeightsResult(rank.model_info, aborted))
            return
        if error is not None:
            rank.reply(msg, *_failed(rank, aborted, error))
            return
        rank.reply(msg, *_succeeded(rank, msg, aborted, f"loaded {len(specs)} tensors "
                                    f"({nbytes} bytes) from shared memory in "
                                    f"{time.perf_counter() - t0:.2f}s"))

    _when_drained(rank, msg, run)
