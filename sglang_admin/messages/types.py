"""The typed messages the server sends its ranks (slotted dataclasses, the constants their
fields use, and the registry of every message type), encoded by messages/codec.py; what
the ranks answer is in messages/replies.py."""

from __future__ import annotations

from dataclasses import dataclass, field

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


# ---------------------------------------------------------------- the registry

REGISTRY: list[type] = []  # every message type, in the order of their codec codes


def message(cls: type) -> type:
    """Register a message type with the codec (messages/codec.py): only registered types are
    encoded and decoded. Its code is its place in :data:`REGISTRY` (both ends of a socket
    run the same build)."""
    REGISTRY.append(cls)
    return cls


@dataclass(slots=True)
class RankCall:
    """What every call to a rank carries: the call's id, its deadline and its trace context
    (keyword-only, so a subclass lists its own fields after ``rid``)."""

    rid: str
    deadline: float | None = field(default=None, kw_only=True)  # absolute time.time(); None: none
    trace: TraceCarrier = field(default_factory=dict, kw_only=True)


# ---------------------------------------------------------------- server -> scheduler


@message
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
    # the grammar applies from the end of the think span on (--reasoning-parser's end token),
    # as SGLang's require_reasoning: the model reasons freely first
    require_reasoning: bool = False

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


@message
@dataclass(slots=True)
class GenerateReq(RankCall):
    """A tokenized generation request for one rank."""

    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    lora_id: str = ""  # the LoRA adapter to run with; "": the base model
    # generation features; see scheduler/parallel_sampling.py, stop_strings.py
    n: int = 1  # parallel samples sharing the prompt's KV; outputs carry their index
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded text
    no_stop_trim: bool = False  # keep the tokens of a matched stop string in output_ids
    logprob_start_len: int = -1  # >= 0: input logprobs of prompt[logprob_start_len:]
    token_ids_logprob: list[int] = field(default_factory=list)  # logprobs of these ids
    return_hidden_states: bool = False  # last layer's hidden state per output token
    embed: bool = False  # an Embed: prefill only, answered with the pooled vector


@message
@dataclass(slots=True)
class AbortReq:
    """Abort a request; its KV slots are freed at the next step."""

    rid: str
    reason: str = "aborted"


@message
@dataclass(slots=True)
class FlushCacheReq(RankCall):
    timeout_s: float = 0.0


@message
@dataclass(slots=True)
class StartProfileReq(RankCall):
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
    profile_prefix: str = ""  # file names start with "{prefix}-{profile_id}" when set
    dp_size: int = 1  # file names carry "-DP-{rank}" when > 1
    profile_root: str = ""  # output_dir must resolve inside it (checked again by the rank)


@message
@dataclass(slots=True)
class StopProfileReq(RankCall):
    """Stop the rank's running profile and export its trace."""


@message
@dataclass(slots=True)
class StateReq(RankCall):
    """Ask a rank for its live state (health round trip, server info)."""


@message
@dataclass(slots=True)
class CancelAdminReq:
    """The admin call ``rid`` ended on the server (deadline, cancel, timeout) before this
    rank answered: drop what is still pending for it (a FlushCache waiting for idle)."""

    rid: str


@message
@dataclass(slots=True)
class AbortAllReq(RankCall):
    """Abort every request in flight on the rank (AbortRequest.abort_all)."""

    reason: str = "aborted by client"


@message
@dataclass(slots=True)
class PauseReq(RankCall):
    """PauseGeneration: ``mode`` is abort | retract | in_place."""

    mode: str = "abort"


@message
@dataclass(slots=True)
class ContinueReq(RankCall):
    """ContinueGeneration; ``torch_empty_cache`` hands the device's cached memory back."""

    torch_empty_cache: bool = False


@message
@dataclass(slots=True)
class UpdateWeightsFromDiskReq(RankCall):
    """Load a checkpoint into the live model once the rank is drained (or paused)."""

    model_path: str
    abort_all_requests: bool = False
    weight_version: str = ""  # "": unchanged
    flush_cache: bool = True
    torch_empty_cache: bool = False  # hand the device's cached memory back after the load


@message
@dataclass(slots=True)
class UpdateWeightVersionReq(RankCall):
    new_version: str
    abort_all_requests: bool = True


@message
@dataclass(slots=True)
class GetWeightsReq(RankCall):
    """GetWeightsByName."""

    name: str
    truncate_size: int = 100


@message
@dataclass(slots=True)
class CheckWeightsReq(RankCall):
    """CheckWeights("checksum"): a digest over every parameter."""


@message
@dataclass(slots=True)
class ReleaseMemoryReq(RankCall):
    """ReleaseMemoryOccupation; ``tags`` among kv_cache, weights (resolved by the server)."""

    tags: list[str] = field(default_factory=list)


@message
@dataclass(slots=True)
class ResumeMemoryReq(RankCall):
    """ResumeMemoryOccupation; ``tags`` among kv_cache, weights."""

    tags: list[str] = field(default_factory=list)


@message
@dataclass(slots=True)
class InitWeightsGroupReq(RankCall):
    """InitWeightsUpdateGroup: join a trainer's process group as rank_offset + dp rank."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "gloo"


@message
@dataclass(slots=True)
class UpdateWeightsFromDistributedReq(RankCall):
    """Receive each named tensor by broadcast from the group's rank 0, load it.

    ``load_format`` "flattened_bucket": one broadcast of every tensor concatenated (one
    dtype), instead of one per tensor."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str = ""
    load_format: str = ""


@message
@dataclass(slots=True)
class DestroyWeightsGroupReq(RankCall):
    group_name: str


@message
@dataclass(slots=True)
class UpdateWeightsFromTensorReq(RankCall):
    """Load tensors a trainer on this host put in shared memory (/dev/shm/<shm_name>);
    tensor i is names[i], dtypes[i], shapes[i] at byte offsets[i]."""

    shm_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str = ""


@message
@dataclass(slots=True)
class ShutdownReq:
    rid: str = ""


# ---------------------------------------------------------------- LoRA (server -> scheduler)


@message
@dataclass(slots=True)
class LoadLoraReq(RankCall):
    """Load a PEFT LoRA adapter into a free (or LRU-evicted) slot under the caller's id."""

    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False


@message
@dataclass(slots=True)
class UnloadLoraReq(RankCall):
    """Unload an adapter (by id, else by name) once no request uses it."""

    lora_id: str = ""
    lora_name: str = ""


@message
@dataclass(slots=True)
class ListLoraReq(RankCall):
    """List the LoRA adapters the rank holds."""
