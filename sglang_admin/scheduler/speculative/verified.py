"""Speculative decoding in a step's results: a verify span's run of tokens taken one by one
through the stop checks, the rejected draft tokens' KV slots freed at once, the accept figures
counted. No torch here."""

from __future__ import annotations

from sglang_admin.scheduler import output_extras
from sglang_admin.scheduler.output_extras import StepResult
from sglang_admin.scheduler.request import Req, Span
from sglang_admin.scheduler.request_end import check_finished, fail
from sglang_admin.scheduler.state import SchedulerState


def take_verified(state: SchedulerState, span: Span, result: StepResult | None) -> int:
    """A verify span's result: append its run of tokens one by one, each
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
