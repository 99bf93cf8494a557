"""An Embed request at the rank: its pooling progress, and how much cached prefix it may
reuse (a pooling that reads every prompt token must compute the ones it has not pooled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False, slots=True)
class EmbedProgress:
    """What model/pooling.py has pooled of one request's prompt so far (no torch here: the
    model owns ``partial``), and the vector once the prompt is in."""

    pooled_upto: int = 0  # prompt positions [0, pooled_upto) are in ``partial``
    partial: Any = None  # the model's running value (CLS, MEAN)
    vector: list[float] | None = None


def reusable_prefix(progress: EmbedProgress | None, matched: int, every_token: bool) -> int:
    """Tokens of a matched cached prefix an admitted request may reuse: all of them, but for
    an embed whose pooling reads every token, only those already pooled (a retracted
    request's); the others must run through the model."""
    if progress is None or not every_token:
        return matched
    return min(matched, progress.pooled_upto)
