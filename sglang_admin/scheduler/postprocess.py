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
from sglang_admin.scheduler.request import Batch, Req, Span
from sglang_admin.scheduler.request_end import fail, finish, progress
from sglang_admin.scheduler.state import SchedulerState
from sglang_admin.scheduler.stop_strings import find_stop

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


def check_finished(state: SchedulerState, req: Req, token: int) -> None:
    """Finish the request when ``token`` (just appended) ends it: a stop token, a stop
    string, a completed grammar, its length limit or the context's."""
    sp = req.sampling.params
    n_out = len(req.output_ids)
    is_stop = token in sp.stop_token_ids or (not sp.ignore_eos and token in state.eos)
    if is_stop and n_out >= sp.min_new_tokens:
        finish(state, req, "stop", matched=token)
        return
    stop = req.sampling.stop
    if stop and n_out >= sp.min_new_tokens and state.detokenize is not None:
        found = find_stop(req.output_ids, stop, state.detokenize)
        if found is not None:
            finish(state, req, "stop", matched_str=found.stop,
                   stop_trim=0 if req.sampling.no_stop_trim else found.trim)
            return
    grammar = req.sampling.grammar
    if grammar is not None and grammar.finished:  # the constraint is complete
        finish(state, req, "stop", matched=token if token in state.eos else None)
        return
    seq_len = len(req.prompt_ids) + n_out
    if (
        n_out >= sp.max_new_tokens
        or seq_len >= state.config.context_length
        or seq_len >= state.config.token_capacity
    ):
        finish(state, req, "length")


def take_verified(state: SchedulerState, span: Span, result: StepResult | None) -> int:
    """A verify span's result (speculative.py): append its run of tokens one by one, each
    through the stop checks (the first that ends the request ends the run), with its own
    logprobs; free the KV slots of the rejected draft tokens at once, so the pool and the
    prefix cache hold only accepted tokens; count the accept figures. The tokens appended."""
    req = span.req
    draft = span.draft or []
    start = span.start
    more = getattr(result, "more", None) or []
    run = [] if result is None else [result, *more]
    error = None if result is None else result.error
    if error is not None or not run or req.aborted:
        trim_draft(state, req, start + 1)  # the last token's KV is in; no draft is
        if error is not None and not req.aborted:
            fail(state, req, error, getattr(result, "error_code", None) or "INTERNAL")
        return 0
    # accepted draft tokens: the run is the accepted drafts then one token of the target's
    # own, unless the target's row after the last accepted one failed (then none of its own)
    tokens = [out.token_id for out in run]
    accepted = 0
    while accepted < len(draft) and accepted < len(tokens) and tokens[accepted] == draft[accepted]:
        accepted += 1
    if req.spec is not None:
        req.spec.verified(len(draft), accepted)
    counters = state.spec
    counters.verify_steps += 1
    counters.drafted += len(draft)
    counters.accepted += accepted
    trim_draft(state, req, start + len(tokens))
    grammar = req.sampling.grammar
    for j, out in enumerate(run):
        # the KV of every token before this one is in the pool: kv_len = seq_len - 1
        req.kv_len = start + j + 1
        token = out.token_id
        req.output_ids.append(token)
        if grammar is not None and not grammar.accept(token):
            fail(state, req, f"token {token} violates the request's grammar", "INTERNAL")
            return j + 1
        output_extras.absorb_token(req, out)
        check_finished(state, req, token)
        if req.key not in state.by_rid:  # it ended (its memory released with its kv_len)
            return j + 1
    return len(run)


def trim_draft(state: SchedulerState, req: Req, kv_len: int) -> None:
    """Keep the request's KV slots of its first ``kv_len`` positions; free the rest (the
    rejected draft tokens') now, and have its table row rewritten from there."""
    extra = req.slots[kv_len:]
    if extra:
        del req.slots[kv_len:]
        state.allocator.free(extra)
    req.kv_len = kv_len
    req.table_synced = min(req.table_synced, kv_len)
