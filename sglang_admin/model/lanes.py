"""How a CPU step's work is cut up: sequences into lanes, decode sequences into groups.

Pure arithmetic on lengths (no torch), used by model/batch.py:

- a **lane** is a run of a step's sequences computed by a thread of its own at the same
  time as the others (``lane_cuts``);
- a **decode group** is a run of decode sequences of similar length whose keys are padded to
  the group's longest only (``group_by_length``).
"""

from __future__ import annotations

import itertools

# the keys one new token's attention reads that cost about as much as its projections, and
# the least work (in tokens) worth a lane of its own
ATTENTION_KEYS_PER_TOKEN = 256.0
MIN_LANE_WORK = 4.0
# A decode-only step of a model this large (decoder matmul weights, in parameters) has each
# projection's weight rows cut among the lane threads (model/runner.py), each thread streaming
# its part of the weights for all the step's sequences. Cutting the sequences into lanes
# instead streams every weight once per lane: 30 layers of SmolLM2-135M's MLP at 32 rows, two
# threads, loaded machine: one thread 442 ms, sequences cut 496 ms, weight rows cut 222 ms
# (2026-12-02). On the toy (2.8M) a step's fixed costs and the C decode layer win.
SPLIT_MATMUL_PARAMS = 16_000_000
# An LM head this large (vocabulary x hidden) is cut in one part per lane (model/runner.py):
# SmolLM2-135M's (28M) at batch 32 is ~32 ms of one thread; the toy's (1M) is not worth it.
LM_HEAD_SPLIT_PARAMS = 8_000_000
# the K/V rows whose gather and attention cost about as much as one more group's ops, and
# the most groups per lane
GROUP_OVERHEAD_ROWS = 1024
MAX_DECODE_GROUPS = 4


def lane_cuts(seqs: list[tuple[int, int]], lanes: int) -> list[tuple[int, int]]:
    """Cut sequences, given as (new tokens, cached prefix) in order, into at most ``lanes``
    runs of about equal work, as (start, end) index pairs; one run when the work is too
    small to share.

    A sequence's work is its new tokens' projections plus their attention, which grows with
    the keys each new token reads: n * (1 + (prefix + n) / ATTENTION_KEYS_PER_TOKEN).
    """
    costs = [n * (1.0 + (prefix + n) / ATTENTION_KEYS_PER_TOKEN) for n, prefix in seqs]
    total = sum(costs)
    lanes = min(lanes, len(seqs), int(total // MIN_LANE_WORK))
    if lanes <= 1:
        return [(0, len(seqs))]
    done = list(itertools.accumulate(costs))
    cuts = [0]
    for j in range(1, lanes):  # each cut where the work done is nearest j/lanes of it
        target = total * j / lanes
        first, last = cuts[-1] + 1, len(seqs) - (lanes - j)
        cuts.append(min(range(first, last + 1), key=lambda i: abs(done[i - 1] - target)))
    cuts.append(len(seqs))
    return list(zip(cuts, cuts[1:]))


def group_by_length(lengths: list[int], overhead: int = GROUP_OVERHEAD_ROWS,
                    most: int = MAX_DECODE_GROUPS) -> list[tuple[int, int]]:
    """Cut ascending ``lengths`` into 1..``most`` runs of equal count, (start, end) pairs:
    the count of runs whose K/V rows (each run pads to its longest) plus ``overhead`` rows
    per run (its ops' fixed cost) are fewest."""
    n = len(lengths)
    best: list[tuple[int, int]] = []
    best_cost = float("inf")
    for k in range(1, min(most, n) + 1):
        bounds = [n * i // k for i in range(k + 1)]
        runs = list(zip(bounds, bounds[1:]))
        cost = sum((b - a) * lengths[b - 1] + overhead for a, b in runs)
        if cost < best_cost:
            best, best_cost = runs, cost
    return best
