"""A GenerateRequest converted, in one pass, into the rank's GenerateReq: every field checked
(sampling parameters, constraint, generation features, limits of the served model).

Every refusal raises :class:`~sglang_admin.server.errors.ServiceError` with the gRPC status
and a message that names the offending field; the interceptor turns it into the call's
status."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import MAX_REQUEST_ID_CHARS, invalid

MAX_TOP_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0  # as OpenAI: a bias of +-100 already forces or bans a token
MIN_REPETITION_PENALTY = 0.01  # below it a positive logit is multiplied past any useful range
MAX_REPETITION_PENALTY = 2.0
_F32_SLACK = 1 - 1e-6
MAX_CONSTRAINT_CHARS = 1 << 20  # regex / json_schema / ebnf_grammar / structural_tag text
MAX_N = 64  # samples per request (each holds a table row and its own decode KV)
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256  # the rank decodes this many tokens and a few more per step
MAX_TOKEN_IDS_LOGPROB = 128
MAX_STREAM_INTERVAL = 1 << 20


class FeatureError(ValueError):
    """A field of these features is out of range; the message names it."""


def stream_interval_of(request: pb.GenerateRequest) -> int:
    """sampling_params.stream_interval checked (unset: 1, a chunk per token)."""
    sp = request.sampling_params
    if not sp.HasField("stream_interval"):
        return 1
    value = sp.stream_interval
    if not 1 <= value <= MAX_STREAM_INTERVAL:
        raise FeatureError(
            f"sampling_params.stream_interval must be in [1, {MAX_STREAM_INTERVAL}] "
            f"(unset: 1), got {value}")
    return value


@dataclass(frozen=True)
class Limits:
    """What a request is checked against (from the model the ranks loaded)."""

    vocab_size: int
    context_length: int
    token_capacity: int
    dp_size: int
    lora_enabled: bool = False  # --enable-lora: GenerateRequest.lora_id is accepted

    @property
    def max_req_len(self) -> int:
        """The most tokens one request may hold, prompt and output: the context, or the KV
        pool when it is smaller (a rank ends a sequence with "length" at either)."""
        return min(self.context_length, self.token_capacity)

    @property
    def max_req_input_len(self) -> int:
        """The longest prompt this worker takes (GetModelInfo.max_req_input_len): one token
        below ``max_req_len``, so that every prompt it takes may still generate."""
        return self.max_req_len - 1

    def room(self, prompt_len: int) -> int:
        """The most output tokens a prompt of ``prompt_len`` tokens may get: SGLang's
        scheduler caps max_new_tokens the same way, at ``max_req_len - prompt - 1`` with its
        own ``max_req_len`` of ``min(context, pool) - 1``; this worker's sequences hold the
        whole context, so its bound is ``min(context, pool) - prompt``."""
        return max(0, self.max_req_len - prompt_len)


def _finite(name: str, value: float) -> float:
    if math.isnan(value) or math.isinf(value):
        raise invalid(f"sampling_params.{name} must be a finite number, got {value}")
    return value


def sampling_from_proto(sp: pb.SamplingParams, limits: Limits, prompt_len: int) -> SamplingParams:
    """Map proto zeros to SGLang defaults and check every range."""
    grammar_kind, grammar = _constraint_from_proto(sp)
    temperature = _finite("temperature", sp.temperature)
    if temperature < 0:
        raise invalid(f"sampling_params.temperature must be >= 0, got {temperature}")
    top_p = _finite("top_p", sp.top_p) or 1.0
    if not 0.0 < top_p <= 1.0:
        raise invalid(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    top_k = sp.top_k or -1
    if top_k < -1:
        raise invalid(f"sampling_params.top_k must be -1 (no limit) or >= 1, got {top_k}")
    min_p = _finite("min_p", sp.min_p)
    if not 0.0 <= min_p <= 1.0:
        raise invalid(f"sampling_params.min_p must be in [0, 1], got {min_p}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = _finite(name, getattr(sp, name))
        if not -2.0 <= value <= 2.0:
            raise invalid(f"sampling_params.{name} must be in [-2, 2], got {value}")
    repetition_penalty = _finite("repetition_penalty", sp.repetition_penalty) or 1.0
    # proto floats are float32: 0.01 arrives as 0.0099999998, still the bound
    if not MIN_REPETITION_PENALTY * _F32_SLACK <= repetition_penalty <= MAX_REPETITION_PENALTY:
        raise invalid(
            f"sampling_params.repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
            f"{MAX_REPETITION_PENALTY:g}] (0 or unset: 1), got {repetition_penalty}"
        )
    # As SGLang's scheduler: unset is "up to the context", a value above the room is capped
    # to it (the answer then ends with "length" there); 0 is prefill only (scoring, echo).
    room = limits.room(prompt_len)
    asked = sp.max_new_tokens if sp.HasField("max_new_tokens") else None
    if asked is not None and sp.min_new_tokens > asked:  # SamplingParams.verify's check
        raise invalid(
            f"sampling_params.min_new_tokens = {sp.min_new_tokens} exceeds max_new_tokens = "
            f"{asked}"
        )
    max_new = room if asked is None else min(asked, room)
    min_new = min(sp.min_new_tokens, max_new)  # capped with max_new_tokens
    for tid in sp.stop_token_ids:
        if tid >= limits.vocab_size:
            raise invalid(
                f"sampling_params.stop_token_ids has {tid}, outside the vocabulary of "
                f"{limits.vocab_size}"
            )
    logit_bias: dict[int, float] = {}
    for key, bias in sp.logit_bias.items():
        # Decimal token ids only: int() would also take " 5", "+5", "5_0" and non-ASCII
        # digits, which no tokenizer emits as a key.
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid(
                f"sampling_params.logit_bias key {key[:32]!r} is not a token id "
                "(keys are decimal token ids)"
            )
        tid = int(key)
        if tid >= limits.vocab_size:
            raise invalid(
                f"sampling_params.logit_bias key {tid} is outside the vocabulary of "
                f"{limits.vocab_size}"
            )
        if not math.isfinite(bias):
            raise invalid(
                f"sampling_params.logit_bias[{key}] must be a finite number, got {bias}"
            )
        if abs(bias) > MAX_ABS_LOGIT_BIAS:
            raise invalid(
                f"sampling_params.logit_bias[{key}] must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                f"{MAX_ABS_LOGIT_BIAS:g}], got {bias}"
            )
        logit_bias[tid] = bias
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=repetition_penalty,
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logit_bias=logit_bias,
        grammar_kind=grammar_kind,
        grammar=grammar,
    )


def with_reasoning(params: SamplingParams, require_reasoning: bool) -> SamplingParams:
    """``params`` marked for a request whose constraint starts after its think span."""
    params.require_reasoning = require_reasoning
    return params


def _constraint_from_proto(sp: pb.SamplingParams) -> tuple[str, str]:
    """The constrained-decoding oneof as (kind, text); ("", "") when unconstrained. The
    rank compiles it (a text that does not compile fails there with the compiler's
    message); here only emptiness and size are checked."""
    kind = sp.WhichOneof("constraint")
    if not kind:
        return "", ""
    text = getattr(sp, kind)
    if not text.strip():
        raise invalid(f"sampling_params.{kind} must not be empty")
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise invalid(
            f"sampling_params.{kind} is {len(text)} characters long; at most "
            f"{MAX_CONSTRAINT_CHARS} are accepted"
        )
    return kind, text


def generate_from_proto(request: pb.GenerateRequest, rid: str, limits: Limits) -> GenerateReq:
    """Validate a GenerateRequest and build the scheduler's message."""
    for field_name in ("mm_inputs", "disaggregated_params"):
        if request.HasField(field_name):
            raise invalid(f"{field_name} is not supported by this worker")
    if request.input_embeds:
        raise invalid("input_embeds is not supported by this worker; send tokenized.input_ids")
    if request.lora_id and not limits.lora_enabled:
        raise invalid("lora_id is not supported: this worker serves no LoRA adapters "
                      "(start it with --enable-lora)")
    if len(request.lora_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"lora_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    if request.custom_logit_processor:
        raise invalid("custom_logit_processor is not supported by this worker")
    if request.sampling_params.HasField("custom_params"):
        raise invalid("sampling_params.custom_params is not supported by this worker: it is "
                      "read only by a custom_logit_processor, which this worker does not run")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    ids = list(request.tokenized.input_ids)
    if not ids:
        if request.tokenized.original_text:
            raise invalid(
                "tokenized.input_ids must not be empty: this worker does not tokenize "
                "tokenized.original_text"
            )
        raise invalid("tokenized.input_ids must not be empty")
    bad = next((i for i, t in enumerate(ids) if t >= limits.vocab_size), None)
    if bad is not None:
        raise invalid(
            f"tokenized.input_ids[{bad}] = {ids[bad]} is outside the vocabulary of "
            f"{limits.vocab_size} tokens"
        )
    if len(ids) > limits.max_req_input_len:
        bound = ("the context length" if limits.context_length <= limits.token_capacity
                 else "the KV pool of")
        size = min(limits.context_length, limits.token_capacity)
        raise invalid(
            f"prompt of {len(ids)} tokens exceeds {bound} {size} tokens: this worker takes "
            f"at most {limits.max_req_input_len} input tokens (GetModelInfo.max_req_input_len)"
        )
    if request.HasField("data_parallel_rank") and not (
        0 <= request.data_parallel_rank < limits.dp_size
    ):
        raise invalid(
            f"data_parallel_rank = {request.data_parallel_rank} is out of range "
            f"[0, {limits.dp_size - 1}]"
        )
    if not 0 <= request.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise invalid(
            f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs_num}"
        )
    try:
        features = _features(request, limits.vocab_size)
    except FeatureError as exc:
        raise invalid(str(exc)) from None
    return GenerateReq(
        rid=rid,
        input_ids=ids,
        sampling=with_reasoning(sampling_from_proto(request.sampling_params, limits, len(ids)),
                                request.require_reasoning),
        return_logprob=request.return_logprob,
        top_logprobs_num=request.top_logprobs_num if request.return_logprob else 0,
        stream=request.stream,
        lora_id=request.lora_id,
        **features,
    )


