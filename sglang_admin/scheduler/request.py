"""A request's life inside one rank (:class:`Req`) and a step's work per request
(:class:`Span`, gathered into a :class:`Batch`): the data the batching policy in
scheduler.py moves around. No torch here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sglang_admin.messages import ARGMAX_NEVER, SamplingParams
from sglang_admin.scheduler.embedding import EmbedProgress
from sglang_admin.scheduler.grammar import GrammarState
from sglang_admin.scheduler.radix_cache import TreeNode


@dataclass(eq=False, slots=True)
class Req:
    """A request's life inside one rank."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    deadline: float | None = None
    trace_id: str = ""
    output_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # KV slots of the first kv_len tokens
    kv_len: int = 0  # tokens whose KV is in the pool
    cached_len: int = 0  # of `slots`, the prefix owned by the radix tree (locked)
    cached_tokens: int = -1  # reported prompt tokens served from cache (first admission)
    last_node: TreeNode | None = None
    req_idx: int = -1  # row in the model's request-to-token table
    table_synced: int = 0  # entries of `slots` already written into that row
    aborted: str | None = None  # reason, once an abort arrived
    retractions: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    sent_tokens: int = 0  # output tokens already reported
    sent_logprobs: int = 0
    arrived: float = field(default_factory=time.monotonic)
    queue_time_s: float = 0.0  # from arrival to the first admission (sglang:queue_time)
    # issue 33 (preemption.py): when it last joined the waiting queue / the running batch
    waiting_since: float = 0.0
    running_since: float = 0.0
    lora_id: str = ""  # the adapter it holds (released when it ends); "": the base model
    lora_slot: int = -1  # that adapter's slot in the model's LoRA buffers
    lora_ns: int = 0  # its radix cache namespace (lora_registry.cache_key)
    # issue 10: parallel sampling, stop strings, prompt logprobs, hidden states
    index: int = 0  # sample index among the request's n
    key: str = ""  # rank-side key (parallel_sampling.sample_key); rid for sample 0
    fork_of: Req | None = None  # the sample that prefills the shared prompt
    done: bool = False
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    logprob_start_len: int = -1
    token_ids_logprob: list[int] = field(default_factory=list)
    return_hidden_states: bool = False
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_ids_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    hidden_states: list[list[float]] = field(default_factory=list)
    sent_extras: int = 0
    embed: EmbedProgress | None = None  # issue 32: an Embed request's pooling

    grammar: GrammarState | None = None  # its own matcher, when constrained (n > 1: fork())
    # from this output length on its token is the logits' argmax alone (model/step_io.py's
    # SeqInput.argmax_from), worked out once
    argmax_from: int = field(init=False, default=ARGMAX_NEVER)
    # a decode step gives it a token and nothing more to keep (no logprobs, prompt logprobs,
    # hidden states or grammar): postprocess's short path
    token_only: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.rid
        # hidden states, prompt logprobs or a grammar: every sampled row goes through sample()
        beyond_token = bool(self.return_hidden_states or self.logprob_start_len >= 0
                            or self.sampling.grammar_kind)
        if not beyond_token:
            self.argmax_from = self.sampling.argmax_from(
                self.return_logprob or self.top_logprobs_num > 0)
        self.token_only = not (beyond_token or self.return_logprob
                               or self.sampling.max_new_tokens <= 0)

    @property
    def fill_ids(self) -> list[int]:
        """Every token of the sequence so far: prompt then output."""
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building the whole sequence (a decode step takes
        one token of it per request)."""
        prompt = len(self.prompt_ids)
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        if end <= prompt:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt]


@dataclass(slots=True)
class Span:
    """The work of one request in one step: run tokens [start, end) of its sequence."""

    req: Req
    start: int
    end: int
    table_start: int
    sample: bool


@dataclass
class Batch:
    spans: list[Span]

    @property
    def is_decode(self) -> bool:
        return all(s.end - s.start == 1 and s.start > 0 for s in self.spans)

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.spans)
