"""What one rank's batching policy keeps between steps: its queues, running set, memory,
pending outputs and counters, and the figures read from them. No torch here."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_admin.messages import ReqOutput
from sglang_admin.scheduler.grammar import GrammarQueue
from sglang_admin.scheduler.kv_memory import RequestMemory
from sglang_admin.scheduler.lora_registry import LoraRegistry
from sglang_admin.scheduler.request import Req
from sglang_admin.scheduler.speculative.policy import (
    Drafter,
    SpecConfig,
    SpecCounters,
    make_drafter,
)
from sglang_admin.scheduler.stop_strings import Detokenize

THROUGHPUT_WINDOW_S = 5.0


@dataclass
class SchedulerConfig:
    """The limits a rank schedules within."""

    token_capacity: int
    max_running_requests: int
    max_prefill_tokens: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    disable_radix_cache: bool = False
    pools_every_token: bool = False  # an embedding model pooling CLS or MEAN
    # a request waiting this long for a place preempts the longest-running
    # decode (preemption.py); 0: never (a full rank admits nothing until a request ends)
    preempt_wait_s: float = 0.0
    # speculative decoding (speculative/policy.py); None: off
    speculative: SpecConfig | None = None


class SchedulerState:
    """Waiting queue, running set, request memory and counters of one rank."""

    def __init__(
        self, config: SchedulerConfig, on_kv_event: Callable[[Any], None] | None = None,
        grammar_queue: GrammarQueue[Req] | None = None,
    ) -> None:
        self.config = config
        self.grammar_queue = grammar_queue  # constrained requests wait here for a compile
        self.memory = RequestMemory(
            config.token_capacity, config.max_running_requests, config.disable_radix_cache,
            on_kv_event, config.pools_every_token,
        )
        self.allocator = self.memory.allocator
        self.cache = self.memory.cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}  # sample key -> request, while it lives
        self.groups: dict[str, list[Req]] = {}  # rid -> its samples, for n > 1
        self.eos = frozenset(config.eos_token_ids)
        self.admission_paused = False  # set while a flush waits for idle
        self.paused: str | None = None  # the PauseGeneration mode while paused
        self.pending_outputs: list[ReqOutput] = []  # made outside postprocess (abort, expiry)
        self.num_retracted = 0
        self.num_preempted = 0  # running requests that gave their place to a waiting one
        self.clock: Callable[[], float] = time.monotonic  # what turns go by (tests set theirs)
        self.lora: LoraRegistry | None = None  # set by the rank when LoRA is enabled
        self.detokenize: Detokenize | None = None  # for stop strings (set by the rank)
        # --reasoning-parser's think-span end token (-1: none; set by the rank)
        self.think_end_id = -1
        # the drafter and the rank's accept figures (speculative/policy.py)
        self.drafter: Drafter | None = (
            make_drafter(config.speculative) if config.speculative is not None else None)
        self.spec = SpecCounters()
        self.reset_counters()

    def reset_counters(self) -> None:
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated: deque[tuple[float, int]] = deque()

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def num_used_tokens(self) -> int:
        """KV slots held by requests (running, or forked samples waiting for their parent):
        the pool less what is free and what the prefix cache may evict, as SGLang's
        ``max_total_num_tokens - (available + evictable)``. 0 on an idle rank, however warm
        its cache."""
        return self.memory.used_tokens

    @property
    def num_free_tokens(self) -> int:
        """KV slots nobody holds: neither a request nor the prefix cache."""
        return self.allocator.available

    @property
    def cache_hit_rate(self) -> float:
        if not self.prompt_tokens_total:
            return 0.0
        return self.cached_tokens_total / self.prompt_tokens_total

    def gen_throughput(self, now: float | None = None) -> float:
        """Generated tokens per second over the recent window."""
        now = time.monotonic() if now is None else now
        while self.generated and self.generated[0][0] < now - THROUGHPUT_WINDOW_S:
            self.generated.popleft()
        if not self.generated:
            return 0.0
        span = max(now - self.generated[0][0], 1e-3)
        return sum(n for _, n in self.generated) / max(span, 1.0)

    def waiting_uncached_tokens(self) -> int:
        """Prompt tokens the waiting requests still have to compute."""
        # a forked sample (n > 1) computes one token of the prompt its parent shares
        sharing = not self.cache.disable
        return sum(1 if r.fork_of is not None and sharing else r.seq_len - r.kv_len
                   for r in self.waiting)

    @property
    def num_grammar_queue_reqs(self) -> int:
        """Requests waiting for their grammar to compile (GetLoads' queues.grammar)."""
        return len(self.grammar_queue) if self.grammar_queue is not None else 0

    def take_outputs(self) -> list[ReqOutput]:
        """Outputs produced outside a step (aborts, refusals, expiries)."""
        out, self.pending_outputs = self.pending_outputs, []
        return out
