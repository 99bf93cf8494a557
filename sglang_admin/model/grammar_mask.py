"""Constrained decoding's step: one token bitmask for the batch, applied in one tensor op.

Every constrained row's matcher fills its row of an xgrammar token bitmask (int32 words,
bit ``j`` of word ``w`` allows token ``32 * w + j``); unconstrained rows stay all ones. The
bitmask goes to the logits' device once and one ``masked_fill_`` over the whole batch sets
every disallowed logit to -inf, before the penalties and sampling. Ids past the tokenizer's
vocabulary (a model vocabulary padded for alignment) are never allowed to a constrained row.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

_BITS = 32


class TokenMatcher(Protocol):
    """A request's grammar state (scheduler/grammar.py's GrammarState)."""

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None: ...


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask for ``rows`` rows (host memory, where matchers write it)."""
    words = (vocab_size + _BITS - 1) // _BITS
    return torch.full((rows, words), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The boolean allowed-token mask [rows, vocab_size] of an int32 bitmask."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every logit whose bit is clear to -inf: one masked fill over the batch."""
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    logits.masked_fill_(~allowed, float("-inf"))


def apply_grammar_masks(logits: torch.Tensor, matchers: list[TokenMatcher | None]) -> bool:
    """Mask the logits [rows, vocab] of the rows that have a matcher; False when none do
    (nothing was touched)."""
    if all(m is None for m in matchers):
        return False
    bitmask = allocate_bitmask(len(matchers), logits.shape[1])
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill_next_token_bitmask(bitmask, row)
    apply_bitmask(logits, bitmask)
    return True
