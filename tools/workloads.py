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
    # samples per prompt (each asks for the prompt's output count) and their temperature
    # (0: greedy); n > 1 samples at temperature 1 as an RL rollout does
    n: int = 1
    temperature: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs) * self.n


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


def _random_prompts(rng: random.Random, vocab: int, count: int, lo: int, hi: int
                    ) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def chat_workload(vocab: int, seed: int = 2, requests: int = 32, prompt: tuple[int, int] = (30, 60),
                  output: tuple[int, int] = (64, 256)) -> Workload:
    """Chat traffic: ``requests`` at once, prompts of 30..60 tokens, outputs of 64..256."""
    rng = random.Random(seed)
    prompts = _random_prompts(rng, vocab, requests, *prompt)
    return Workload("chat", prompts, [rng.randint(*output) for _ in range(requests)])


def long_prompt_workload(vocab: int, seed: int = 3, requests: int = 8,
                         prompt: tuple[int, int] = (1024, 2048), output: int = 16) -> Workload:
    """Long prompts: ``requests`` prompts of 1..2k tokens, 16 output tokens each."""
    rng = random.Random(seed)
    return Workload("long", _random_prompts(rng, vocab, requests, *prompt), [output] * requests)


def parallel_sampling_workload(vocab: int, seed: int = 4, requests: int = 8, n: int = 8,
                               prompt: tuple[int, int] = (32, 64), output: int = 128) -> Workload:
    """RL rollouts: ``requests`` prompts of 32..64 tokens, n = 8 samples of 128 tokens each at
    temperature 1."""
    rng = random.Random(seed)
    prompts = _random_prompts(rng, vocab, requests, *prompt)
    return Workload("n8", prompts, [output] * requests, n=n, temperature=1.0)