def _features(request: pb.GenerateRequest, vocab_size: int) -> dict[str, Any]:
    """The generation features (n, stop strings, stream_interval, prompt logprobs, token-id
    logprobs, hidden states) checked, as GenerateReq's fields; raises :class:`FeatureError`
    naming the bad one."""
    sp = request.sampling_params
    n = sp.n or 1
    if n > MAX_N:
        raise FeatureError(f"sampling_params.n must be in [1, {MAX_N}] (0: 1), got {n}")
    stops = list(sp.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise FeatureError(
            f"sampling_params.stop has {len(stops)} strings, at most {MAX_STOP_STRINGS}")
    for i, stop in enumerate(stops):
        if not stop:
            raise FeatureError(f"sampling_params.stop[{i}] is empty")
        if len(stop) > MAX_STOP_CHARS:
            raise FeatureError(
                f"sampling_params.stop[{i}] has {len(stop)} characters, at most "
                f"{MAX_STOP_CHARS}")
    ids = list(request.token_ids_logprob)
    if len(ids) > MAX_TOKEN_IDS_LOGPROB:
        raise FeatureError(
            f"token_ids_logprob has {len(ids)} ids, at most {MAX_TOKEN_IDS_LOGPROB}")
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise FeatureError(
            f"token_ids_logprob has {bad}, outside the vocabulary of {vocab_size} tokens")
    start = request.logprob_start_len
    if start < -1:
        raise FeatureError(f"logprob_start_len must be >= -1 (-1: none), got {start}")
    prompt_len = len(request.tokenized.input_ids)
    if request.return_logprob and start >= prompt_len:
        raise FeatureError(
            f"logprob_start_len = {start} must be below the prompt length {prompt_len}")
    stream_interval_of(request)  # checked with the rest; the call's streams read it
    return {
        "n": n,
        "stop": stops,
        "no_stop_trim": sp.no_stop_trim,
        # As SGLang: -1 (what the SMG gateway sends by default) is none, >= 0 the first
        # prompt position whose logprob is returned (only with return_logprob).
        "logprob_start_len": start if request.return_logprob else -1,
        "token_ids_logprob": ids if request.return_logprob else [],
        "return_hidden_states": request.return_hidden_states,
    }
