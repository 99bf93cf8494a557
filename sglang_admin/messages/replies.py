"""The typed messages a rank sends its server: its readiness, state, heartbeat, a step's
outputs, KV events, and the answers to admin calls with their typed results (slotted
dataclasses registered with the codec, messages/codec.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sglang_admin.messages.types import message

# ---------------------------------------------------------------- scheduler -> server


@message
@dataclass(slots=True)
class RankState:
    """What a rank reports about itself: memory, queues, cache, throughput, profiler."""

    dp_rank: int
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    token_capacity: int = 0
    # The KV pool in three parts (docs/kv-figures.md): held by requests, cached and
    # evictable, free; they add up to token_capacity.
    num_used_tokens: int = 0
    num_evictable_tokens: int = 0
    num_free_tokens: int = 0
    cache_hit_rate: float = 0.0
    gen_throughput: float = 0.0
    profiler_state: str = "idle"
    last_step_time_s: float = 0.0
    forward_steps: int = 0
    device: str = "cpu"
    pid: int = 0
    flush_pending: bool = False
    paused: str = ""  # the PauseGeneration mode while paused
    num_waiting_uncached_tokens: int = 0
    num_retracted_reqs: int = 0
    max_running_requests: int = 0
    weight_gb: float = 0.0
    kv_cache_gb: float = 0.0
    # decode steps so far and their seconds by phase (scheduler/profiling/step_timing.py's PHASES)
    decode_steps: int = 0
    decode_phase_s: dict[str, float] = field(default_factory=dict)
    timestamp: float = 0.0
    lora_slots_used: int = 0  # adapters loaded (LoRA only)
    lora_slots_total: int = 0  # --max-loaded-loras; 0: LoRA is off
    num_grammar_queue_reqs: int = 0  # waiting for their grammar to compile
    # speculative decoding since start (scheduler/speculative/policy.py's SpecCounters):
    # request-steps that verified a draft, draft tokens verified, of them accepted
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    graph_gb: float = 0.0  # device memory of the captured CUDA graphs (0: none)
    num_paused_reqs: int = 0  # requests held by PauseGeneration (0 while not paused)

    @property
    def spec_accept_length(self) -> float:
        """Mean tokens one verify step gave a request (accepted drafts + its own): SGLang's
        avg_spec_accept_length; 0 before any."""
        if not self.spec_verify_steps:
            return 0.0
        return (self.spec_accepted_tokens + self.spec_verify_steps) / self.spec_verify_steps

    @property
    def spec_accept_rate(self) -> float:
        """Accepted draft tokens over drafted ones; 0 before any."""
        return (self.spec_accepted_tokens / self.spec_draft_tokens
                if self.spec_draft_tokens else 0.0)


@message
@dataclass(slots=True)
class ModelInfo:
    """What the server and its callers need to know about the model a rank serves."""

    model_path: str
    tokenizer_path: str | None
    architectures: list[str]
    model_type: str
    vocab_size: int
    context_length: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str
    weight_bytes: int = 0
    token_capacity: int = 0  # KV pool tokens (set by the rank)
    kv_cache_bytes: int = 0
    device: str = "cpu"
    weight_version: str = "default"
    # Embed: what the model serves (model/embedding_spec.py)
    is_generation: bool = True
    num_labels: int = 0  # a classifier's labels; 0 otherwise
    id2label: dict[str, str] = field(default_factory=dict)
    embedding_dim: int = 0  # the length of an Embed answer; 0 for a generation model
    pooling: str = ""  # LAST | CLS | MEAN for an embedding model
    # the sampling defaults of the checkpoint's generation_config.json (temperature, top_p,
    # top_k, min_p, repetition_penalty: those it names), GetModelInfo's
    # default_sampling_params_json
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # --reasoning-parser's think-span end token in this tokenizer (-1: none; the rank sets it)
    think_end_id: int = -1

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (JSON and msgpack friendly)."""
        return {name: getattr(self, name) for name in _model_info_fields()}


def _model_info_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(ModelInfo))


@message
@dataclass(slots=True)
class ReadyMsg:
    """A rank has loaded its model and is serving."""

    dp_rank: int
    pid: int
    model_info: ModelInfo
    state: RankState


