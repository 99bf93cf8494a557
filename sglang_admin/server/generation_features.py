"""The generation features of Generate at the edge: n, stop strings, stream_interval, prompt
logprobs, token-id logprobs and hidden states: their checks (proto -> message) and their
place in the answer (message -> proto)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_admin.messages import ReqOutput
from sglang_admin.pb import common_pb2 as pb

MAX_N = 64  # samples per request (each holds a table row and its own decode KV)
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256  # the rank decodes this many tokens and a few more per step
MAX_TOKEN_IDS_LOGPROB = 128
MAX_STREAM_INTERVAL = 1 << 20


class FeatureError(ValueError):
    """A field of these features is out of range; the message names it."""


@dataclass(frozen=True)
class GenerationFeatures:
    """The checked values (defaults: n 1, no stop strings, chunk every token, ...)."""

    n: int = 1
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    stream_interval: int = 1
    logprob_start_len: int = -1
    token_ids_logprob: list[int] = field(default_factory=list)
    return_hidden_states: bool = False


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


def generation_features_from_proto(request: pb.GenerateRequest,
                                   vocab_size: int) -> GenerationFeatures:
    """Check and normalize the fields; raises :class:`FeatureError` naming the bad one."""
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
    return GenerationFeatures(
        n=n,
        stop=stops,
        no_stop_trim=sp.no_stop_trim,
        stream_interval=stream_interval_of(request),
        # As SGLang: -1 (what the SMG gateway sends by default) is none, >= 0 the first
        # prompt position whose logprob is returned (only with return_logprob).
        logprob_start_len=start if request.return_logprob else -1,
        token_ids_logprob=ids if request.return_logprob else [],
        return_hidden_states=request.return_hidden_states,
    )


def _tops(rows: list[list[tuple[int, float]]]) -> list[pb.TopLogProbs]:
    return [pb.TopLogProbs(values=[v for _, v in row], token_ids=[t for t, _ in row])
            for row in rows]


def input_logprobs_proto(prompt_ids: list[int], start: int, values: list[float | None],
                         tops: list[list[tuple[int, float]]]) -> pb.InputLogProbs:
    """InputLogProbs of prompt[start:] (a None value: no logprob, position 0)."""
    return pb.InputLogProbs(
        token_logprobs=[pb.InputTokenLogProb(value=v) if v is not None
                        else pb.InputTokenLogProb() for v in values],
        token_ids=prompt_ids[start : start + len(values)],
        top_logprobs=_tops(tops) if any(tops) else [],
    )


def hidden_states_proto(rows: list[list[float]], first_position: int) -> list[pb.HiddenStates]:
    """One HiddenStates per output token (the last layer's, ``layer`` -1)."""
    return [pb.HiddenStates(values=row, layer=-1, position=first_position + i)
            for i, row in enumerate(rows)]


def token_ids_logprobs_proto(rows: list[list[tuple[int, float]]]) -> list[pb.TopLogProbs]:
    return _tops(rows)


def stop_trimmed(out: ReqOutput, count: int) -> int:
    """How many of the sample's ``count`` output tokens to keep in a non-streamed answer."""
    return count - min(out.stop_trim, count) if out.matched_stop_str is not None else count
