"""How a request ends at a rank: its final output (a finish reason, or an error), its KV
and LoRA adapter released, its sample group forgotten; and the aborts and deadlines that
end requests between steps. No torch here."""

from __future__ import annotations

import logging

from sglang_admin.messages import ReqOutput
from sglang_admin.scheduler import output_extras
from sglang_admin.scheduler.request import Req
from sglang_admin.scheduler.state import SchedulerState
from sglang_admin.scheduler.stop_strings import find_stop

logger = logging.getLogger(__name__)


def error_output(rid: str, code: str, message: str) -> ReqOutput:
    """The one output of a request refused or failed: finish reason abort and the error."""
    return ReqOutput(
        rid=rid, new_token_ids=[], prompt_tokens=0, completion_tokens=0, cached_tokens=0,
        finish_reason="abort", error=message, error_code=code,
    )


def progress(req: Req, final: bool = False) -> ReqOutput:
    """The request's output since the last one it sent (tokens, logprobs, extras)."""
    new = req.output_ids[req.sent_tokens :]
    req.sent_tokens = len(req.output_ids)
    lp = req.logprob
    lps = lp.logprobs[lp.sent :]
    tops = lp.top_logprobs[lp.sent :]
    lp.sent = len(lp.logprobs)
    # positional, every field (a step builds one per running request): rid, tokens,
    # prompt/completion/cached counts, queue_time_s, index, logprobs, top logprobs,
    # finish_reason, matched_token_id, error, error_code, matched_stop_str, stop_trim,
    # then the extras' lists (filled by attach)
    out = ReqOutput(req.rid, new, len(req.prompt_ids), req.sent_tokens,
                    max(req.cached_tokens, 0), req.queue_time_s, req.index, lps, tops,
                    None, None, None, None, None, 0, [], [], [], [])
    if (final or lp.token_ids_logprobs or req.hidden.states
            or (lp.logprob_start_len >= 0 and not lp.input_sent)):
        output_extras.attach(req, out, final)
    return out


def finish(
    state: SchedulerState, req: Req, reason: str, matched: int | None = None,
    error: str | None = None, code: str | None = None, matched_str: str | None = None,
    stop_trim: int = 0,
) -> None:
    """Release the request's memory and adapter and queue its final output."""
    if req.req_idx >= 0:
        state.memory.release(req)
        if req in state.running:
            state.running.remove(req)
    state.by_rid.pop(req.key, None)
    end_sample(state, req)
    out = progress(req, final=True)
    out.finish_reason = reason
    out.matched_token_id = matched
    out.matched_stop_str = matched_str
    out.stop_trim = stop_trim
    out.error = error
    out.error_code = code
    if req.spec is not None:  # the request's accept figures
        out.spec_verify_ct = req.spec.verify_ct
        out.spec_draft_tokens = req.spec.drafted
        out.spec_accepted_tokens = req.spec.accepted
    state.pending_outputs.append(out)
    if req.lora.lora_id and state.lora is not None:
        state.lora.release(req.lora.lora_id)
        req.lora.lora_id = ""


def fail(state: SchedulerState, req: Req, message: str, code: str) -> None:
    """End one request with an error (finish_reason abort) and free its KV.

    Should releasing its memory itself fail, the request is still dropped and its caller
    told (its slots may then stay allocated: logged)."""
    if req.key not in state.by_rid:
        return
    try:
        finish(state, req, "abort", error=message, code=code)
    except Exception:  # noqa: BLE001
        logger.exception("releasing %s failed; dropping it (its KV may leak)", req.rid)
        if req in state.running:
            state.running.remove(req)
        if req in state.waiting:
            state.waiting.remove(req)
        state.by_rid.pop(req.key, None)
        end_sample(state, req)
        out = error_output(req.rid, code, message)
        out.index = req.index
        state.pending_outputs.append(out)


def end_sample(state: SchedulerState, req: Req) -> None:
    """Mark a sample ended; forget its group once every sample of it ended."""
    req.done = True
    group = state.groups.get(req.rid)
    if group is not None and all(r.done for r in group):
        del state.groups[req.rid]


def dequeue(state: SchedulerState, req: Req) -> bool:
    """Take a request out of the waiting or the grammar queue; False when in neither."""
    if req in state.waiting:
        state.waiting.remove(req)
        return True
    return state.grammar_queue is not None and state.grammar_queue.remove(req)


def abort(state: SchedulerState, rid: str, reason: str = "aborted") -> None:
    """Abort a request (every sample of it): a queued one ends now, a running one is
    marked and releases its KV at the next step."""
    group = state.groups.get(rid)
    single = state.by_rid.get(rid)
    for req in group if group is not None else ([single] if single is not None else []):
        if req.key not in state.by_rid:
            continue  # this sample already finished
        if dequeue(state, req):
            finish(state, req, "abort")
        else:
            req.aborted = reason


def take_every_request(state: SchedulerState) -> list[Req]:
    """Every running and queued request (the queues emptied): those an abort_all or a
    fail_all ends."""
    compiling = state.grammar_queue.drain() if state.grammar_queue is not None else []
    reqs = [*state.running, *state.waiting, *compiling]
    state.waiting.clear()
    return reqs


def drop_aborted_and_expired(state: SchedulerState, now: float) -> None:
    """End the running requests an abort marked or whose deadline passed, and the queued
    ones whose deadline passed."""
    ended = [r for r in state.running
             if r.aborted or (r.deadline is not None and r.deadline < now)]
    for req in ended:
        if req.aborted:
            finish(state, req, "abort")
        else:
            finish(state, req, "abort", error="deadline exceeded", code="DEADLINE_EXCEEDED")
    expired = [r for r in state.waiting if r.deadline is not None and r.deadline < now]
    if state.grammar_queue is not None:
        compiling = state.grammar_queue.requests()
        expired += [r for r in compiling if r.deadline is not None and r.deadline < now]
    for req in expired:
        dequeue(state, req)
        finish(state, req, "abort", error="deadline exceeded while queued",
               code="DEADLINE_EXCEEDED")


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