@message
@dataclass(slots=True)
class FailedMsg:
    """A rank could not start (e.g. the model did not load)."""

    dp_rank: int
    error: str


@message
@dataclass(slots=True)
class ReqOutput:
    """One request's progress in one step: new tokens, and the finish when it finished.

    The fields up to ``index`` are what every output says; a BatchOutput carries an output
    whose later fields all hold their defaults (most outputs of most steps) as those alone.
    """

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_time_s: float = 0.0  # seconds the request waited on the rank before admission
    index: int = 0  # which of the request's n samples
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_token_id: int | None = None
    error: str | None = None  # set when the scheduler refused or dropped the request
    error_code: str | None = None  # grpc StatusCode name for error
    # generation features
    matched_stop_str: str | None = None
    stop_trim: int = 0  # trailing output tokens that carry the matched stop string
    input_logprobs: list[float | None] = field(default_factory=list)  # prompt positions
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_ids_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    hidden_states: list[list[float]] = field(default_factory=list)  # per new output token
    embedding: list[float] = field(default_factory=list)  # an Embed request's vector (final)
    # speculative decoding (final output, on): verify steps, draft tokens verified,
    # of them accepted
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@message
@dataclass(slots=True)
class BatchOutput:
    """Every request update a rank produced in one step, in one message."""

    dp_rank: int
    outputs: list[ReqOutput]


@message
@dataclass(slots=True)
class AdminReply:
    """A rank's answer to an admin or state request, matched by rid.

    ``result`` is the op's typed result (one of the registered result messages below, or
    a RankState for a StateReq), None when the op has nothing more to say.
    """

    rid: str
    dp_rank: int
    success: bool
    message: str = ""
    result: Any = None


@message
@dataclass(slots=True)
class FlushResult:
    tokens_freed: int = 0


@message
@dataclass(slots=True)
class ProfileStopResult:
    files: list[str] = field(default_factory=list)
    profile_id: str = ""


@message
@dataclass(slots=True)
class CountResult:
    """How many requests an op aborted, retracted or held."""

    count: int = 0


@message
@dataclass(slots=True)
class WeightsResult:
    """The rank's model after a weight op, and the requests it paused or aborted first."""

    model_info: ModelInfo
    num_paused_requests: int = 0


@message
@dataclass(slots=True)
class WeightValues:
    shape: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@message
@dataclass(slots=True)
class DigestResult:
    digest: str = ""
    tp_digests: list[str] = field(default_factory=list)  # tp > 1: each TP rank's, in order


@message
@dataclass(slots=True)
class MemoryResult:
    bytes_released: int = 0


@message
@dataclass(slots=True)
class RejectedResult:
    """A rank refused a request before doing anything: ``code`` is the gRPC status the
    server answers with (INVALID_ARGUMENT, ALREADY_EXISTS, NOT_FOUND, ...)."""

    code: str
    reason: str


@message
@dataclass(slots=True)
class StateUpdate:
    """Published by a rank after steps that changed its state (drives GetLoads)."""

    state: RankState


@message
@dataclass(slots=True)
class Heartbeat:
    """Sent by a rank's heartbeat thread every fraction of --watchdog-probe-timeout: the
    process is alive, and in a forward step since ``step_started`` (wall time; 0: not in a
    step); its main loop last checked its published state at ``state_confirmed`` (wall
    time). The server's watchdog (server/watchdog.py) reads it."""

    dp_rank: int
    step_started: float
    forward_steps: int
    state_confirmed: float
    tp_rank: int = 0  # --tp-size > 1: a TP follower of replica dp_rank beats too


@message
@dataclass(slots=True)
class KvEvents:
    """Radix cache events of one step: ("stored", tokens, parent_hash, hash) etc."""

    dp_rank: int
    events: list[list[Any]]


@message
@dataclass(slots=True)
class LoraAdapterInfo:
    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False


@message
@dataclass(slots=True)
class LoraResult:
    """The adapters a rank holds after a LoRA op, and those it evicted to make room."""

    adapters: list[LoraAdapterInfo] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    error_code: str = ""  # on failure: the gRPC status code name that fits (INVALID_ARGUMENT...)
