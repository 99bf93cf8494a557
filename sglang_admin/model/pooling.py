"""Pooling of a prefill's final hidden states into one vector per request: the last
token's (LAST), the first token's (CLS) or their float32 mean (MEAN), L2-normalized when the
model says so; a classifier's score logits at the last token.

A prompt prefilled in chunks is pooled across steps: the request's progress object (see
:class:`PoolProgress`) keeps what earlier chunks gave.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from sglang_admin.model.embedding_spec import PoolingType


class PoolProgress(Protocol):
    """A request's pooling state at the rank (scheduler/embedding.py's EmbedProgress)."""

    pooled_upto: int  # prompt positions [0, pooled_upto) are in ``partial``
    partial: Any  # the model's running value (a float32 tensor), None before the first


class PooledSeq(Protocol):
    """The fields of the runner's SeqInput that pooling reads."""

    prefix_len: int
    token_ids: list[int]
    prompt_ids: list[int]
    embed: PoolProgress | None


def pool(model: Any, hidden: torch.Tensor, seqs: list[PooledSeq],
         offsets: list[int]) -> dict[int, list[float] | str]:
    """For every sequence with ``embed`` set: absorb this step's hidden rows ([T, hidden],
    before the final norm; sequence i's rows start at offsets[i]); at its last prompt chunk
    the pooled vector (or the score logits). Keyed by ``id(seq)``; a string is that
    sequence's own failure."""
    spec = model.spec
    result: dict[int, list[float] | str] = {}
    last_rows: list[int] = []
    last_seqs: list[PooledSeq] = []
    every_token = spec.pools_every_token
    for s, off in zip(seqs, offsets):
        progress = s.embed
        if progress is None:
            continue
        p, n = s.prefix_len, len(s.token_ids)
        final = p + n == len(s.prompt_ids)
        if every_token:
            if progress.pooled_upto < p:
                result[id(s)] = (f"pooling lost prompt positions {progress.pooled_upto}.."
                                 f"{p - 1} (their hidden states were not computed)")
                continue
            lo = progress.pooled_upto - p  # rows already pooled (a retracted request's)
            if lo < n:
                rows = model.final_hidden(hidden[off + lo : off + n]).float()
                if spec.pooling == PoolingType.MEAN:
                    total = rows.sum(dim=0)
                    progress.partial = total if progress.partial is None else (
                        progress.partial + total)
                elif progress.pooled_upto == 0:  # CLS: the first prompt token
                    progress.partial = rows[0].clone()
                progress.pooled_upto = p + n
            if final:
                vector = progress.partial
                if spec.pooling == PoolingType.MEAN:
                    vector = vector / len(s.prompt_ids)
                result[id(s)] = _finish(vector.unsqueeze(0), spec.normalize)[0]
        elif final:
            last_rows.append(off + n - 1)
            last_seqs.append(s)
    if last_seqs:
        index = torch.tensor(last_rows, device=hidden.device)
        states = model.final_hidden(hidden.index_select(0, index))
        if model.score is not None:
            vectors = _finish(model.score(states).float(), False)
        else:
            vectors = _finish(states.float(), spec.normalize)
        for s, vector in zip(last_seqs, vectors):
            result[id(s)] = vector
    return result


def _finish(vectors: torch.Tensor, normalize: bool) -> list[list[float]]:
    """Rows as lists of floats, L2-normalized when asked."""
    if normalize:
        vectors = F.normalize(vectors, p=2, dim=-1)
    return vectors.tolist()
