"""LoRA adapters on a GGUF model whose projections are kept quantized (model/quant/): the
base matmuls through the quantized store, each adapter's delta added as on dense weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from sglang_admin.messages import SamplingParams  # noqa: E402
from sglang_admin.model.gguf import resolve_model_path  # noqa: E402
from sglang_admin.model.lora import read_adapter, served_config, target_shapes  # noqa: E402
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.model.step_io import SeqInput  # noqa: E402
from tests.gguf_models import write_gguf  # noqa: E402
from tests.unit.test_model_runner import Req, simulate  # noqa: E402
from tests.unit.test_quant import cache_dir  # noqa: E402, F401 - autouse: a private cache

RANK = 4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _runner(path: str, dtype: str, quantized: bool) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=512,
                       max_running_requests=4, lora_slots=(2, 8),
                       quantization="gguf" if quantized else "")


def _write_adapter(runner: ModelRunner, path: Path, seed: int) -> Path:
    """A random PEFT LoRA adapter on every projection (PEFT's file layout and names)."""
    from safetensors.torch import save_file

    cfg = runner.model.config
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for target, (fan_in, fan_out) in target_shapes(cfg).items():
            module = "self_attn" if target in TARGETS[:4] else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g) * 0.2
            tensors[f"{pre}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g) * 0.2
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "bias": "none",
         "target_modules": list(TARGETS)}))
    return path


def _logprobs(runner: ModelRunner, ids: list[int], slots: list[int], decode: bool
              ) -> torch.Tensor:
    """[len(slots), len(ids) - 1] logprobs of each next token of ``ids``, one sequence per
    adapter slot of ``slots`` (-1: the base model) in the same batch: one decode step per
    token (``decode``: as many rows as sequences), or one prefill of every sequence."""
    greedy = SamplingParams(temperature=0.0)
    n = len(ids)
    pool = [list(range(1 + r * n, 1 + (r + 1) * n)) for r in range(len(slots))]
    if not decode:
        seqs = [SeqInput(r, 0, ids, 0, pool[r], greedy, ids, [], lora_slot=slot,
                         logprob_start_len=0) for r, slot in enumerate(slots)]
        outs = runner.forward_step(seqs)
        return torch.tensor([[lp for _, lp, _ in out.input_logprobs[1:]] for out in outs])
    values: list[list[float]] = [[] for _ in slots]
    for t in range(n - 1):
        seqs = [SeqInput(r, t, [ids[t]], 0, pool[r] if t == 0 else [], greedy, ids[:1],
                         ids[1:t + 1], return_logprob=True, lora_slot=slot,
                         token_ids_logprob=[ids[t + 1]]) for r, slot in enumerate(slots)]
        for r, out in enumerate(runner.forward_step(seqs)):
            values[r].append(out.token_ids_logprobs[0][1])
    return torch.tensor(values)


def test_lora_on_kept_weights_computes_what_the_dequantized_load_computes(
        tmp_path: Path) -> None:
    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", qtype="Q4_0", seed=5)))
    ref = _runner(out, "float32", quantized=False)
    kept = _runner(out, "float32", quantized=True)
    assert kept.model.quant is not None
    adapter_dir = _write_adapter(ref, tmp_path / "adapter", seed=1)
    for runner in (ref, kept):
        runner.lora.write(1, read_adapter(str(adapter_dir), served_config(runner.model), 8))
    ids = torch.randint(3, ref.info.vocab_size, (12,),
                        generator=torch.Generator().manual_seed(2)).tolist()
    slots = [1, -1]  # the adapter's row and a base row in one batch
    for decode in (True, False):
        want = _logprobs(ref, ids, slots, decode)
        got = _logprobs(kept, ids, slots, decode)
        assert (got - want).abs().max().item() < 1e-3, decode
        # the adapter changes what the model computes (else the comparison says nothing)
        assert (got[0] - got[1]).abs().max().item() > 0.1, decode
    # unloaded at run time: the slot's rows compute the base model again
    kept.lora.clear(1)
    base = _logprobs(kept, ids, [1, -1], True)
    assert (base[0] - base[1]).abs().max().item() == 0
    assert (base[1] - want[1]).abs().max().item() < 1e-3

    # bfloat16 activations (the default for kept weights): rows of a decode step through the
    # int4 kernel, the adapter's delta in bfloat16: mostly the same greedy tokens
    kept16 = _runner(out, "auto", quantized=True)
    assert kept16.dtype == torch.bfloat16 or not torch.backends.mkldnn.is_available()
    kept16.lora.write(0, read_adapter(str(adapter_dir), served_config(kept16.model), 8))
    prompts = [ids[:5], ids[:11]]

    def tokens(runner: ModelRunner, slot: int) -> list[list[int]]:
        reqs = [Req(p) for p in prompts]
        return [r.out for r in _simulate_with_slot(runner, reqs, slot)]

    want_tokens = tokens(ref, 1)
    assert want_tokens != tokens(ref, -1)
    got_tokens = tokens(kept16, 0)
    agree = sum(a == b for x, y in zip(got_tokens, want_tokens) for a, b in zip(x, y))
    assert agree >= 9, (got_tokens, want_tokens)  # of 12; random tiny models have near-ties


def _simulate_with_slot(runner: ModelRunner, reqs: list[Req], slot: int) -> list[Req]:
    """test_model_runner's simulate with every sequence on adapter ``slot``."""
    forward = runner.forward_step

    def with_slot(seqs: list[SeqInput]) -> list:
        for s in seqs:
            s.lora_slot = slot
        return forward(seqs)

    runner.forward_step = with_slot  # type: ignore[method-assign]
    try:
        return simulate(runner, reqs, 6)
    finally:
        del runner.forward_step


def test_lora_on_a_checkpoint_quantized_at_load(tmp_path: Path) -> None:
    """--torchao-config: the same placeholders and store, so the same LoRA path; against the
    dense model holding the quantized values (the store's dequantized view)."""
    from sglang_admin.model.loader import load_weights

    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", qtype="F32", seed=6)))
    dense = _runner(out, "float32", quantized=False)
    kept = ModelRunner(out, device="cpu", dtype="float32", max_total_tokens=512,
                       max_running_requests=4, lora_slots=(2, 8), quantization="int4wo-32")
    store = kept.model.quant
    assert store is not None and store.scheme == "int4wo-32"
    load_weights(dense.model, [(name, store.dequantized(name)) for name in store.by_name])
    adapter_dir = _write_adapter(dense, tmp_path / "adapter", seed=3)
    for runner in (dense, kept):
        runner.lora.write(0, read_adapter(str(adapter_dir), served_config(runner.model), 8))
    ids = list(range(10, 20))
    got, want = _logprobs(kept, ids, [0, -1], True), _logprobs(dense, ids, [0, -1], True)
    assert (got - want).abs().max().item() < 1e-3
    assert (got[0] - got[1]).abs().max().item() > 0.1
