"""The model's side of a rank's step: the runner's inputs built from a scheduled batch, and
the forward pass that drops a request whose sequence is invalid and runs the rest."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang_admin.scheduler.request import Batch
from sglang_admin.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from sglang_admin.model.runner import ModelRunner, SeqInput
    from sglang_admin.model.step_io import SeqOutput

logger = logging.getLogger(__name__)


def batch_inputs(batch: Batch) -> list[SeqInput]:
    """The model runner's inputs for a scheduled batch: one per span, in span order."""
    from sglang_admin.model.runner import SeqInput

    inputs = []
    for sp in batch.spans:
        req = sp.req
        start, end = sp.start, sp.end
        sampling, logprob = req.sampling, req.logprob
        draft = sp.draft
        inputs.append(SeqInput(
            req_idx=req.req_idx,
            prefix_len=start,
            # a verify span (speculative/plan.py): the last token, then the draft
            token_ids=req.tokens(start, end) if not draft else req.tokens(start, start + 1) + draft,
            table_start=sp.table_start,
            table_slots=req.slots[sp.table_start : end],
            sampling=sampling.params,
            prompt_ids=req.prompt_ids,
            output_ids=req.output_ids,
            sample=sp.sample,
            return_logprob=logprob.return_logprob,
            top_logprobs_num=logprob.top_logprobs_num,
            lora_slot=req.lora.slot,
            # prompt logprobs only while the span still covers prompt tokens
            logprob_start_len=logprob.logprob_start_len if start < len(req.prompt_ids) else -1,
            token_ids_logprob=logprob.token_ids_logprob,
            return_hidden_states=req.hidden.wanted,
            grammar=sampling.grammar,
            argmax_from=req.argmax_from,
            embed=req.embed,  # an Embed request's pooling progress
            draft=draft,
        ))
    return inputs


def forward(runner: ModelRunner, scheduler: Scheduler, batch: Batch, seqs: list[SeqInput],
            rank: int) -> list[SeqOutput | None]:
    """Run the step's forward pass. A sequence the runner finds invalid (checked before any
    device work) fails its request alone: its span is dropped and the step runs again."""
    from sglang_admin.model.runner import InvalidSequence

    while True:
        try:
            return runner.forward_step(seqs)
        except InvalidSequence as exc:
            span = batch.spans.pop(exc.index)
            seqs.pop(exc.index)
            logger.error("rank %d: request %s has an invalid sequence: %s",
                         rank, span.req.rid, exc)
            scheduler.fail(span.req, f"invalid sequence: {exc}", "INTERNAL")
