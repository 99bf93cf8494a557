"""A request's life inside one rank (:class:`Req`, its state grouped by concern) and a step's
work per request (:class:`Span`, gathered into a :class:`Batch`): the data the batching
policy moves around. No torch here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sglang_admin.messages import ARGMAX_NEVER, GenerateReq, SamplingParams
from sglang_admin.scheduler.embedding import EmbedProgress
from sglang_admin.scheduler.grammar import GrammarState
from sglang_admin.scheduler.parallel_sampling import sample_key
from sglang_admin.scheduler.radix_cache import TreeNode

if TYPE_CHECKING:
    from sglang_admin.scheduler.speculative.policy import SpecProgress

TopList = list[tuple[int, float]]


@dataclass(eq=False, slots=True)
class SamplingState:
    """How a request's tokens are chosen and when it stops: its parameters, its stop strings
    (stop_strings.py) and, when constrained, its own grammar matcher."""

    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False  # keep a matched stop string's tokens in the output
    grammar: GrammarState | None = None  # set once compiled (grammar.py; n > 1: fork())


@dataclass(eq=False, slots=True)
class LoraHold:
    """The LoRA adapter a request holds while it lives (released when it ends)."""

    lora_id: str = ""  # "": the base model
    slot: int = -1  # the adapter's slot in the model's LoRA buffers
    namespace: int = 0  # its radix cache namespace (lora_registry.cache_key)


@dataclass(eq=False, slots=True)
class LogprobState:
    """The logprobs a request asked for and what its steps returned so far (kept by
    postprocess and output_extras.py, sent from ``sent`` / ``sent_token_ids`` on)."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: prompt logprobs from this position (sample 0 only)
    token_ids_logprob: list[int] = field(default_factory=list)  # logprobs of these ids
    logprobs: list[float] = field(default_factory=list)  # one per output token
    top_logprobs: list[TopList] = field(default_factory=list)
    sent: int = 0  # of logprobs and top_logprobs, those already reported
    input_logprobs: list[float | None] = field(default_factory=list)  # prompt positions
    input_top_logprobs: list[TopList] = field(default_factory=list)
    input_sent: bool = False  # the prompt logprobs went out (with the first output token)
    token_ids_logprobs: list[TopList] = field(default_factory=list)  # one per output token
    sent_token_ids: int = 0

    @property
    def wanted(self) -> bool:
        """Any per-token logprob asked for."""
        return self.return_logprob or self.top_logprobs_num > 0


@dataclass(eq=False, slots=True)
class HiddenStates:
    """The last layer's hidden state per output token, when the request asked for it."""

    wanted: bool = False
    states: list[list[float]] = field(default_factory=list)
    sent: int = 0


@dataclass(eq=False, slots=True)
class Req:
    """A request's life inside one rank: who it is, its sequence, its KV memory, and its
    sampling, LoRA, logprob and hidden-state state in groups of their own."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingState
    deadline: float | None = None
    trace_id: str = ""
    # parallel sampling (parallel_sampling.py)
    index: int = 0  # sample index among the request's n
    key: str = ""  # rank-side key (parallel_sampling.sample_key); rid for sample 0
    fork_of: Req | None = None  # the sample that prefills the shared prompt
    lora: LoraHold = field(default_factory=LoraHold)
    logprob: LogprobState = field(default_factory=LogprobState)
    hidden: HiddenStates = field(default_factory=HiddenStates)
    embed: EmbedProgress | None = None  # an Embed request's pooling
    spec: SpecProgress | None = None  # speculative decoding (speculative/policy.py); None: off
    # the sequence and what of it was reported
    output_ids: list[int] = field(default_factory=list)
    sent_tokens: int = 0  # output tokens already reported
    # KV memory (kv_memory.py)
    slots: list[int] = field(default_factory=list)  # KV slots of the first kv_len tokens
    kv_len: int = 0  # tokens whose KV is in the pool
    cached_len: int = 0  # of `slots`, the prefix owned by the radix tree (locked)
    last_node: TreeNode | None = None
    req_idx: int = -1  # row in the model's request-to-token table
    table_synced: int = 0  # entries of `slots` already written into that row
    # life
    arrived: float = field(default_factory=time.monotonic)
    cached_tokens: int = -1  # reported prompt tokens served from cache (first admission)
    queue_time_s: float = 0.0  # from arrival to the first admission (sglang:queue_time)
    # turns (preemption.py): when it last joined the waiting queue / the running batch
    waiting_since: float = 0.0
    running_since: float = 0.0
    aborted: str | None = None  # reason, once an abort arrived
    retractions: int = 0
    done: bool = False
    # from this output length on its token is the logits' argmax alone (model/step_io.py's
    # SeqInput.argmax_from), worked out once
    argmax_from: int = field(init=False, default=ARGMAX_NEVER)
    # a decode step gives it a token and nothing more to keep (no logprobs, prompt logprobs,
    # hidden states or grammar): postprocess's short path
    token_only: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.rid
        params = self.sampling.params
        # hidden states, prompt logprobs or a grammar: every sampled row goes through sample()
        beyond_token = bool(self.hidden.wanted or self.logprob.logprob_start_len >= 0
                            or params.grammar_kind)
        if not beyond_token:
            self.argmax_from = params.argmax_from(self.logprob.wanted)
        self.token_only = not (beyond_token or self.logprob.return_logprob
                               or params.max_new_tokens <= 0)

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


def samples_of(msg: GenerateReq, trace_id: str = "") -> list[Req]:
    """The rank-side requests of a Generate: one per sample (``n``), each but the first a
    fork of the first, whose prefilled prompt they share."""
    samples: list[Req] = []
    for index in range(max(msg.n, 1)):
        samples.append(Req(
            rid=msg.rid,
            prompt_ids=list(msg.input_ids),
            sampling=SamplingState(msg.sampling, msg.stop, msg.no_stop_trim),
            deadline=msg.deadline,
            trace_id=trace_id,
            index=index,
            key=sample_key(msg.rid, index),
            fork_of=samples[0] if samples else None,
            logprob=LogprobState(
                msg.return_logprob, msg.top_logprobs_num,
                # prompt logprobs: computed by sample 0 alone (the others share its KV)
                msg.logprob_start_len if index == 0 else -1,
                msg.token_ids_logprob,
            ),
            hidden=HiddenStates(msg.return_hidden_states),
            embed=EmbedProgress() if msg.embed else None,
        ))
    return samples


@dataclass(slots=True)
class Span:
    """The work of one request in one step: run tokens [start, end) of its sequence."""

    req: Req
    start: int
    end: int
    table_start: int
    sample: bool
    # speculative decoding: the draft tokens verified after the last token (the span runs
    # [start, start + 1) of the sequence, then these; end = start + 1 + len(draft))
    draft: list[int] | None = None


@dataclass
class Batch:
    """The work of one forward step: a span per request, running ones first."""

    spans: list[Span]

    @property
    def is_decode(self) -> bool:
        return all((s.end - s.start == 1 or s.draft) and s.start > 0 for s in self.spans)

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.spans)
