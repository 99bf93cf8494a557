"""Rank-side handlers of the weight ops: refit from disk, version, read-back, digest, and
the release and resume of memory.

A refit waits, through the rank's Quiesce, for the running requests to finish while new
ones queue behind it (so every request runs on one version of the weights from its first
token to its last); on a paused rank it runs at once. A refit that fails part-way puts the
previous weights back (model/weights.py); should that fail too, the rank refuses Generate
with FAILED_PRECONDITION until a refit succeeds. model_path and the version change only on
success; the prefix cache is flushed after a load when asked, since its KV was computed
with the old weights.

Releasing a tag that is already released, or resuming one that is not, is refused as SGLang
refuses it, before anything moves (scheduler/ops/memory_tags.py). Memory release needs an idle
rank; while anything is released, admission is held (new requests wait, as while paused). Resuming the weights reloads them from the checkpoint they
came from and checks them against the digest taken at release, so the worker serves exactly
what it served before; weights that came from no checkpoint, or whose checkpoint changed
meanwhile, cannot be restored, and the rank refuses Generate until weights are pushed.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from sglang_admin.constants import MEMORY_TAGS
from sglang_admin.messages import (
    CheckWeightsReq,
    DigestResult,
    GetWeightsReq,
    MemoryResult,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightVersionReq,
    WeightsResult,
    WeightValues,
)
from sglang_admin.model.runner import ResumeOutOfMemory
from sglang_admin.model.weight_names import UnknownWeightName
from sglang_admin.model.weights import (
    RefitError,
    refit_from_disk,
    reload_weights,
    truncated,
    weight_values,
    weights_digest,
)
from sglang_admin.scheduler.ops.cache_control import flush_now
from sglang_admin.scheduler.ops.generation_control import WEIGHTS_INVALID
from sglang_admin.scheduler.ops.memory_tags import release_refusal, resume_refusal
from sglang_admin.scheduler.ops.registry import handles
from sglang_admin.scheduler.tp.weights import followers_of, replica_digest

if TYPE_CHECKING:
    from sglang_admin.scheduler.rank.loop import Rank

logger = logging.getLogger(__name__)

OP = "update_weights"
RELEASED = "memory released"


def _wait_s(msg: UpdateWeightsFromDiskReq) -> float:
    return max(0.0, msg.deadline - time.time()) if msg.deadline is not None else 3600.0


@handles(UpdateWeightsFromDiskReq)
def on_update_from_disk(rank: Rank, msg: UpdateWeightsFromDiskReq) -> None:
    if rank.runner.weights_released:
        rank.reply(msg, False, "the weights are released: ResumeMemoryOccupation first")
        return
    busy = rank.weight_sync.busy()  # a trainer's broadcast is writing the parameters
    if busy is not None:
        rank.reply(msg, False, busy)
        return
    aborted = rank.scheduler.abort_all("weights update") if msg.abort_all_requests else 0
    rank.quiesce.when_drained(
        msg.rid, OP, _wait_s(msg), lambda: _refit(rank, msg, aborted),
        lambda reason: rank.reply(msg, False, reason,
                                  WeightsResult(rank.model_info, aborted)),
    )
    rank.publish_state(force=True)


def _refit(rank: Rank, msg: UpdateWeightsFromDiskReq, aborted: int) -> None:
    info = rank.model_info
    t0 = time.perf_counter()
    try:
        tp_refit = getattr(rank.runner, "refit_from_disk", None)  # --tp-size > 1
        if tp_refit is not None:
            tp_refit(msg.model_path, rank.weights_source)
        else:
            refit_from_disk(rank.runner.model, msg.model_path, restore_from=rank.weights_source)
    except RefitError as exc:
        if not exc.restored:
            _invalidate(rank)
        logger.warning("rank %d: weight update from %s failed: %s", rank.rank, msg.model_path, exc)
        rank.reply(msg, False, str(exc), WeightsResult(info, aborted))
        return
    rank.weights_source = os.path.abspath(msg.model_path)
    info.model_path = rank.weights_source
    if msg.torch_empty_cache:
        rank.runner.empty_cache()
        logger.info("rank %d: cached memory handed back (torch_empty_cache)", rank.rank)
    text = weights_now_served(rank, msg, "Succeeded to update model weights.")
    logger.info("rank %d: weights updated from %s in %.2fs (version %s)", rank.rank,
                info.model_path, time.perf_counter() - t0, info.weight_version)
    rank.reply(msg, True, text, WeightsResult(info, aborted))


def weights_now_served(rank: Rank, msg: Any, text: str) -> str:
    """New weights are in place (from disk, a trainer's group or shared memory): serve them
    under ``msg.weight_version`` and flush the cache when asked; ``text`` plus what was not
    done is the rank's answer."""
    rank.weights_valid = True
    if msg.weight_version:
        rank.model_info.weight_version = msg.weight_version
    spec = rank.scheduler.config.speculative
    if spec is not None and spec.algorithm == "STANDALONE":
        text += (" The STANDALONE draft model was not refit: it drafts with its own weights"
                 " (outputs stay exact, the target verifies every token; only the accept"
                 " rate may drop).")
    if msg.flush_cache:
        if rank.scheduler.running:
            text += " The cache was not flushed: requests are held in place by the pause."
        else:
            flush_now(rank)
    return text


def _invalidate(rank: Rank) -> None:
    """The weights are neither the old nor the new ones: refuse to serve from them."""
    rank.weights_valid = False
    rank.weights_source = None
    rank.scheduler.fail_all(WEIGHTS_INVALID, "FAILED_PRECONDITION")


@handles(UpdateWeightVersionReq)
def on_update_version(rank: Rank, msg: UpdateWeightVersionReq) -> None:
    aborted = rank.scheduler.abort_all("weight version update") if msg.abort_all_requests else 0
    rank.model_info.weight_version = msg.new_version
    rank.reply(msg, True, f"weight version set to {msg.new_version!r}",
               WeightsResult(rank.model_info, aborted))


@handles(GetWeightsReq)
def on_get_weights(rank: Rank, msg: GetWeightsReq) -> None:
    if rank.runner.weights_released:
        rank.reply(msg, False, "the weights are released")
        return
    model = rank.runner.model
    try:
        shape, values = weight_values(model, msg.name, msg.truncate_size)
    except UnknownWeightName as exc:
        rank.reply(msg, False, str(exc))
        return
    followers = followers_of(rank.runner)
    if followers is not None:  # the full tensor, joined from every TP rank's shard
        shape, values = truncated(followers.read(model, msg.name), msg.truncate_size)
    rank.reply(msg, True, "", WeightValues(shape, values))


@handles(CheckWeightsReq)
def on_check_weights(rank: Rank, msg: CheckWeightsReq) -> None:
    if rank.runner.weights_released:
        rank.reply(msg, False, "the weights are released")
        return
    followers = followers_of(rank.runner)
    if followers is None:
        rank.reply(msg, True, "", DigestResult(weights_digest(rank.runner.model)))
        return
    digests = followers.digests(rank.runner.model)  # one per TP rank: each holds its shard
    rank.reply(msg, True, "", DigestResult(replica_digest(digests), digests))


def served_digest(rank: Rank) -> str:
    """The digest of the weights this rank serves (at tp > 1: its replica's, over every TP
    rank's shard)."""
    followers = followers_of(rank.runner)
    if followers is None:
        return weights_digest(rank.runner.model)
    return replica_digest(followers.digests(rank.runner.model))


def released_tags(rank: Rank) -> set[str]:
    """The memory tags this rank holds released now."""
    runner = rank.runner
    flags = {"kv_cache": runner.kv_cache_released, "weights": runner.weights_released}
    return {tag for tag in MEMORY_TAGS if flags[tag]}


@handles(ReleaseMemoryReq)
def on_release_memory(rank: Rank, msg: ReleaseMemoryReq) -> None:
    s = rank.scheduler
    refusal = release_refusal(released_tags(rank), msg.tags)
    if refusal is not None:
        rank.reply(msg, False, refusal)
        return
    busy = rank.weight_sync.busy()
    if busy is not None:
        rank.reply(msg, False, busy)
        return
    spec = s.config.speculative
    if spec is not None and spec.algorithm == "STANDALONE":
        rank.reply(msg, False, "memory release is not supported with --speculative-algorithm "
                   "STANDALONE (the draft model's memory would stay held)")
        return
    if not s.is_idle:
        rank.reply(msg, False, "memory can be released only when idle: "
                   f"#queue-req: {len(s.waiting)}, #running-req: {len(s.running)}")
        return
    released = 0
    rank.weight_sync.drop_buffers()  # a trainer's receive buffers are allocated again on use
    if "kv_cache" in msg.tags and not rank.runner.kv_cache_released:
        flush_now(rank)  # the pool's contents go with it
        released += rank.runner.release_kv_cache()
    if "weights" in msg.tags and not rank.runner.weights_released:
        # What resume must restore; a checkpoint rewritten meanwhile would not be it.
        rank.released_digest = served_digest(rank) if rank.weights_valid else None
        released += rank.runner.release_weights()
    if rank.runner.kv_cache_released or rank.runner.weights_released:
        rank.quiesce.hold(RELEASED)
    rank.publish_state(force=True)
    rank.reply(msg, True, f"released {released} bytes ({', '.join(msg.tags)})",
               MemoryResult(released))


@handles(ResumeMemoryReq)
def on_resume_memory(rank: Rank, msg: ResumeMemoryReq) -> None:
    runner = rank.runner
    refusal = resume_refusal(released_tags(rank), msg.tags)
    if refusal is not None:
        rank.reply(msg, False, refusal)
        return
    text = "memory resumed"
    weights_back = "weights" in msg.tags and runner.weights_released
    try:
        if "kv_cache" in msg.tags:
            runner.resume_kv_cache()
        if weights_back:
            runner.resume_weights()
    except ResumeOutOfMemory as exc:  # what did not fit stays released; the rank serves on
        logger.warning("rank %d: %s", rank.rank, exc)
        rank.reply(msg, False, str(exc))
        _lift_if_whole(rank)
        return
    if weights_back:
        source, expected = rank.weights_source, rank.released_digest
        rank.released_digest = None
        if source is None:
            _invalidate(rank)
            text = ("weights resumed uninitialised (they came from no checkpoint): Generate "
                    "is refused until UpdateWeightsFromDisk")
        else:
            try:
                followers = followers_of(runner)
                if followers is None:
                    reload_weights(runner.model, source)
                else:  # every TP rank reloads its shard
                    followers.load(runner.model, source)
                if expected is not None and served_digest(rank) != expected:
                    raise ValueError(f"{source} changed since the weights were released, so "
                                     "they cannot be restored")
            except Exception as exc:  # noqa: BLE001 - the checkpoint moved, broke or changed
                _invalidate(rank)
                rank.reply(msg, False, f"reloading {source} failed: {exc}; "
                           "Generate is refused until UpdateWeightsFromDisk")
                _lift_if_whole(rank)
                return
            text = f"memory resumed; weights reloaded from {source}"
    _lift_if_whole(rank)
    rank.reply(msg, True, text)


def _lift_if_whole(rank: Rank) -> None:
    if not rank.runner.kv_cache_released and not rank.runner.weights_released:
        rank.quiesce.lift(RELEASED)
    rank.publish_state(force=True)
