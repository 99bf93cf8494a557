"""Validation at the edge: every bad GenerateRequest is refused with the field's name.

These run without a server: ``generate_from_proto`` against fixed :class:`Limits`
(the embedded default model's: vocab 261, context 8192).
"""

from __future__ import annotations

import math

import grpc
import pytest

from sglang_admin.config import ServerArgs
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.cache_profile_service import MAX_FLUSH_TIMEOUT_S, flush_timeout_from_proto
from sglang_admin.server.errors import MAX_REQUEST_ID_CHARS, ServiceError
from sglang_admin.server.generate_codec import (
    MAX_CONSTRAINT_CHARS,
    Limits,
    generate_from_proto,
)
from sglang_admin.server.launch import max_message_bytes

LIMITS = Limits(vocab_size=261, context_length=8192, token_capacity=65536, dp_size=2)
NAN = float("nan")
INF = float("inf")


def req(ids: list[int] | None = None, **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(sampling_params=pb.SamplingParams(**sampling))
    if ids is not None:
        r.tokenized.input_ids.extend(ids)
    return r


def bias(mapping: dict[str, float], **kw) -> pb.GenerateRequest:
    r = req([1, 2, 3], **kw)
    for k, v in mapping.items():
        r.sampling_params.logit_bias[k] = v
    return r


def with_(r: pb.GenerateRequest, **fields) -> pb.GenerateRequest:
    for k, v in fields.items():
        setattr(r, k, v)
    return r


def ids_logprob(ids: list[int]) -> pb.GenerateRequest:
    r = with_(req([1]), return_logprob=True)
    r.token_ids_logprob.extend(ids)
    return r


# (id, request, substring the message must contain). Every one is INVALID_ARGUMENT.
BAD = [
    ("missing-tokenized", pb.GenerateRequest(), "tokenized.input_ids"),
    ("empty-input-ids", req([]), "tokenized.input_ids must not be empty"),
    ("text-only", pb.GenerateRequest(tokenized=pb.TokenizedInput(original_text="hi")),
     "does not tokenize"),
    ("token-eq-vocab", req([1, 261]), "tokenized.input_ids[1] = 261"),
    ("token-max-uint32", req([2**32 - 1]), "tokenized.input_ids[0]"),
    ("prompt-eq-context", req([1] * 8192), "context length 8192"),
    ("min-new-gt-max", req([1], max_new_tokens=4, min_new_tokens=5),
     "sampling_params.min_new_tokens"),
    ("temperature-neg", req([1], temperature=-0.5), "sampling_params.temperature"),
    ("temperature-nan", req([1], temperature=NAN), "sampling_params.temperature"),
    ("temperature-inf", req([1], temperature=INF), "sampling_params.temperature"),
    ("top-p-neg", req([1], top_p=-0.1), "sampling_params.top_p"),
    ("top-p-gt-1", req([1], top_p=1.5), "sampling_params.top_p"),
    ("top-p-nan", req([1], top_p=NAN), "sampling_params.top_p"),
    ("top-k-lt-minus-1", req([1], top_k=-2), "sampling_params.top_k"),
    ("min-p-neg", req([1], min_p=-0.1), "sampling_params.min_p"),
    ("min-p-gt-1", req([1], min_p=1.5), "sampling_params.min_p"),
    ("min-p-inf", req([1], min_p=-INF), "sampling_params.min_p"),
    ("frequency-penalty-high", req([1], frequency_penalty=2.5),
     "sampling_params.frequency_penalty"),
    ("frequency-penalty-nan", req([1], frequency_penalty=NAN),
     "sampling_params.frequency_penalty"),
    ("presence-penalty-low", req([1], presence_penalty=-3.0), "sampling_params.presence_penalty"),
    ("presence-penalty-inf", req([1], presence_penalty=INF), "sampling_params.presence_penalty"),
    ("repetition-penalty-neg", req([1], repetition_penalty=-1.0),
     "sampling_params.repetition_penalty"),
    ("repetition-penalty-high", req([1], repetition_penalty=2.5),
     "sampling_params.repetition_penalty"),
    ("repetition-penalty-nan", req([1], repetition_penalty=NAN),
     "sampling_params.repetition_penalty"),
    ("logit-bias-word", bias({"abc": 1.0}), "sampling_params.logit_bias key 'abc'"),
    ("logit-bias-negative", bias({"-1": 1.0}), "sampling_params.logit_bias key '-1'"),
    ("logit-bias-float-key", bias({"5.0": 1.0}), "sampling_params.logit_bias key '5.0'"),
    ("logit-bias-spaced", bias({" 5": 1.0}), "sampling_params.logit_bias key"),
    ("logit-bias-unicode-digit", bias({"\u0665": 1.0}), "sampling_params.logit_bias key"),
    ("logit-bias-out-of-vocab", bias({"261": 1.0}), "sampling_params.logit_bias key 261"),
    ("logit-bias-nan", bias({"5": NAN}), "sampling_params.logit_bias[5]"),
    ("logit-bias-inf", bias({"5": -INF}), "sampling_params.logit_bias[5]"),
    ("logit-bias-huge", bias({"5": 3e38}), "sampling_params.logit_bias[5] must be in [-100, 100]"),
    ("logit-bias-below-bound", bias({"5": -100.5}), "logit_bias[5] must be in [-100, 100]"),
    ("repetition-penalty-tiny", req([1], repetition_penalty=1e-40),
     "sampling_params.repetition_penalty must be in [0.01, 2]"),
    ("stop-token-out-of-vocab", req([1], stop_token_ids=[300]), "sampling_params.stop_token_ids"),
    ("dp-rank-high", with_(req([1]), data_parallel_rank=2), "data_parallel_rank = 2"),
    ("dp-rank-negative", with_(req([1]), data_parallel_rank=-1), "data_parallel_rank = -1"),
    ("top-logprobs-high", with_(req([1]), return_logprob=True, top_logprobs_num=21),
     "top_logprobs_num"),
    ("top-logprobs-negative", with_(req([1]), top_logprobs_num=-1), "top_logprobs_num"),
    ("request-id-long", with_(req([1]), request_id="r" * (MAX_REQUEST_ID_CHARS + 1)),
     "request_id"),
    ("n-huge", req([1], n=65), "sampling_params.n must be in [1, 64]"),
    ("n-max-uint32", req([1], n=2**32 - 1), "sampling_params.n"),
    ("stream-interval-zero", req([1], stream_interval=0), "sampling_params.stream_interval"),
    ("stream-interval-negative", req([1], stream_interval=-3),
     "sampling_params.stream_interval must be in [1"),
    ("stop-empty", req([1], stop=["ok", ""]), "sampling_params.stop[1] is empty"),
    ("stop-too-many", req([1], stop=["x"] * 33), "sampling_params.stop has 33"),
    ("stop-too-long", req([1], stop=["x" * 257]), "sampling_params.stop[0] has 257"),
    ("token-ids-logprob-out-of-vocab", ids_logprob([5, 261]), "token_ids_logprob has 261"),
    ("logprob-start-past-prompt", with_(req([1, 2]), return_logprob=True, logprob_start_len=2),
     "logprob_start_len = 2"),
    ("logprob-start-negative", with_(req([1, 2]), logprob_start_len=-2), "logprob_start_len"),
    ("regex-empty", req([1], regex=" "), "sampling_params.regex"),
    ("json-schema-too-long", req([1], json_schema="x" * (MAX_CONSTRAINT_CHARS + 1)),
     "sampling_params.json_schema"),
    ("lora", with_(req([1]), lora_id="x"), "lora_id"),
]


@pytest.mark.parametrize("request_, needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_is_refused_naming_the_field(request_: pb.GenerateRequest, needle: str) -> None:
    with pytest.raises(ServiceError) as err:
        generate_from_proto(request_, request_.request_id or "rid", LIMITS)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.message, err.value.message


def test_prompt_over_kv_pool_is_refused() -> None:
    small = Limits(vocab_size=261, context_length=8192, token_capacity=100, dp_size=1)
    with pytest.raises(ServiceError, match="KV pool"):
        generate_from_proto(req([1] * 100), "rid", small)


def test_proto_zeros_map_to_sglang_defaults() -> None:
    out = generate_from_proto(req([1, 2, 3]), "rid", LIMITS)
    sp = out.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.0, 1.0, -1, 0.0)
    assert sp.repetition_penalty == 1.0
    # unset max_new_tokens: up to the context, as SGLang's scheduler
    assert sp.max_new_tokens == 8192 - 3
    assert out.input_ids == [1, 2, 3] and out.rid == "rid"


def test_edges_that_are_valid() -> None:
    # The longest prompt, with the one token of room it leaves.
    out = generate_from_proto(req([260] * 8191, max_new_tokens=1), "rid", LIMITS)
    assert out.sampling.max_new_tokens == 1
    # Default max_new_tokens shrinks to the room left.
    out = generate_from_proto(req([1] * 8150), "rid", LIMITS)
    assert out.sampling.max_new_tokens == 8192 - 8150
    # Above the room: capped to it (SGLang's scheduler caps, it does not refuse).
    out = generate_from_proto(req([1] * 100, max_new_tokens=8093), "rid", LIMITS)
    assert out.sampling.max_new_tokens == 8092
    out = generate_from_proto(req([1], max_new_tokens=2**32 - 1, min_new_tokens=9000),
                              "rid", LIMITS)
    assert (out.sampling.max_new_tokens, out.sampling.min_new_tokens) == (8191, 8191)
    # The KV pool counts when it is smaller than the context.
    pool = Limits(vocab_size=261, context_length=8192, token_capacity=100, dp_size=1)
    assert pool.max_req_input_len == 99
    assert generate_from_proto(req([1] * 99), "rid", pool).sampling.max_new_tokens == 1
    assert generate_from_proto(req([1] * 40), "rid", pool).sampling.max_new_tokens == 60
    r = bias({"0": -100.0, "260": 5.5}, temperature=0.7, top_p=1.0, top_k=-1, min_p=1.0,
             frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=2.0,
             stop_token_ids=[260])
    r.data_parallel_rank = 1
    out = generate_from_proto(r, "rid", LIMITS)
    assert out.sampling.logit_bias == {0: -100.0, 260: 5.5}
    assert math.isclose(out.sampling.temperature, 0.7, rel_tol=1e-6)
    generate_from_proto(with_(req([1]), request_id="r" * MAX_REQUEST_ID_CHARS), "x", LIMITS)


def test_receive_limit_fits_a_full_context_prompt() -> None:
    for context in (8192, 131072, 1 << 20):
        args = ServerArgs(context_length=context)
        full = pb.GenerateRequest(
            request_id="r" * MAX_REQUEST_ID_CHARS,
            tokenized=pb.TokenizedInput(input_ids=[2**32 - 1] * (context - 1)),
            sampling_params=pb.SamplingParams(max_new_tokens=1),
        )
        assert full.ByteSize() < max_message_bytes(args)
    # Without an override (the model's context is not known before the ranks load) the
    # limit still fits 131072 tokens of the largest ids.
    assert max_message_bytes(ServerArgs()) > 5 * 131072


def test_sampling_bounds_are_inclusive() -> None:
    out = generate_from_proto(
        bias({"5": 100.0, "6": -100.0}, repetition_penalty=0.01), "rid", LIMITS
    )
    assert out.sampling.logit_bias == {5: 100.0, 6: -100.0}
    assert out.sampling.repetition_penalty == pytest.approx(0.01)


@pytest.mark.parametrize("value", [3e38, MAX_FLUSH_TIMEOUT_S + 1, INF, NAN])
def test_flush_timeout_over_the_cap_is_refused(value: float) -> None:
    with pytest.raises(ServiceError) as err:
        flush_timeout_from_proto(value)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout_s must be" in err.value.message


def test_flush_timeout_within_the_cap_is_kept() -> None:
    assert flush_timeout_from_proto(MAX_FLUSH_TIMEOUT_S) == MAX_FLUSH_TIMEOUT_S
    assert flush_timeout_from_proto(0.0) == 0.0


def test_generation_features_reach_the_rank_message() -> None:
    r = with_(req([1, 2, 3, 4], n=3, stop=["ab"], no_stop_trim=True, max_new_tokens=0),
              return_logprob=True, logprob_start_len=2, return_hidden_states=True)
    r.token_ids_logprob.extend([7, 9])
    out = generate_from_proto(r, "rid", LIMITS)
    assert out.n == 3 and out.stop == ["ab"] and out.no_stop_trim
    assert out.sampling.max_new_tokens == 0
    assert out.logprob_start_len == 2 and out.token_ids_logprob == [7, 9]
    assert out.return_hidden_states
    # without return_logprob no prompt or token-id logprobs; -1 (the gateway's default) none
    plain = generate_from_proto(with_(req([1, 2]), logprob_start_len=1), "rid", LIMITS)
    assert plain.logprob_start_len == -1 and plain.n == 1
    none = generate_from_proto(with_(req([1, 2]), return_logprob=True, logprob_start_len=-1),
                               "rid", LIMITS)
    assert none.logprob_start_len == -1
    zero = generate_from_proto(with_(req([1, 2]), return_logprob=True), "rid", LIMITS)
    assert zero.logprob_start_len == 0


@pytest.mark.parametrize("kind", ["regex", "json_schema", "ebnf_grammar", "structural_tag"])
def test_constraint_travels_to_the_rank_as_kind_and_text(kind: str) -> None:
    msg = generate_from_proto(req([1, 2], **{kind: "text of " + kind}), "r", LIMITS)
    assert (msg.sampling.grammar_kind, msg.sampling.grammar) == (kind, "text of " + kind)


def test_unconstrained_request_has_no_grammar() -> None:
    msg = generate_from_proto(req([1, 2]), "r", LIMITS)
    assert (msg.sampling.grammar_kind, msg.sampling.grammar) == ("", "")
