"""A tiny target/draft pair for STANDALONE speculative decoding (issue 47): the tiny random
Llama of tests/lora_models.py as the target and, as the draft, the same checkpoint with
its weights perturbed (it agrees with the target often, not always)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def build_pair(root: Path, noise: float = 0.01) -> tuple[Path, Path]:
    """(target, draft) checkpoint directories under ``root``."""
    from tests.lora_models import build_base

    target = build_base("llama", root / "target")
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    draft = root / "draft"
    model.save_pretrained(draft, safe_serialization=True)
    return target, draft


def build_other_vocab(root: Path) -> Path:
    """A tiny Llama whose vocabulary (256 tokens) differs from the pair's (320)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512))
    path = root / "other-vocab"
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens of the checkpoint for each prompt (EOS masked, as
    ignore_eos with min_new_tokens = n)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs
