"""Speculative decoding at a rank (issue 47): the drafts a decode step verifies, how many
tokens each request may draft (adaptive), and the accept figures. No torch here.

A running request that decodes may get a *draft*: up to k tokens guessed ahead. Its span
then runs its last token and the draft (1 + k tokens) in the step's one forward pass, with
logits at every position; the runner (model/spec_verify.py) keeps the longest prefix of the
draft the target model agrees with, plus one token of its own, and postprocess.py appends
them one by one (each through the stop checks) and frees the KV slots of the rejected
draft tokens at once.

The drafter is a small interface (:class:`Drafter`: ``propose(reqs, limits) -> drafts``) so
another source (a draft model, ``STANDALONE``) can slot in; the one built is ``NGRAM``:
prompt lookup in the request's own prompt and output (:class:`NgramDrafter`).

Speculation turns itself down where drafts are rejected (:class:`SpecProgress`): a request's
draft length shrinks after a rejection and grows after a full accept, and a request whose
drafts keep failing (or that finds no n-gram match) drafts nothing for a while, so its steps
stay plain decode steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

ALGORITHMS = ("NGRAM", "STANDALONE")
MAX_DRAFT_TOKENS = 64  # --speculative-num-draft-tokens' upper bound
DEFAULT_DRAFT_TOKENS = 8
# how many of the latest earlier occurrences of the last token a lookup looks at
MAX_CANDIDATES = 64
# the longest a request drafts nothing after drafts kept failing (steps)
MAX_COOLDOWN = 16


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The rank's speculative settings (SGLang's flag names; see docs/speculative.md)."""

    algorithm: str = "NGRAM"
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS  # the most draft tokens one step verifies
    min_window: int = 1  # --speculative-ngram-min-match-window-size
    max_window: int = 12  # --speculative-ngram-max-match-window-size
    adaptive: bool = True  # shrink / grow / pause each request's draft length


def check_config(algorithm: str | None, num_draft_tokens: int | None, min_window: int,
                 max_window: int, draft_model_path: str | None = None) -> str | None:
    """Why these settings cannot start (one line); None when they can."""
    if algorithm is None:
        if draft_model_path:
            return ("--speculative-draft-model-path needs --speculative-algorithm "
                    "STANDALONE")
        return None
    if algorithm not in ALGORITHMS:
        return (f"--speculative-algorithm {algorithm!r} is not one of "
                f"{', '.join(ALGORITHMS)}")
    if algorithm == "STANDALONE":
        if not draft_model_path:
            return "--speculative-algorithm STANDALONE needs --speculative-draft-model-path"
        return "STANDALONE speculative decoding is not implemented yet (use NGRAM)"
    if draft_model_path:
        return "--speculative-draft-model-path applies to STANDALONE only, not NGRAM"
    if num_draft_tokens is not None and not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        return (f"--speculative-num-draft-tokens {num_draft_tokens} is out of range "
                f"(1..{MAX_DRAFT_TOKENS})")
    if not 1 <= min_window <= max_window:
        return (f"--speculative-ngram-min-match-window-size {min_window} and "
                f"--speculative-ngram-max-match-window-size {max_window}: need "
                f"1 <= min <= max")
    if max_window > 1024:
        return f"--speculative-ngram-max-match-window-size {max_window} is over 1024"
    return None


class Sequenced(Protocol):
    """What drafting reads of a request (scheduler/request.py's Req)."""

    spec: SpecProgress | None

    @property
    def seq_len(self) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


