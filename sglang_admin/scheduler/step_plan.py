"""What the next forward step runs: every running request's decode token or next prefill
chunk, then new admissions while the step has room; retraction when memory runs out. No
torch here."""

from __future__ import annotations

import logging
import time

from sglang_admin.scheduler.parallel_sampling import fork_ready
from sglang_admin.scheduler.request import Batch, Req, Span
from sglang_admin.scheduler.speculative.plan import plan_drafts, verify_span
from sglang_admin.scheduler.state import SchedulerState

logger = logging.getLogger(__name__)


def plan_step(state: SchedulerState) -> Batch | None:
    """The next step's work: running requests first, then admissions in arrival order."""
    budget = state.config.max_prefill_tokens
    drafts = plan_drafts(state) if state.drafter is not None else None
    spans = [] if drafts else decode_all(state)
    # Running requests first: decode (1 token) or the next chunk of their prefill.
    i = len(spans)  # all of them when decode_all took the step
    while i < len(state.running):
        req = state.running[i]
        seq_len = len(req.prompt_ids) + len(req.output_ids)
        n = min(seq_len - req.kv_len, max(budget, 1))
        draft = drafts.get(id(req)) if drafts else None
        # a draft only where free or evictable slots are left for it beside one for each
        # request after this one: speculation may evict least-recently-used cache, as any
        # step's tokens do (a long-running worker's pool is full of it), never retracts a
        # request
        if (draft and n == 1
                and state.allocator.available + state.cache.evictable_size
                >= 1 + len(draft) + len(state.running) - i - 1
                and state.memory.reserve(req, 1 + len(draft))):
            spans.append(verify_span(req, draft))
            i += 1
            continue
        if not state.memory.reserve(req, n):
            # Out of memory even after eviction: retract the newest running request,
            # then retry running[i] with the freed memory (the next request when the
            # victim was req itself).
            victim = state.running[-1]
            retract(state, victim)
            spans = [s for s in spans if s.req is not victim]
            continue
        spans.append(span_of(req, n, seq_len))
        budget -= n if n > 1 else 0
        i += 1
    spans += admit_waiting(state, budget)
    return Batch(spans) if spans else None


def admit_waiting(state: SchedulerState, budget: int) -> list[Span]:
    """Admit waiting requests, in arrival order, while ``budget`` prefill tokens, table
    rows and memory last; their spans."""
    spans: list[Span] = []
    while (
        state.waiting
        and not state.admission_paused
        and budget > 0
        and len(state.running) < state.config.max_running_requests
    ):
        pick = next_admissible(state)
        if pick is None:
            break
        req = state.waiting[pick]
        if not admit(state, req):
            break
        del state.waiting[pick]
        n = min(req.seq_len - req.kv_len, budget)
        if not state.memory.reserve(req, n):
            state.memory.release(req)
            state.waiting.insert(pick, req)
            break
        state.running.append(req)
        spans.append(span_of(req, n, req.seq_len))
        budget -= n
    return spans


def decode_all(state: SchedulerState) -> list[Span]:
    """The spans of a step in which every running request decodes one token and the
    pool has a free slot for each (most steps): what :func:`plan_step`'s loop makes of
    them, with one allocation for all. Empty when that is not the case."""
    running = state.running
    if not running or state.allocator.available < len(running):
        return []
    for req in running:
        if len(req.prompt_ids) + len(req.output_ids) - req.kv_len != 1:
            return []
    slots = state.allocator.alloc(len(running))  # the order of one alloc(1) per request
    assert slots is not None
    spans = []
    for req, slot in zip(running, slots):
        req.slots.append(slot)
        start = req.kv_len
        spans.append(Span(req, start, start + 1, req.table_synced,
                          req.sampling.params.max_new_tokens > 0))
        req.table_synced = start + 1
    return spans


def next_admissible(state: SchedulerState) -> int | None:
    """Queue position of the first request that may be admitted: in arrival order,
    skipping forked samples whose parent has not prefilled the shared prompt yet."""
    sharing = not state.cache.disable
    for pos, req in enumerate(state.waiting):
        if fork_ready(req, sharing):
            return pos
    return None


def admit(state: SchedulerState, req: Req) -> bool:
    """Give a waiting request its cached prefix and a table row, keeping one token of
    headroom per running request for their next decode step; account its prompt at its
    first admission."""
    if not state.memory.admit(req, headroom=len(state.running) + 1,
                              may_wait=bool(state.running)):
        return False
    if req.cached_tokens < 0:  # first admission: account the prompt
        req.cached_tokens = min(req.kv_len, len(req.prompt_ids))
        req.queue_time_s = time.monotonic() - req.arrived
        state.prompt_tokens_total += len(req.prompt_ids)
        state.cached_tokens_total += req.cached_tokens
    req.running_since = state.clock()
    return True


def span_of(req: Req, n: int, seq_len: int) -> Span:
    """The request's next n tokens as a span (its table row synced up to their end)."""
    start, end = req.kv_len, req.kv_len + n
    table_start = req.table_synced
    req.table_synced = end
    # max_new_tokens = 0: prefill only, nothing sampled
    sample = end == seq_len and req.sampling.params.max_new_tokens > 0
    return Span(req, start, end, table_start, sample)


def retract(state: SchedulerState, req: Req) -> None:
    """Put a running request back at the head of the queue and free its KV, as SGLang's
    retract: the slots only it held go back to the pool, and the prefix it shares with
    the tree (its prompt, once prefilled) is unlocked, so the cache may evict it. It
    recomputes the rest when it is admitted again."""
    logger.info("retracting %s to free KV memory", req.rid)
    state.memory.release(req, keep=False)
    state.running.remove(req)
    req.retractions += 1
    state.num_retracted += 1
    req.waiting_since = state.clock()
    state.waiting.appendleft(req)
