"""Rank-side handlers of generation: requests, aborts, pause and continue."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang_admin.messages import (
    AbortAllReq,
    AbortReq,
    ContinueReq,
    CountResult,
    GenerateReq,
    PauseReq,
)
from sglang_admin.scheduler.ops.registry import handles
from sglang_admin.tracing import trace_id_of

logger = logging.getLogger(__name__)

WEIGHTS_INVALID = (
    "the served weights are not valid (a weight update failed part-way, or released weights "
    "could not be restored): serving resumes after a successful weight update "
    "(UpdateWeightsFromDistributed, UpdateWeightsFromTensor) or UpdateWeightsFromDisk"
)

if TYPE_CHECKING:
    from sglang_admin.scheduler.rank.loop import Rank


@handles(GenerateReq)
def on_generate(rank: Rank, msg: GenerateReq) -> None:
    trace_id = trace_id_of(msg.trace)
    if rank.args.log_requests:
        logger.info(
            "%s rid=%s prompt_tokens=%d max_new_tokens=%d%s",
            "embed" if msg.embed else "generate", msg.rid, len(msg.input_ids),
            msg.sampling.max_new_tokens,
            f" trace_id={trace_id}" if trace_id else "",
        )
    if trace_id:
        rank.trace_ids[msg.rid] = trace_id
    if not rank.weights_valid:  # refused: never serve from half-updated weights
        rank.scheduler.refuse(msg.rid, WEIGHTS_INVALID, "FAILED_PRECONDITION")
        return
    rank.scheduler.add_request(msg, trace_id)


@handles(AbortReq)
def on_abort(rank: Rank, msg: AbortReq) -> None:
    rank.scheduler.abort(msg.rid, msg.reason)


@handles(AbortAllReq)
def on_abort_all(rank: Rank, msg: AbortAllReq) -> None:
    count = rank.scheduler.abort_all(msg.reason)
    rank.reply(msg, True, f"{count} request(s) aborted", CountResult(count))


@handles(PauseReq)
def on_pause(rank: Rank, msg: PauseReq) -> None:
    """SGLang's pause_generation; a second pause changes the mode (applied again)."""
    count = rank.scheduler.pause(msg.mode)
    rank.publish_state(force=True)
    verb = {"abort": "aborted", "retract": "retracted", "in_place": "held in place"}[msg.mode]
    rank.reply(msg, True, f"Generation paused ({msg.mode}): {count} request(s) {verb}",
               CountResult(count))


@handles(ContinueReq)
def on_continue(rank: Rank, msg: ContinueReq) -> None:
    was = rank.scheduler.paused
    rank.scheduler.resume()
    if msg.torch_empty_cache:
        rank.runner.empty_cache()
        logger.info("rank %d: cached memory handed back (torch_empty_cache)", rank.rank)
    rank.publish_state(force=True)
    rank.reply(msg, True, "Generation continued" if was else "Generation was not paused")
