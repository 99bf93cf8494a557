"""Constrained decoding's step: one token bitmask for the batch, applied in one tensor op.

Every constrained row's matcher fills its row of an xgrammar token bitmask (int32 words,
bit ``j`` of word ``w`` allows token ``32 * w + j``); unconstrained rows stay all ones. The
bitmask goes to the logits' device once and one ``masked_fill_`` over the whole batch sets
every disallowed logit to -inf, before the penalties and sampling: one path for every
device. (xgrammar's own CPU kernel is kept as an explicit backend, for comparisons: it is
faster where most tokens are allowed and slower where few are.) Ids past the tokenizer's
vocabulary (a model vocabulary padded for alignment) are never allowed to a constrained row
(the matcher's tokenizer info covers the whole width).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

_BITS = 32
# _DISALLOWED[b, j]: bit j of byte b is clear (token disallowed)
_DISALLOWED = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0


class TokenMatcher(Protocol):
    """A request's grammar state (scheduler/grammar.py's GrammarState)."""

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None: ...


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask for ``rows`` rows (host memory, where matchers write it)."""
    words = (vocab_size + _BITS - 1) // _BITS
    return torch.full((rows, words), -1, dtype=torch.int32)


def disallowed_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The boolean disallowed-token mask [rows, vocab_size] of an int32 bitmask (words are
    little-endian: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7)."""
    table = _DISALLOWED.to(bitmask.device)
    as_bytes = bitmask.contiguous().view(torch.uint8).int()  # [rows, words * 4]
    return table[as_bytes].view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None,
    backend: str = "auto",
) -> None:
    """Set every logit whose bit is clear to -inf, in one op over the batch. ``rows``: the
    rows that have a constraint (the others' bitmask rows are all ones); ``backend``:
    "auto" or "torch" (the masked fill), "xgrammar" (its CPU kernel; comparisons only)."""
    if backend == "auto":
        backend = "torch"
    if backend == "xgrammar":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=logits.shape[1], indices=rows, backend="cpu"
        )
        return
    device_mask = bitmask.to(logits.device, non_blocking=True)
    logits.masked_fill_(disallowed_mask(device_mask, logits.shape[1]), float("-inf"))


def apply_grammar_masks(
    logits: torch.Tensor, matchers: list[TokenMatcher | None], backend: str = "auto"
) -> dict[int, str]:
    """Mask the logits [rows, vocab] of the rows that have a matcher. Returns the rows whose
    matcher failed to fill its mask, with the reason: those rows must fail alone (their
    logits are left unmasked). Nothing is touched when no row is constrained."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return {}
    bitmask = allocate_bitmask(len(matchers), logits.shape[1])
    failed: dict[int, str] = {}
    for row in rows:
        try:
            matchers[row].fill_next_token_bitmask(bitmask, row)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - one request's grammar fails that request
            logger.exception("grammar mask of row %d failed", row)
            bitmask[row] = -1
            failed[row] = f"grammar mask failed: {type(exc).__name__}: {exc}"
    masked = [r for r in rows if r not in failed]
    if masked:
        apply_bitmask(logits, bitmask, masked, backend)
    return failed
