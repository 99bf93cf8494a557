"""The Generate answer's proto pieces: prompt logprobs, token-id logprobs, hidden states, and
how many of a sample's tokens a matched stop string leaves."""

from __future__ import annotations

from sglang_admin.messages import ReqOutput
from sglang_admin.pb import common_pb2 as pb


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
