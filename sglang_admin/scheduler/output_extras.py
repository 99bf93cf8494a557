"""What a step may return beside the sampled token, kept per request at the rank:
prompt (input) logprobs, the logprobs of requested token ids, the last layer's hidden state
of each output token, and an Embed request's vector.

The model runner reports them on its per-sequence output (:class:`StepResult`, duck-typed
so that the scheduler stays free of torch); :func:`absorb_prompt` and :func:`absorb_token`
copy them onto the request, :func:`attach` puts the unsent ones on the request's next
output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sglang_admin.messages import ReqOutput

if TYPE_CHECKING:
    from sglang_admin.scheduler.request import Req

TopList = list[tuple[int, float]]


class StepResult(Protocol):
    """One sequence's result of a forward step: model/step_io.py's ``SeqOutput``.

    ``token_id`` counts only for a span that samples; ``error`` set (with ``error_code``,
    a gRPC code name) fails that sequence's request alone."""

    token_id: int
    logprob: float | None
    top_logprobs: TopList | None
    error: str | None
    error_code: str | None
    input_logprobs: list[tuple[int, float | None, TopList]] | None  # (prompt pos, lp, top)
    token_ids_logprobs: TopList | None
    hidden_state: list[float] | None
    embedding: list[float] | None  # an Embed request's vector


def absorb_prompt(req: Req, result: StepResult | None) -> None:
    """Keep the input logprobs of prompt positions not seen yet (a retracted request
    recomputes positions it already reported: those are skipped), and an Embed request's
    vector."""
    if result is None:
        return
    if result.embedding is not None and req.embed is not None:
        req.embed.vector = result.embedding
    lp = req.logprob
    if not result.input_logprobs or lp.logprob_start_len < 0:
        return
    for pos, value, top in result.input_logprobs:
        if pos == lp.logprob_start_len + len(lp.input_logprobs):
            lp.input_logprobs.append(value)
            lp.input_top_logprobs.append(top)


def absorb_token(req: Req, result: StepResult) -> None:
    """Keep what comes with an output token (called once per appended token)."""
    lp = req.logprob
    if lp.return_logprob:
        lp.logprobs.append(float(result.logprob or 0.0))
        if lp.top_logprobs_num:
            lp.top_logprobs.append(list(result.top_logprobs or []))
        if lp.token_ids_logprob:
            lp.token_ids_logprobs.append(list(result.token_ids_logprobs or []))
    if req.hidden.wanted and result.hidden_state is not None:
        req.hidden.states.append(result.hidden_state)


def attach(req: Req, out: ReqOutput, final: bool) -> None:
    """Move the request's unsent extras onto ``out``: per-token ones every time, the input
    logprobs once, with the first output token (the prompt is prefilled then; SGLang's
    servicer sends them in the first streamed chunk) or the final output, and an Embed
    request's vector with the final output."""
    lp, hidden = req.logprob, req.hidden
    out.token_ids_logprobs = lp.token_ids_logprobs[lp.sent_token_ids :]
    lp.sent_token_ids = len(lp.token_ids_logprobs)
    out.hidden_states = hidden.states[hidden.sent :]
    hidden.sent = len(hidden.states)
    if not lp.input_sent and (final or out.new_token_ids):
        lp.input_sent = True
        out.input_logprobs = list(lp.input_logprobs)
        out.input_top_logprobs = list(lp.input_top_logprobs)
    if final and req.embed is not None and req.embed.vector is not None:
        out.embedding = req.embed.vector

