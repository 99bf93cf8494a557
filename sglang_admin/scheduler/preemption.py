"""Turn-taking on a full rank: a request that has waited ``wait_s`` for a place in the
running batch takes the place of the decoding request that has run longest.

Without it a rank whose running batch (``--max-running-requests``) or KV pool is full of
long streams admits nothing until one of them ends, which for thousands of tokens on a CPU
is minutes: a one-token request waits behind them. With it, an overdue request goes to the
head of the queue and, when it would not fit, the running request that has run longest
(at least ``wait_s`` since its last admission) is *preempted*: its computed KV goes to the
radix cache (unlocked, so evictable) and it waits at the queue's tail. Admitted again, it
matches its own KV back from the cache and goes on where it stopped. A stopped stream
takes its turn back only while that KV is still cached: when the pool cannot hold every
stream, turns would evict and recompute them over and over, so it then waits for a place
as SGLang's requests do (and recomputes what was evicted, once, as a retracted request
does). A new request always gets its turn. :func:`plan_turns` says who moves;
:func:`take_turns` moves them, before each step is planned (``Scheduler.schedule``).
No torch here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from sglang_admin.scheduler.lora_registry import cache_key
from sglang_admin.scheduler.parallel_sampling import fork_ready
from sglang_admin.scheduler.request import Req
from sglang_admin.scheduler.state import SchedulerState

logger = logging.getLogger(__name__)

# Overdue requests considered per step: bounds the work of one step's planning (and the
# churn) when many requests are overdue at once; the rest get their turn next steps.
MAX_TURNS_PER_STEP = 16
# A request stopped mid-stream takes a turn only while its KV is cached: it needs at most
# this many slots to go on (1 when all of it is).
RESUME_TOKENS = 32


@dataclass
class Turns:
    """One step's plan: ``first`` (overdue requests given room, in :func:`overdue`'s
    order) go to the head of the queue; ``victims`` (running requests, longest run first)
    give their place up."""

    first: list[Req] = field(default_factory=list)
    victims: list[Req] = field(default_factory=list)


def is_decoding(req: Req) -> bool:
    """A running request between two decode steps: its prompt and every output token but
    the last are in the KV pool (not one still prefilling, nor an Embed request)."""
    return (req.embed is None and not req.aborted and req.sampling.params.max_new_tokens > 0
            and req.kv_len >= len(req.prompt_ids) and req.kv_len == req.seq_len - 1)


def overdue(waiting: Iterable[Req], now: float, wait_s: float, sharing: bool) -> list[Req]:
    """Waiting requests that may be admitted and have waited ``wait_s`` or longer: those
    with no output yet first (a new request's first token before a stopped stream's
    next), each kind the longest wait first."""
    late = [r for r in waiting if now - r.waiting_since >= wait_s and fork_ready(r, sharing)]
    late.sort(key=lambda r: (bool(r.output_ids), r.waiting_since))
    return late


def plan_turns(
    waiting: Iterable[Req],
    running: Sequence[Req],
    now: float,
    wait_s: float,
    rows_free: int,
    memory_free: int,
    need: Callable[[Req], int],
    sharing: bool = True,
) -> Turns:
    """Who moves this step so that overdue requests get a place.

    ``rows_free``: places left in the running batch; ``memory_free``: KV slots admission may
    use (free + evictable - the running requests' headroom); ``need(req)``: the slots a
    waiting request's admission takes (its sequence less its cached prefix).

    A request that has no output yet (new, or retracted before its first token) may take
    a victim's place and its KV (a victim's KV becomes evictable). One that was stopped
    mid-stream (preempted, or retracted for memory) only takes a place, and only when its
    KV is still cached (it needs at most ``RESUME_TOKENS``) and the free memory holds it:
    streams take turns while the pool holds them all, and when it does not, turns would
    mean evicting and recomputing them over and over, so they wait as SGLang's do. An
    overdue request no victim can make room for moves nobody and keeps its place."""
    if wait_s <= 0:
        return Turns()
    late = overdue(waiting, now, wait_s, sharing)[:MAX_TURNS_PER_STEP]
    if not late:
        return Turns()
    candidates = sorted(
        (r for r in running if is_decoding(r) and now - r.running_since >= wait_s),
        key=lambda r: r.running_since,
    )
    turns = Turns()
    for req in late:
        wanted = need(req)
        new = not req.output_ids
        if not new and (wanted > RESUME_TOKENS or memory_free < wanted):
            continue
        taken: list[Req] = []
        rows, memory = rows_free, memory_free
        while (rows <= 0 or memory < wanted) and candidates:
            victim = candidates.pop(0)
            taken.append(victim)
            rows += 1
            memory += victim.kv_len + 1  # its KV, and the headroom it no longer needs
        if rows <= 0 or memory < wanted:
            candidates[:0] = taken  # no room even so: nobody moves for this one
            continue
        turns.first.append(req)
        turns.victims += taken
        rows_free, memory_free = rows - 1, memory - wanted - 1  # and its own headroom
    return turns


def take_turns(state: SchedulerState) -> None:
    """Before a step is planned: preempt running decodes for the requests that waited
    ``preempt_wait_s`` for a place; those go to the head of the queue, their victims to
    its tail."""
    wait_s = state.config.preempt_wait_s
    if wait_s <= 0 or not state.waiting or state.admission_paused:
        return
    now = state.clock()
    memory = state.allocator.available + state.cache.evictable_size - (len(state.running) + 1)
    turns = plan_turns(
        state.waiting, state.running, now, wait_s,
        rows_free=min(state.config.max_running_requests - len(state.running),
                      len(state.memory.free_rows)),
        memory_free=memory, need=lambda req: admission_need(state, req),
        sharing=not state.cache.disable,
    )
    if not turns.first:
        return
    for victim in turns.victims:
        preempt(state, victim, now)
    first = set(map(id, turns.first))
    rest = [r for r in state.waiting if id(r) not in first]
    state.waiting.clear()
    state.waiting.extend([*turns.first, *rest])


def admission_need(state: SchedulerState, req: Req) -> int:
    """KV slots admitting ``req`` takes now: its sequence less the prefix cached."""
    seq = req.fill_ids
    cached = state.cache.match_prefix(cache_key(seq[:-1], req.lora.namespace)).slots
    return len(seq) - len(cached)


def preempt(state: SchedulerState, req: Req, now: float) -> None:
    """A running decode gives its place up: its computed KV goes to the radix cache
    (unlocked, so evictable; it matches it back when admitted again) and it waits at the
    tail of the queue."""
    logger.debug("preempting %s after %.1f s running, for a waiting request", req.rid,
                 now - req.running_since)
    state.memory.release(req, keep=True)
    state.running.remove(req)
    state.num_preempted += 1
    req.waiting_since = now
    state.waiting.append(req)
