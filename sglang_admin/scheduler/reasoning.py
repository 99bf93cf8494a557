"""--reasoning-parser: the end of a reasoning model's think span, as SGLang finds it.

SGLang's parsers know each model family's think markers; its scheduler takes the first
token of the end marker (``tokenizer.encode(think_end, add_special_tokens=False)[0]``) and,
for a request with ``require_reasoning``, counts the output tokens up to and including
that token as the request's reasoning tokens. Here the rank resolves the token id once
(ModelInfo.think_end_id) and the server counts (server/generate_codec/streams.py).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# SGLang's --reasoning-parser names -> the text that ends the think span
THINK_END: dict[str, str] = {
    "deepseek-r1": "</think>",
    "deepseek-v3": "</think>",
    "qwen3": "</think>",
    "qwen3-thinking": "</think>",
    "glm45": "</think>",
    "step3": "</think>",
    "minimax": "</think>",
    "minimax-append-think": "</think>",
    "nano_v3": "</think>",
    "interns1": "</think>",
    "mimo": "</think>",
    "kimi": "\u25c1/think\u25b7",
}

# GetModelInfo.preferred_sampling_params: the keys a client may find there (SGLang's
# SamplingParams names); others are refused at start
PREFERRED_KEYS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "n", "logit_bias", "stream_interval", "regex", "json_schema", "ebnf",
    "structural_tag", "sampling_seed",
})


def check_reasoning_parser(name: str | None) -> str | None:
    """None when ``name`` is unset or a known parser, else the refusal."""
    if name is None or name in THINK_END:
        return None
    return (f"--reasoning-parser {name!r} is not one of {', '.join(sorted(THINK_END))}")


def check_preferred_sampling_params(text: str | None) -> str | None:
    """None when ``text`` is unset or a JSON object of sampling parameter names, else the
    refusal."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"--preferred-sampling-params is not JSON: {exc}"
    if not isinstance(value, dict):
        return "--preferred-sampling-params must be a JSON object"
    unknown = sorted(set(value) - PREFERRED_KEYS)
    if unknown:
        return (f"--preferred-sampling-params has unknown key(s) {', '.join(unknown)}; "
                f"sampling parameters are {', '.join(sorted(PREFERRED_KEYS))}")
    return None


def think_end_id(parser: str | None, directory: str | None) -> int:
    """The token id that ends the think span of ``parser``'s format in the tokenizer in
    ``directory`` (the first token of the marker's encoding, as SGLang); -1 when no parser
    is set or no tokenizer can be read (then no request counts reasoning tokens)."""
    if parser is None or directory is None:
        return -1
    marker = THINK_END[parser]
    path = os.path.join(directory, "tokenizer.json")
    try:
        if os.path.isfile(path):
            from tokenizers import Tokenizer

            ids = Tokenizer.from_file(path).encode(marker, add_special_tokens=False).ids
        else:
            from transformers import AutoTokenizer

            ids = AutoTokenizer.from_pretrained(directory).encode(
                marker, add_special_tokens=False)
    except Exception as exc:  # noqa: BLE001 - a tokenizer that does not load: no counting
        logger.error("--reasoning-parser %s: could not encode %r with the tokenizer in %s: "
                     "%s; reasoning tokens are not counted", parser, marker, directory, exc)
        return -1
    if not ids:
        return -1
    if len(ids) > 1:
        logger.warning("--reasoning-parser %s: %r is %d tokens in this tokenizer; its first "
                       "(%d) ends the think span (as SGLang)", parser, marker, len(ids), ids[0])
    return int(ids[0])


def count_reasoning(ids: list[int], end_id: int) -> tuple[int, bool]:
    """(the tokens of ``ids`` inside the think span, whether the span ended in them): the
    tokens up to and including the first ``end_id``, else all of them."""
    try:
        at = ids.index(end_id)
    except ValueError:
        return len(ids), False
    return at + 1, True


class ThinkingGate:
    """A request's grammar state held back until its think span ends (SGLang's
    require_reasoning with a constraint): every token is allowed and nothing is fed to the
    grammar up to and including the think-span end token; from the next token on the
    grammar decides. Same interface as grammar.py's GrammarState."""

    def __init__(self, inner: Any, end_id: int, thinking: bool = True) -> None:
        self.inner = inner
        self.end_id = end_id
        self.thinking = thinking

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        """Row ``row`` of the bitmask: left all-allowed while thinking, else the grammar's."""
        if not self.thinking:
            self.inner.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token: while thinking only watch for the end token."""
        if self.thinking:
            if token_id == self.end_id:
                self.thinking = False
            return True
        return self.inner.accept(token_id)

    @property
    def finished(self) -> bool:
        """The constraint is complete (never while thinking)."""
        return not self.thinking and self.inner.finished

    def fork(self) -> ThinkingGate:
        """A sibling sample's gate, at the same point."""
        return ThinkingGate(self.inner.fork(), self.end_id, self.thinking)
