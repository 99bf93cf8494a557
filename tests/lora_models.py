"""Tiny base models (transformers) and random PEFT LoRA adapters for the LoRA tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 320
# (adapter name, target modules, rank, alpha, use_rslora)
ADAPTERS: dict[str, tuple[list[str], int, int, bool]] = {
    "attn": (["q_proj", "k_proj", "v_proj", "o_proj"], 8, 16, False),
    "mlp": (["gate_proj", "up_proj", "down_proj", "q_proj"], 4, 8, True),
}


def build_base(kind: str, path: Path) -> Path:
    """A tiny random Qwen2 or Llama checkpoint (float32), as test_equivalence builds them."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=1, bos_token_id=0, pad_token_id=0,
    )
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, tie_word_embeddings=True))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif kind == "qwen2" and p.dim() == 1 and p.shape[0] != 64:
                p.normal_(0, 0.5)  # q/k/v biases
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_adapter(base: Path, name: str, path: Path, seed: int) -> Path:
    """A random PEFT LoRA adapter of ADAPTERS[name] over the base model, save_pretrained'd."""
    targets, rank, alpha, rslora = ADAPTERS[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
        init_lora_weights=False, lora_dropout=0.0,
    )
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for pname, p in wrapped.named_parameters():
            if "lora_" in pname:
                p.normal_(0, 0.15)
    wrapped.save_pretrained(path, safe_serialization=True)
    return path


def peft_model(base: Path, adapters: dict[str, Path]) -> Any:
    """The base model with every adapter loaded under its name (set_adapter picks one)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    wrapped = None
    for name, path in adapters.items():
        if wrapped is None:
            wrapped = peft.PeftModel.from_pretrained(model, path, adapter_name=name)
        else:
            wrapped.load_adapter(path, adapter_name=name)
    wrapped.eval()
    return wrapped


def reference(model: Any, adapter: str | None, prompt: list[int], n: int
              ) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from peft with `adapter` active (None: the base)."""
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = _generate(model, prompt, n)
        else:
            model.set_adapter(adapter)
            out = _generate(model, prompt, n)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[tok].item()
                for step, tok in zip(out.logits, tokens)]
    return tokens, logprobs


def _generate(model: Any, prompt: list[int], n: int) -> Any:
    return model.generate(
        input_ids=torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )
