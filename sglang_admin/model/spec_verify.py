"""Speculative decoding's verification (issue 47): from the target's logits at every
position of a verify sequence (its last token, then its draft), the run of tokens the step
gives it.

Row ``i`` of a verify sequence holds the target's logits after the sequence and the first
``i`` draft tokens. Each row is sampled as the plain decode step at that point would sample
it: its own :class:`SampleRequest` sees the output *with* those ``i`` draft tokens, so
penalties, ``min_new_tokens``, logit bias and logprobs are the ones a non-speculative step
computes. The run keeps row 0's token; while a row's token equals the draft token at its
place, the draft token is accepted and the next row's token follows; the first row whose
token differs ends the run with that token (the correction), and a fully accepted draft
ends with the last row's token (the bonus).

Why this keeps the target's distribution exactly: drafts here are deterministic (n-gram
lookup: the draft distribution q is a point mass on the draft token x). Speculative
sampling accepts x with probability min(1, p(x)/q(x)) = p(x), and on rejection draws from
(p - q)+ normalized, which is p with x's mass removed, renormalized. Drawing y ~ p and
accepting when y == x does exactly that: P(accept) = p(x), and given a rejection y is
distributed as p(y) / (1 - p(x)) over y != x. Greedy rows (argmax) are the special case
p = one-hot: the accepted prefix is the longest one equal to the target's argmax, so the
output is the non-speculative output token for token (up to the numerics of the extend
path, which computes the same positions as the decode path in another order).
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_admin.model.sampling import SampleRequest
from sglang_admin.model.step_io import SeqInput, SeqOutput


def row_requests(sampled: Sequence[SeqInput], rows: Sequence[int]) -> list[SampleRequest]:
    """One sampling request per row of the logits: a verify sequence's row ``i`` sees its
    output followed by the first ``i`` draft tokens."""
    reqs: list[SampleRequest] = []
    for s, count in zip(sampled, rows):
        ids = s.token_ids_logprob if s.return_logprob else None
        draft = s.draft or []
        for i in range(count):
            output = s.output_ids if i == 0 else [*s.output_ids, *draft[:i]]
            reqs.append(SampleRequest(s.sampling, s.prompt_ids, output, s.return_logprob,
                                      s.top_logprobs_num, ids))
    return reqs


def row_grammars(sampled: Sequence[SeqInput], rows: Sequence[int]) -> list:
    """The grammar matcher of each row (verify sequences never have one: speculative.py)."""
    out: list = []
    for s, count in zip(sampled, rows):
        out.append(s.grammar if count == 1 else None)
        out.extend([None] * (count - 1))
    return out


def accept(sampled: Sequence[SeqInput], rows: Sequence[int],
           outs: Sequence[SeqOutput]) -> dict[int, SeqOutput]:
    """Each sampled sequence's output by ``id()``: a plain one's row as it is; a verify
    sequence's first token with the rest of its run in ``more``. A row that failed ends
    the run before it (the step after recomputes that position and fails then, as a
    non-speculative step would); a failed first row is the sequence's output."""
    by_seq: dict[int, SeqOutput] = {}
    r = 0
    for s, count in zip(sampled, rows):
        mine = outs[r : r + count]
        r += count
        if count == 1:
            by_seq[id(s)] = mine[0]
            continue
        draft = s.draft or []
        run: list[SeqOutput] = []
        for i, out in enumerate(mine):
            if out.error is not None:
                break
            run.append(out)
            if i >= len(draft) or out.token_id != draft[i]:
                break
        if not run:
            by_seq[id(s)] = mine[0]
            continue
        first = run[0]
        first.more = run[1:]
        by_seq[id(s)] = first
    return by_seq
