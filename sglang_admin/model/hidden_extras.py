"""Per-step outputs beside the sampled token: prompt (input) logprobs from a prefill's
hidden states, and the last layer's hidden state of sampled positions."""

from __future__ import annotations

from typing import Any, Protocol

import torch

TopList = list[tuple[int, float]]
InputLogprobs = list[tuple[int, float | None, TopList]]  # (prompt position, logprob, top-k)


class _Seq(Protocol):
    prefix_len: int
    token_ids: list[int]
    prompt_ids: list[int]
    logprob_start_len: int
    top_logprobs_num: int


def input_positions(s: _Seq) -> range:
    """Prompt positions t >= logprob_start_len whose logprob this step can give: the
    logits at position t - 1 must be computed in this step."""
    p, n = s.prefix_len, len(s.token_ids)
    return range(max(s.logprob_start_len, p + 1), min(len(s.prompt_ids), p + n + 1))


def input_logprobs(model: Any, hidden: torch.Tensor, seqs: list[_Seq],
                   offsets: list[int]) -> dict[int, InputLogprobs]:
    """For every sequence that asks for prompt logprobs (``logprob_start_len >= 0``): the
    logprob of each prompt token (given the tokens before it) this step computed, with the
    top ``top_logprobs_num`` alternatives; keyed by ``id(seq)``. Position 0 has no logprob
    (None), as in SGLang."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[_Seq, int, list[int]]] = []  # seq, first row, its positions
    for s, off in zip(seqs, offsets):
        if s.logprob_start_len < 0:
            continue
        positions = list(input_positions(s))
        owners.append((s, len(rows), positions))
        rows.extend(off + (t - 1 - s.prefix_len) for t in positions)
        targets.extend(s.prompt_ids[t] for t in positions)
    result: dict[int, InputLogprobs] = {}
    if not owners:
        return result
    values: list[float] = []
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if rows:
        index = torch.tensor(rows, device=hidden.device)
        lps = model.compute_logits(hidden.index_select(0, index)).float().log_softmax(dim=-1)
        target = torch.tensor(targets, device=hidden.device).unsqueeze(1)
        values = lps.gather(1, target).squeeze(1).tolist()
        k = max(s.top_logprobs_num for s, _, _ in owners)
        if k > 0:
            tv, ti = lps.topk(min(k, lps.shape[1]), dim=-1)
            top_vals, top_ids = tv.tolist(), ti.tolist()
    for s, first, positions in owners:
        entries: InputLogprobs = []
        if s.logprob_start_len == 0 and s.prefix_len == 0:
            entries.append((0, None, []))
        k = s.top_logprobs_num
        for j, t in enumerate(positions):
            r = first + j
            top = list(zip(top_ids[r][:k], top_vals[r][:k])) if k > 0 else []
            entries.append((t, values[r], top))
        result[id(s)] = entries
    return result


def hidden_rows(model: Any, hidden: torch.Tensor, select: torch.Tensor,
                wanted: list[bool]) -> list[list[float] | None]:
    """The last layer's hidden state (after the final norm, what the LM head reads, as
    SGLang returns it) of each sampled row whose sequence asked for it."""
    if not any(wanted):
        return [None] * len(wanted)
    rows = model.model.norm(hidden.index_select(0, select)).float().tolist()
    return [row if want else None for row, want in zip(rows, wanted)]
