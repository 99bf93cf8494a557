"""The typed messages that cross the server <-> scheduler process boundary: slotted
dataclasses (and the constants their fields use), encoded by messages/codec.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

TraceCarrier = dict[str, str]

# A temperature below this samples greedily (SGLang's epsilon): dividing logits by a smaller
# one overflows float32 and makes no practical difference to the choice.
GREEDY_TEMPERATURE_EPS = 1e-6
# SamplingParams.argmax_from of a row whose token is never its logits' argmax alone
ARGMAX_NEVER = 1 << 62
# How a rank's StopProfile message starts when its profile had already ended at a cap
# (--profile-max-steps); the server passes such a message on to the caller.
PROFILE_STOPPED_BY_ITSELF = "Profiling stopped by itself"
# SamplingParams.grammar_kind values: the proto's SamplingParams.constraint oneof fields
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf_grammar", "structural_tag")


# ---------------------------------------------------------------- server -> scheduler


@dataclass(slots=True)
class SamplingParams:
    """Normalized sampling parameters (proto zeros already mapped to SGLang defaults)."""

    temperature: float = 0.0  # 0 (anything below GREEDY_TEMPERATURE_EPS) is greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Constrained decoding: one of GRAMMAR_KINDS and its text ("" kind: unconstrained)
    grammar_kind: str = ""
    grammar: str = ""

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def argmax_from(self, wants_logprobs: bool) -> int:
        """The output length from which a row's token is its logits' argmax and nothing more
        is asked (greedy, no penalty or bias, no logprobs; min_new_tokens masks the stop
        tokens before that); ARGMAX_NEVER for any other row."""
        if (self.is_greedy and not wants_logprobs and not self.logit_bias
                and self.repetition_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0):
            return self.min_new_tokens
        return ARGMAX_NEVER


@dataclass(slots=True)
class GenerateReq:
    """A tokenized generation request for one rank."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    deadline: float | None = None  # absolute time.time(); None: no deadline
    trace: TraceCarrier = field(default_factory=dict)
    lora_id: str = ""  # the LoRA adapter to run with; "": the base model
    # generation features; see scheduler/parallel_sampling.py, stop_strings.py
    n: int = 1  # parallel samples sharing the prompt's KV; outputs carry their index
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded text
    no_stop_trim: bool = False  # keep the tokens of a matched stop string in output_ids
    logprob_start_len: int = -1  # >= 0: input logprobs of prompt[logprob_start_len:]
    token_ids_logprob: list[int] = field(default_factory=list)  # logprobs of these ids
    return_hidden_states: bool = False  # last layer's hidden state per output token
    embed: bool = False  # an Embed: prefill only, answered with the pooled vector


@dataclass(slots=True)
class AbortReq:
    """Abort a request; its KV slots are freed at the next step."""

    rid: str
    reason: str = "aborted"


@dataclass(slots=True)
class FlushCacheReq:
    rid: str
    timeout_s: float = 0.0
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class StartProfileReq:
    rid: str
    output_dir: str
    profile_id: str
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] = field(default_factory=list)
    with_stack: bool = True
    record_shapes: bool = True
    profile_by_stage: bool = False
    profile_stages: list[str] = field(default_factory=list)
    merge_profiles: bool = False
    max_bytes: int = 0  # 0: no cap
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)
    profile_prefix: str = ""  # file names start with "{prefix}-{profile_id}" when set
    dp_size: int = 1  # file names carry "-DP-{rank}" when > 1
    profile_root: str = ""  # output_dir must resolve inside it (checked again by the rank)


@dataclass(slots=True)
class StopProfileReq:
    rid: str
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class StateReq:
    """Ask a rank for its live state (health round trip, server info)."""

    rid: str
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class CancelAdminReq:
    """The admin call ``rid`` ended on the server (deadline, cancel, timeout) before this
    rank answered: drop what is still pending for it (a FlushCache waiting for idle)."""

    rid: str


@dataclass(slots=True)
class AbortAllReq:
    """Abort every request in flight on the rank (AbortRequest.abort_all)."""

    rid: str
    reason: str = "aborted by client"
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class PauseReq:
    """PauseGeneration: ``mode`` is abort | retract | in_place."""

    rid: str
    mode: str = "abort"
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class ContinueReq:
    """ContinueGeneration; ``torch_empty_cache`` hands the device's cached memory back."""

    rid: str
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)
    torch_empty_cache: bool = False


@dataclass(slots=True)
class UpdateWeightsFromDiskReq:
    """Load a checkpoint into the live model once the rank is drained (or paused)."""

    rid: str
    model_path: str
    abort_all_requests: bool = False
    weight_version: str = ""  # "": unchanged
    flush_cache: bool = True
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)
    torch_empty_cache: bool = False  # hand the device's cached memory back after the load


