"""What a step may return beside the sampled token, kept per request at the rank:
prompt (input) logprobs, the logprobs of requested token ids, and the last layer's hidden
state of each output token.

The model runner reports them on its per-sequence output (duck-typed here so that the
scheduler stays free of torch); :func:`absorb_prompt` and :func:`absorb_token` copy them
onto the request, :func:`attach` puts the unsent ones on the request's next output.
"""

from __future__ import annotations

from typing import Any, Protocol

from sglang_admin.messages import ReqOutput

TopList = list[tuple[int, float]]


class StepExtras(Protocol):
    """The fields the runner's per-sequence output carries for these features."""

    input_logprobs: list[tuple[int, float | None, TopList]] | None  # (prompt pos, lp, top)
    token_ids_logprobs: TopList | None
    hidden_state: list[float] | None
    embedding: list[float] | None  # an Embed request's vector (issue 32)


def absorb_prompt(req: Any, extra: StepExtras | None) -> None:
    """Keep the input logprobs of prompt positions not seen yet (a retracted request
    recomputes positions it already reported: those are skipped), and an Embed request's
    vector."""
    if extra is not None and extra.embedding is not None and req.embed is not None:
        req.embed.vector = extra.embedding
    if extra is None or not extra.input_logprobs or req.logprob_start_len < 0:
        return
    for pos, value, top in extra.input_logprobs:
        if pos == req.logprob_start_len + len(req.input_logprobs):
            req.input_logprobs.append(value)
            req.input_top_logprobs.append(top)


def absorb_token(req: Any, extra: StepExtras | None) -> None:
    """Keep what comes with an output token (called once per appended token)."""
    if extra is None:
        return
    if req.token_ids_logprob and req.return_logprob:
        req.token_ids_logprobs.append(list(extra.token_ids_logprobs or []))
    if req.return_hidden_states and extra.hidden_state is not None:
        req.hidden_states.append(extra.hidden_state)


def attach(req: Any, out: ReqOutput, final: bool) -> None:
    """Move the request's unsent extras onto ``out``: per-token ones every time, the input
    logprobs with the final output."""
    start = req.sent_extras
    out.token_ids_logprobs = req.token_ids_logprobs[start:]
    out.hidden_states = req.hidden_states[start:]
    req.sent_extras = max(len(req.token_ids_logprobs), len(req.hidden_states))
    if final and req.embed is not None and req.embed.vector is not None:
        out.embedding = req.embed.vector
    if final:
        out.input_logprobs = list(req.input_logprobs)
        out.input_top_logprobs = list(req.input_top_logprobs)
