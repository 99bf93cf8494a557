"""What a forward step's results do to its requests: append the sampled tokens and what
came with them, finish the requests that stop, fail the ones whose sequence failed, and
gather the outputs to send. No torch here."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from sglang_admin.messages import ReqOutput
from sglang_admin.scheduler import output_extras
from sglang_admin.scheduler.output_extras import StepResult
from sglang_admin.scheduler.request import Batch, Span
from sglang_admin.scheduler.request_end import check_finished, fail, finish, progress
from sglang_admin.scheduler.speculative.verified import take_verified
from sglang_admin.scheduler.state import SchedulerState

logger = logging.getLogger(__name__)


def postprocess(
    state: SchedulerState, batch: Batch, results: Sequence[StepResult | None]
) -> list[ReqOutput]:
    """Take a step's results (one per span, in span order; None: nothing for it); return
    the outputs to send: the step's progress of every request, and what ended meanwhile.

    A result's error fails its request alone; so does an exception while post-processing
    one request (INTERNAL, with its reason)."""
    new_tokens = 0
    for span, result in zip(batch.spans, results):
        req = span.req
        try:
            new_tokens += take_result(state, span, result)
        except Exception as exc:  # noqa: BLE001 - one request's fault ends that request
            logger.exception("post-processing %s failed", req.rid)
            fail(state, req, f"post-processing failed: {type(exc).__name__}: {exc}",
                 "INTERNAL")
    if new_tokens:
        state.generated.append((time.monotonic(), new_tokens))
    outputs = state.pending_outputs
    state.pending_outputs = []
    for span in batch.spans:
        req = span.req
        if req.key in state.by_rid and len(req.output_ids) > req.sent_tokens:
            outputs.append(progress(req))
    return outputs


def take_result(state: SchedulerState, span: Span, result: StepResult | None) -> int:
    """Apply one span's result to its request; the tokens it appended (0 or 1; a verify
    span's: its accepted run)."""
    req = span.req
    if span.draft:
        return take_verified(state, span, result)
    req.kv_len = span.end
    if result is None:
        token, error = None, None
    else:
        token = result.token_id if span.sample else None
        error = result.error
    if req.token_only and span.end - span.start == 1 and not req.aborted and error is None:
        # most requests of most steps: what the lines below would do for them
        if token is None:
            return 0
        req.output_ids.append(token)
        check_finished(state, req, token)
        return 1
    if error is not None and not req.aborted:
        fail(state, req, error, getattr(result, "error_code", None) or "INTERNAL")
        return 0
    if span.end - span.start > 1 and not req.aborted:
        state.memory.share_prefilled(req)
    output_extras.absorb_prompt(req, result)
    if req.sampling.params.max_new_tokens == 0 and not req.aborted:
        if span.end >= req.seq_len:  # prefill only: done once the prompt is in
            finish(state, req, "length")
        return 0
    if result is None or token is None or req.aborted:
        return 0
    req.output_ids.append(token)
    grammar = req.sampling.grammar
    if grammar is not None and not grammar.accept(token):
        fail(state, req, f"token {token} violates the request's grammar", "INTERNAL")
        return 1
    output_extras.absorb_token(req, result)
    check_finished(state, req, token)
    return 1