@dataclass(slots=True)
class UpdateWeightVersionReq:
    rid: str
    new_version: str
    abort_all_requests: bool = True
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class GetWeightsReq:
    """GetWeightsByName."""

    rid: str
    name: str
    truncate_size: int = 100
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class CheckWeightsReq:
    """CheckWeights("checksum"): a digest over every parameter."""

    rid: str
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class ReleaseMemoryReq:
    """ReleaseMemoryOccupation; ``tags`` among kv_cache, weights (resolved by the server)."""

    rid: str
    tags: list[str] = field(default_factory=list)
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class ResumeMemoryReq:
    """ResumeMemoryOccupation; ``tags`` among kv_cache, weights."""

    rid: str
    tags: list[str] = field(default_factory=list)
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class InitWeightsGroupReq:
    """InitWeightsUpdateGroup: join a trainer's process group as rank_offset + dp rank."""

    rid: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "gloo"
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class UpdateWeightsFromDistributedReq:
    """Receive each named tensor by broadcast from the group's rank 0, load it.

    ``load_format`` "flattened_bucket": one broadcast of every tensor concatenated (one
    dtype), instead of one per tensor."""

    rid: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str = ""
    load_format: str = ""
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class DestroyWeightsGroupReq:
    rid: str
    group_name: str
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class UpdateWeightsFromTensorReq:
    """Load tensors a trainer on this host put in shared memory (/dev/shm/<shm_name>);
    tensor i is names[i], dtypes[i], shapes[i] at byte offsets[i]."""

    rid: str
    shm_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str = ""
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class ShutdownReq:
    rid: str = ""


# ---------------------------------------------------------------- scheduler -> server


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

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (JSON and msgpack friendly)."""
        return {name: getattr(self, name) for name in _model_info_fields()}


def _model_info_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(ModelInfo))


@dataclass(slots=True)
class ReadyMsg:
    """A rank has loaded its model and is serving."""

    dp_rank: int
    pid: int
    model_info: ModelInfo
    state: RankState


@dataclass(slots=True)
class FailedMsg:
    """A rank could not start (e.g. the model did not load)."""

    dp_rank: int
    error: str


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


@dataclass(slots=True)
class BatchOutput:
    """Every request update a rank produced in one step, in one message."""

    dp_rank: int
    outputs: list[ReqOutput]


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


@dataclass(slots=True)
class FlushResult:
    tokens_freed: int = 0


@dataclass(slots=True)
class ProfileStopResult:
    files: list[str] = field(default_factory=list)
    profile_id: str = ""


@dataclass(slots=True)
class CountResult:
    """How many requests an op aborted, retracted or held."""

    count: int = 0


@dataclass(slots=True)
class WeightsResult:
    """The rank's model after a weight op, and the requests it paused or aborted first."""

    model_info: ModelInfo
    num_paused_requests: int = 0


@dataclass(slots=True)
class WeightValues:
    shape: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass(slots=True)
class DigestResult:
    digest: str = ""
    tp_digests: list[str] = field(default_factory=list)  # tp > 1: each TP rank's, in order


@dataclass(slots=True)
class MemoryResult:
    bytes_released: int = 0


@dataclass(slots=True)
class RejectedResult:
    """A rank refused a request before doing anything: ``code`` is the gRPC status the
    server answers with (INVALID_ARGUMENT, ALREADY_EXISTS, NOT_FOUND, ...)."""

    code: str
    reason: str


@dataclass(slots=True)
class StateUpdate:
    """Published by a rank after steps that changed its state (drives GetLoads)."""

    state: RankState


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


@dataclass(slots=True)
class KvEvents:
    """Radix cache events of one step: ("stored", tokens, parent_hash, hash) etc."""

    dp_rank: int
    events: list[list[Any]]


# ---------------------------------------------------------------- LoRA (server <-> scheduler)


@dataclass(slots=True)
class LoadLoraReq:
    """Load a PEFT LoRA adapter into a free (or LRU-evicted) slot under the caller's id."""

    rid: str
    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class UnloadLoraReq:
    """Unload an adapter (by id, else by name) once no request uses it."""

    rid: str
    lora_id: str = ""
    lora_name: str = ""
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class ListLoraReq:
    rid: str
    deadline: float | None = None
    trace: TraceCarrier = field(default_factory=dict)


@dataclass(slots=True)
class LoraAdapterInfo:
    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass(slots=True)
class LoraResult:
    """The adapters a rank holds after a LoRA op, and those it evicted to make room."""

    adapters: list[LoraAdapterInfo] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    error_code: str = ""  # on failure: the gRPC status code name that fits (INVALID_ARGUMENT...)
