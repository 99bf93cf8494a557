"""Speculative decoding at a rank: the drafts a decode step verifies, how many
tokens each request may draft (adaptive), and the accept figures. No torch here.

A running request that decodes may get a *draft*: up to k tokens guessed ahead. Its span
then runs its last token and the draft (1 + k tokens) in the step's one forward pass, with
logits at every position; the runner (scheduler/speculative/verify.py) keeps the longest prefix of the
draft the target model agrees with, plus one token of its own, and postprocess.py appends
them one by one (each through the stop checks) and frees the KV slots of the rejected
draft tokens at once.

The drafter is a small interface (:class:`Drafter`: ``propose(reqs, limits) -> drafts``) so
another source can slot in: ``NGRAM`` is prompt lookup in the request's own prompt and
output (:class:`NgramDrafter`); ``STANDALONE`` drafts with a small model of the same
tokenizer (scheduler/speculative/draft_drafter.py's DraftModelDrafter over scheduler/speculative/draft_model.py).

Speculation turns itself down where drafts are rejected (:class:`SpecProgress`): each
request keeps a moving estimate of how often its draft tokens are accepted and drafts only
as many tokens as pay for their cost (none when no length does: its steps stay plain decode
steps); drafts it did not run are judged against the tokens it then decodes, for free, so the
estimate recovers when the text starts repeating.
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
# the adaptive draft length (SpecProgress.draft_length): a draft of k tokens is taken to cost
# VERIFY_COST * k plain decode steps (SmolLM2-135M on CPU, verify rows in the decode batch:
# +2 rows 1.14x, +8 rows 1.61x of a batch-1 step; at batch 16 a row costs more of the step:
# docs/speculative.md); a draft runs only when its expected tokens per cost beat a plain step
# by MIN_GAIN; the acceptance estimate starts at INITIAL_RATE and moves by RATE_STEP per
# draft token judged
VERIFY_COST = 0.15
MIN_GAIN = 0.1
INITIAL_RATE = 0.5
RATE_STEP = 0.2


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The rank's speculative settings (SGLang's flag names; see docs/speculative.md)."""

    algorithm: str = "NGRAM"
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS  # the most draft tokens one step verifies
    min_window: int = 1  # --speculative-ngram-min-match-window-size
    max_window: int = 12  # --speculative-ngram-max-match-window-size
    adaptive: bool = True  # each request's draft length from its acceptance estimate


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
    elif draft_model_path:
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
    """One request's speculation: its n-gram index, its estimate of how often a draft token
    is accepted (which sets its draft length: :meth:`draft_length`), and its accept figures
    (reported in its final output)."""

    k: int  # the most tokens one draft may have (--speculative-num-draft-tokens)
    tokens: list[int] = field(default_factory=list)  # its sequence as indexed so far
    where: dict[int, list[int]] = field(default_factory=dict)  # token -> positions
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    verify_ct: int = 0  # verify steps (steps that ran a draft)
    rate: float = INITIAL_RATE  # moving estimate of P(a draft token is accepted)
    # a draft proposed but not run (its expected gain was too small): judged against the
    # tokens the request then decodes, at no cost, so the estimate keeps learning
    shadow: list[int] = field(default_factory=list)
    shadow_at: int = 0  # the output length when it was proposed

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

    def observe(self, accepted: int, drafted: int) -> None:
        """Learn from a draft: ``accepted`` tokens in a row accepted, then (when fewer than
        ``drafted``) one rejected; each a trial of the moving estimate."""
        rate = self.rate
        for _ in range(accepted):
            rate += RATE_STEP * (1.0 - rate)
        if accepted < drafted:
            rate -= RATE_STEP * rate
        self.rate = rate

    def verified(self, drafted: int, accepted: int) -> None:
        """Count one verify step and learn from it."""
        self.verify_ct += 1
        self.drafted += drafted
        self.accepted += accepted
        self.observe(accepted, drafted)

    def judge_shadow(self, output: list[int]) -> None:
        """Compare a pending shadow draft with the tokens decoded since; learn once known."""
        shadow = self.shadow
        if not shadow:
            return
        new = output[self.shadow_at : self.shadow_at + len(shadow)]
        matched = 0
        while matched < len(new) and new[matched] == shadow[matched]:
            matched += 1
        if matched < len(new):  # a rejection
            self.observe(matched, matched + 1)
        elif len(new) == len(shadow):  # all of it
            self.observe(matched, matched)
        else:
            return  # every token so far matched: wait for the rest
        self.shadow = []

    def draft_length(self, limit: int, cost: float = VERIFY_COST) -> int:
        """The draft length with the best expected tokens per unit of step cost (a verify
        span of 1 + k tokens costs 1 + cost * k decode steps), at most ``limit``; 0 when
        none gains at least MIN_GAIN over a plain decode step."""
        best, best_gain = 0, 1.0 + MIN_GAIN
        expected, p = 1.0, 1.0
        rate = self.rate
        for k in range(1, limit + 1):
            p *= rate
            expected += p
            gain = expected / (1.0 + cost * k)
            if gain > best_gain:
                best, best_gain = k, gain
        return best


def ngram_lookup(seq: Sequence[int], where: dict[int, list[int]], k: int, min_window: int,
                 max_window: int) -> list[int]:
    """Prompt lookup: the up-to-``k`` tokens that followed the latest earlier occurrence of
    the sequence's last ``n`` tokens, for the largest ``n`` from ``max_window`` down to
    ``min_window`` that occurs (the latest of ``MAX_CANDIDATES`` occurrences of the last
    token looked at); [] when none does. When that continuation reaches the sequence's end
    and the match covers its period at least once more (the text loops), the loop is
    continued up to ``k`` tokens."""
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
    draft = list(seq[best_pos + 1 : min(best_pos + 1 + k, end)])
    period = end - 1 - best_pos
    if len(draft) < k and best_len >= period:
        # the match runs into the suffix itself and the suffix repeats its period at least
        # twice (a loop: "a b a b a b"): continue the loop
        while len(draft) < k:
            draft.append(draft[len(draft) - period])
    return draft


class Drafter(Protocol):
    """A source of drafts: one list of guessed next tokens per request (may be empty)."""

    def propose(self, reqs: Sequence[Sequenced], limits: Sequence[int]) -> list[list[int]]:
        """Drafts for ``reqs``, each at most its ``limits`` entry long."""

    def reset(self) -> None:
        """Forget what the drafter keeps between steps (FlushCache, on an idle rank)."""


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

    def reset(self) -> None:
        """Nothing to forget: each request keeps its own n-gram index."""


def make_drafter(config: SpecConfig) -> Drafter | None:
    """The drafter of ``config.algorithm`` (check_config refused the others at start); None
    for STANDALONE, whose drafter needs the draft model: the rank installs it
    (scheduler/speculative/draft_drafter.py, wired by scheduler/speculative/setup.py)."""
    if config.algorithm == "NGRAM":
        return NgramDrafter(config)
    if config.algorithm == "STANDALONE":
        return None
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
