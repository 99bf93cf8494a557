"""The benchmark workloads shared by tools/bench_engine.py and tools/bench_served.py (no torch)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    """Prompts (token ids) and the number of output tokens each asks for."""

    name: str
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)


def mixed_workload(vocab: int, seed: int = 0) -> Workload:
    """64 requests, prompts of 16..256 tokens, outputs of 8..128 tokens (fixed seed)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))] for _ in range(64)]
    outputs = [rng.randint(8, 128) for _ in range(64)]
    return Workload("mixed", prompts, outputs)


def prefix_workload(vocab: int, seed: int = 1) -> Workload:
    """32 requests sharing a 960-token prefix with distinct 64-token tails, 16 outputs each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(960)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(64)] for _ in range(32)]
    return Workload("prefix", prompts, [16] * 32)
