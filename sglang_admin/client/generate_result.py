"""A finished Generate call's answer gathered: the tokens of each sample and its final
message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sglang_admin.client.errors import ClientError
from sglang_admin.pb import common_pb2 as pb


@dataclass(frozen=True)
class GenerateResult:
    """The tokens of one Generate call and its final message."""

    tokens: list[int]
    complete: pb.GenerateComplete


def collect(responses: Sequence[pb.GenerateResponse], stream: bool) -> GenerateResult:
    """Tokens of a finished call: the chunks' tokens when streaming, else the final ids."""
    tokens: list[int] = []
    complete: pb.GenerateComplete | None = None
    for resp in responses:
        if resp.HasField("chunk"):
            tokens.extend(resp.chunk.token_ids)
        elif resp.HasField("complete"):
            complete = resp.complete
    if complete is None:
        raise ClientError("Generate ended without a GenerateComplete")
    return GenerateResult(tokens if stream else list(complete.output_ids), complete)


def collect_samples(responses: Sequence[pb.GenerateResponse], stream: bool,
                     n: int) -> list[GenerateResult]:
    """One result per sample of an n > 1 call, by ``index``."""
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    completes: dict[int, pb.GenerateComplete] = {}
    for resp in responses:
        if resp.HasField("chunk"):
            tokens.setdefault(resp.chunk.index, []).extend(resp.chunk.token_ids)
        elif resp.HasField("complete"):
            completes[resp.complete.index] = resp.complete
    if sorted(completes) != list(range(n)):
        raise ClientError(f"Generate ended with completes for samples {sorted(completes)} "
                          f"of {n}")
    return [GenerateResult(tokens[i] if stream else list(completes[i].output_ids),
                           completes[i]) for i in range(n)]
