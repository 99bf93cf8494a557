"""Speculative decoding in a step's plan: the drafts of the running requests that decode this
step, how many tokens each may draft, and the verify span that runs a draft. No torch here."""

from __future__ import annotations

from sglang_admin.scheduler.request import Req, Span
from sglang_admin.scheduler.state import SchedulerState


def plan_drafts(state: SchedulerState) -> dict[int, list[int]]:
    """The drafts of the running requests that decode
    this step and may draft, by ``id(req)``. A request whose acceptance estimate makes no
    draft length pay gets a shadow draft instead (judged later against what it decodes)."""
    drafter = state.drafter
    config = state.config
    spec = config.speculative
    assert drafter is not None and spec is not None
    reqs: list[Req] = []
    limits: list[int] = []
    shadows: list[bool] = []
    for req in state.running:
        prog = req.spec
        if prog is None or req.seq_len - req.kv_len != 1 or not may_draft(req):
            continue
        prog.judge_shadow(req.output_ids)
        limit = draft_limit(req, prog.k, config.context_length, config.token_capacity)
        if limit <= 0:
            continue
        k = prog.draft_length(limit) if spec.adaptive else limit
        if k > 0:
            reqs.append(req)
            limits.append(k)
            shadows.append(False)
        elif not prog.shadow:
            reqs.append(req)
            limits.append(limit)
            shadows.append(True)
    if not reqs:
        return {}
    drafts: dict[int, list[int]] = {}
    for req, draft, shadow in zip(reqs, drafter.propose(reqs, limits), shadows):
        if not draft:
            continue
        if shadow:
            req.spec.shadow, req.spec.shadow_at = draft, len(req.output_ids)
        else:
            drafts[id(req)] = draft
    return drafts


def verify_span(req: Req, draft: list[int]) -> Span:
    """The span that runs the request's last token and its draft (slots reserved)."""
    start = req.kv_len
    end = start + 1 + len(draft)
    span = Span(req, start, end, req.table_synced, True, draft)
    req.table_synced = end
    return span


def may_draft(req: Req) -> bool:
    """Whether a request's decode steps may carry drafts: not under a grammar (its matcher
    would have to walk the draft), not returning hidden states, not an Embed, and it
    generates (max_new_tokens > 0). Everything else (penalties, logprobs, stop strings,
    n > 1, LoRA, sampling) verifies exactly (scheduler/speculative/verify.py)."""
    params = req.sampling.params
    return (req.spec is not None and not params.grammar_kind
            and req.sampling.grammar is None and not req.hidden.wanted
            and req.embed is None and params.max_new_tokens > 0)


def draft_limit(req: Req, k: int, context_length: int, token_capacity: int) -> int:
    """How many draft tokens the request's next step may verify: its adaptive length, no
    more than it may still generate less the step's own token, nor past the context."""
    seq_len = req.seq_len
    room = min(req.sampling.params.max_new_tokens - len(req.output_ids) - 1,
               context_length - seq_len - 1, token_capacity - seq_len - 1)
    return max(0, min(k, room))