@dataclass(eq=False, slots=True)
class SpecProgress:
    """One request's speculation: its n-gram index, its adaptive draft length and its
    accept figures (reported in its final output)."""

    k: int  # the most tokens its next draft may have
    tokens: list[int] = field(default_factory=list)  # its sequence as indexed so far
    where: dict[int, list[int]] = field(default_factory=dict)  # token -> positions
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    verify_ct: int = 0  # verify steps (steps that ran a draft)
    cooldown: int = 0  # steps left to draft nothing
    misses: int = 0  # verify steps in a row that accepted nothing

    def index(self, req: Sequenced) -> list[int]:
        """The request's sequence (prompt then output), indexed up to its end."""
        seq = self.tokens
        have, total = len(seq), req.seq_len
        if total > have:
            seq.extend(req.tokens(have, total))
            where = self.where
            for pos in range(have, total):
                where.setdefault(seq[pos], []).append(pos)
        return seq

    def verified(self, drafted: int, accepted: int, k_max: int, adaptive: bool) -> None:
        """Count one verify step and adapt the draft length: all accepted -> longer; some
        rejected -> as long as what was accepted, plus one; none -> pause a while."""
        self.verify_ct += 1
        self.drafted += drafted
        self.accepted += accepted
        if not adaptive:
            return
        if accepted >= drafted:
            self.k = min(k_max, self.k * 2)
            self.misses = 0
        elif accepted == 0:
            self.misses += 1
            self.k = max(1, self.k // 2)
            self.cooldown = min(MAX_COOLDOWN, 1 << min(self.misses, 4))
        else:
            self.misses = 0
            self.k = max(1, accepted + 1)


def ngram_lookup(seq: Sequence[int], where: dict[int, list[int]], k: int, min_window: int,
                 max_window: int) -> list[int]:
    """Prompt lookup: the up-to-``k`` tokens that followed the latest earlier occurrence of
    the sequence's last ``n`` tokens, for the largest ``n`` from ``max_window`` down to
    ``min_window`` that occurs (the latest of ``MAX_CANDIDATES`` occurrences of the last
    token looked at); [] when none does."""
    end = len(seq)
    if end < 2 or k <= 0:
        return []
    last = seq[-1]
    positions = where.get(last)
    if not positions:
        return []
    best_len, best_pos = 0, -1
    looked = 0
    for i in range(len(positions) - 1, -1, -1):
        p = positions[i]
        if p >= end - 1:
            continue  # the last token itself
        looked += 1
        if looked > MAX_CANDIDATES:
            break
        n = 1
        limit = min(max_window, p + 1)
        while n < limit and seq[p - n] == seq[end - 1 - n]:
            n += 1
        if n > best_len:  # ties keep the later occurrence (seen first)
            best_len, best_pos = n, p
            if n >= max_window:
                break
    if best_len < min_window:
        return []
    return list(seq[best_pos + 1 : min(best_pos + 1 + k, end)])


class Drafter(Protocol):
    """A source of drafts: one list of guessed next tokens per request (may be empty)."""

    def propose(self, reqs: Sequence[Sequenced], limits: Sequence[int]) -> list[list[int]]:
        """Drafts for ``reqs``, each at most its ``limits`` entry long."""


class NgramDrafter:
    """NGRAM: drafts from the request's own prompt and output (prompt lookup)."""

    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    def propose(self, reqs: Sequence[Sequenced], limits: Sequence[int]) -> list[list[int]]:
        cfg = self.config
        drafts: list[list[int]] = []
        for req, limit in zip(reqs, limits):
            prog = req.spec
            if prog is None or limit <= 0:
                drafts.append([])
                continue
            seq = prog.index(req)
            drafts.append(ngram_lookup(seq, prog.where, limit, cfg.min_window, cfg.max_window))
        return drafts


def make_drafter(config: SpecConfig) -> Drafter:
    """The drafter of ``config.algorithm`` (check_config refused the others at start)."""
    if config.algorithm == "NGRAM":
        return NgramDrafter(config)
    raise ValueError(f"speculative algorithm {config.algorithm!r} is not implemented")


@dataclass(slots=True)
class SpecCounters:
    """A rank's accept figures since start (or the last flush)."""

    verify_steps: int = 0  # request-steps that verified a draft
    drafted: int = 0
    accepted: int = 0

    @property
    def accept_length(self) -> float:
        """Mean tokens a verify step gave one request: accepted drafts + its own token
        (SGLang's avg_spec_accept_length); 0 before any."""
        if not self.verify_steps:
            return 0.0
        return (self.accepted + self.verify_steps) / self.verify_steps

    @property
    def accept_rate(self) -> float:
        """Accepted draft tokens over drafted ones; 0 before any."""
        return self.accepted / self.drafted if self.drafted else 0.0
