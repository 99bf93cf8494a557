"""Speculative decoding's verification: a verify sequence (its last token, then
its draft) run as one decode row per position, and the run of tokens the step gives it.

Row ``i`` is the decode of position ``prefix_len + i`` with the sequence's first ``i`` draft
tokens already in its table row: the step writes every new token's K/V before any of them
attends, so row ``i`` attends to exactly the positions up to its own (the span's causal
mask), through the plain decode path (the C decode layer on CPU: a verify row costs what one
more sequence of a decode batch costs). Each row is sampled as the plain decode step at that
point would sample it: its output is the sequence's followed by those ``i`` draft tokens,
so penalties, ``min_new_tokens``, logit bias and logprobs are the ones a non-speculative
step computes. The run keeps row 0's token; while a row's token equals the draft token at
its place, the draft token is accepted and the next row's token follows; the first row
whose token differs ends the run with that token (the correction), and a fully accepted
draft ends with the last row's token (the bonus).

Why this keeps the target's distribution exactly: drafts here are deterministic (n-gram
lookup: the draft distribution q is a point mass on the draft token x). Speculative
sampling accepts x with probability min(1, p(x)/q(x)) = p(x), and on rejection draws from
(p - q)+ normalized, which is p with x's mass removed, renormalized. Drawing y ~ p and
accepting when y == x does exactly that: P(accept) = p(x), and given a rejection y is
distributed as p(y) / (1 - p(x)) over y != x. Greedy rows (argmax) are the special case
p = one-hot: the accepted prefix is the longest one equal to the target's argmax, so the
output is the non-speculative output token for token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sglang_admin.model.step_io import SeqInput, SeqOutput


def invalid(s: SeqInput) -> str | None:
    """Why a verify sequence cannot run (None: it can): its tokens must be its last token
    then its draft, its table slots must reach its last position, and it must sample."""
    draft = s.draft or []
    if len(s.token_ids) != 1 + len(draft):
        return f"a verify sequence of {len(s.token_ids)} tokens with a draft of {len(draft)}"
    if s.prefix_len < 1 or not s.sample:
        return "a verify sequence must follow a prefilled prefix and sample"
    if s.table_start > s.prefix_len or (
            s.table_start + len(s.table_slots) != s.prefix_len + len(s.token_ids)):
        return "a verify sequence's table slots must cover its positions"
    if s.grammar is not None or s.return_hidden_states or s.embed is not None:
        return "a verify sequence cannot have a grammar, hidden states or pooling"
    return None


def expand(seqs: Sequence[SeqInput]
           ) -> tuple[list[SeqInput], list[int], dict[int, list[SeqInput]]]:
    """The step's sequences with each verify sequence replaced by one decode row per
    position (row ``i``: the token at ``prefix_len + i``, its output followed by the first
    ``i`` draft tokens); the index in ``seqs`` of each flat sequence; each verify
    sequence's rows by ``id()``. The rows share the sequence's table row: a decode step
    writes every new token's K/V before any attends, and row ``i`` attends to the
    ``prefix_len + i + 1`` positions up to its own, which is the causal mask of the span."""
    flat: list[SeqInput] = []
    origin: list[int] = []
    rows: dict[int, list[SeqInput]] = {}
    for index, s in enumerate(seqs):
        if not s.draft:
            flat.append(s)
            origin.append(index)
            continue
        draft = s.draft
        p, start = s.prefix_len, s.table_start
        mine: list[SeqInput] = []
        for i, token in enumerate(s.token_ids):
            if i == 0:  # the table's unsynced entries up to its own position
                table_start, slots = start, s.table_slots[: p + 1 - start]
            else:
                table_start, slots = p + i, [s.table_slots[p + i - start]]
            mine.append(dataclasses.replace(
                s, prefix_len=p + i, token_ids=[token], table_start=table_start,
                table_slots=slots,
                output_ids=s.output_ids if i == 0 else [*s.output_ids, *draft[:i]],
                draft=None))
        rows[id(s)] = mine
        flat.extend(mine)
        origin.extend([index] * len(mine))
    return flat, origin, rows


def collect(seqs: Sequence[SeqInput], rows: dict[int, list[SeqInput]],
            outs: Sequence[SeqOutput | None]) -> list[SeqOutput | None]:
    """The outputs in ``seqs`` order from those of :func:`expand`'s flat sequences: a verify
    sequence's is its accepted run (:func:`accept_run`)."""
    result: list[SeqOutput | None] = []
    i = 0
    for s in seqs:
        mine = rows.get(id(s))
        if mine is None:
            result.append(outs[i])
            i += 1
            continue
        result.append(accept_run(s.draft or [], outs[i : i + len(mine)]))
        i += len(mine)
    return result


def accept_run(draft: Sequence[int], outs: Sequence[SeqOutput | None]) -> SeqOutput:
    """A verify sequence's output from its rows' outputs: row 0's token with the rest of the
    run in ``more``. While a row's token equals the draft token at its place, the draft
    token is accepted and the next row's token follows; the first row that differs ends
    the run with its token (the correction), and a fully accepted draft ends with the last
    row's (the bonus). A row that failed ends the run before it (the step after recomputes
    that position and fails then, as a non-speculative step would); a failed first row is
    the sequence's output."""
    run: list[SeqOutput] = []
    for i, out in enumerate(outs):
        if out is None or out.error is not None:
            break
        run.append(out)
        if i >= len(draft) or out.token_id != draft[i]:
            break
    if not run:
        first = outs[0] if outs else None
        return first if first is not None else SeqOutput(
            0, error="a verify sequence produced no output", error_code="INTERNAL")
    head = run[0]
    head.more = run[1:]
    return head
