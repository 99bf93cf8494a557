"""Stop strings: matched on the decoded tail of a request's output, at the rank.

The rank ends a request in the step whose token completes a stop string, so it never
decodes past the match. Only requests with stop strings pay for detokenization: the last
few tokens (enough to hold the longest stop string, whatever the tokens' lengths) are
decoded with the served model's tokenizer after each new token. A stop string that spans
several tokens matches as soon as its last piece arrives.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

Detokenize = Callable[[list[int]], str]
# Tokens decoded beyond the longest stop string's length in characters: a token decodes to
# at least one character except for the pieces of a multi-byte character, so this slack
# covers stop strings whose characters are split over several byte-level tokens.
TAIL_SLACK_TOKENS = 4


@dataclass(frozen=True)
class StopMatch:
    """The stop string that matched and how many trailing output tokens carry it (the
    tokens dropped from ``output_ids`` unless ``no_stop_trim``)."""

    stop: str
    trim: int


def find_stop(output_ids: list[int], stops: list[str], detokenize: Detokenize) -> StopMatch | None:
    """The stop string whose match starts first in the decoded tail of ``output_ids``."""
    if not stops or not output_ids:
        return None
    longest = max(len(s) for s in stops)
    window = output_ids[-(longest + TAIL_SLACK_TOKENS):]
    text = detokenize(window)
    found: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop)
        if pos >= 0 and (found is None or pos < found[0]):
            found = (pos, stop)
    if found is None:
        return None
    pos, stop = found
    trim = 1
    while trim < len(window) and len(detokenize(window[: len(window) - trim])) > pos:
        trim += 1
    return StopMatch(stop, trim)


def load_detokenizer(directory: str | None) -> Detokenize | None:
    """A decode function over the tokenizer in ``directory`` (tokenizer.json through the
    fast ``tokenizers`` library, else transformers' AutoTokenizer); None when there is
    none to load."""
    if not directory:
        return None
    path = os.path.join(directory, "tokenizer.json")
    try:
        if os.path.isfile(path):
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(path)
            return lambda ids: tok.decode(ids, skip_special_tokens=False)
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(directory)
        return lambda ids: auto.decode(ids, skip_special_tokens=False)
    except Exception as exc:  # noqa: BLE001 - reported; stop strings then fail per request
        logger.error("could not load the tokenizer in %s for stop strings: %s", directory, exc)
        return None


class _LazyDetokenizer:
    """transformers' AutoTokenizer, loaded at the first request with stop strings (slow
    to import: ranks that never see a stop string never pay for it)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._decode: Detokenize | None = None

    def __call__(self, ids: list[int]) -> str:
        if self._decode is None:
            self._decode = load_detokenizer(self.directory)
            if self._decode is None:
                raise RuntimeError(f"no tokenizer could be loaded from {self.directory}")
        return self._decode(ids)


def stop_string_detokenizer(tokenizer_path: str | None, model_tokenizer_path: str | None
                            ) -> Detokenize | None:
    """The rank's decode function for stop strings: tokenizer.json loaded now (fast), any
    other tokenizer format on first use; None when the model comes with no tokenizer."""
    directory = os.path.abspath(tokenizer_path) if tokenizer_path else model_tokenizer_path
    if not directory or not os.path.isdir(directory):
        return None
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return load_detokenizer(directory)
    return _LazyDetokenizer(directory)
