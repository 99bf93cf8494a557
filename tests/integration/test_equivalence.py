"""Through the server, greedy tokens and logprobs equal transformers' on tiny checkpoints."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import Prestart, ServerProc, greedy, run_generate, start_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 320
PROMPTS = [[3, 14, 15, 92, 65, 35], [27, 18, 28], list(range(40, 140)), [7] * 17]
NEW_TOKENS = [12, 20, 8, 16]


def _build(kind: str, path: Path) -> Path:
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=1, bos_token_id=0, pad_token_id=0,
    )
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # random q/k/v biases, so the bias path is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # a larger init than 0.02 keeps greedy outputs varied
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


KINDS = ["qwen2", "llama"]


@pytest.fixture(scope="module")
def kinds_ahead(tmp_path_factory) -> tuple[Prestart, dict[str, Path]]:
    """Each kind's checkpoint and worker, the next kind's started while one's tests run."""
    paths: dict[str, Path] = {}

    def start(kind: str) -> ServerProc:
        paths[kind] = _build(kind, tmp_path_factory.mktemp(kind))
        return start_server(
            tmp_path_factory.mktemp(f"{kind}-srv"),
            "--model-path", str(paths[kind]), "--dtype", "float32", "--max-prefill-tokens",
            "64", wait=False,
        )

    return Prestart(KINDS, start), paths


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, kinds_ahead) -> Iterator[tuple[ServerProc, object]]:
    prestart, paths = kinds_ahead
    srv = prestart.take(request.param)
    path = paths[request.param]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    yield srv, model
    srv.stop()


def _reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[tok].item()
        for step, tok in zip(out.logits, tokens)
    ]
    return tokens, logprobs


def test_greedy_tokens_and_logprobs_equal_transformers(tiny) -> None:
    srv, model = tiny
    info = srv.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.vocab_size == VOCAB
    stub = srv.stub()
    # All prompts at once: batching, chunked prefill (64-token chunks) and decode mix.
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(run_generate, stub, greedy(p, n, return_logprob=True), timeout=120)
            for p, n in zip(PROMPTS, NEW_TOKENS)
        ]
        results = [f.result() for f in futures]
    for prompt, n, (tokens, complete) in zip(PROMPTS, NEW_TOKENS, results):
        ref_tokens, ref_logprobs = _reference(model, prompt, n)
        assert tokens == ref_tokens
        ours = list(complete.output_logprobs.token_logprobs)
        assert len(ours) == n
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4
