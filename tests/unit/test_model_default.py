"""The embedded default model: deterministic, cached, loadable by transformers."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from sglang_admin.model.default_model import DEFAULT_MODEL_DIRNAME, ensure_default_model
from sglang_admin.model.loader import load_model_info


def _digests(path: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return ensure_default_model(str(tmp_path_factory.mktemp("cache")))


def test_build_is_deterministic(default_dir: str, tmp_path: os.PathLike) -> None:
    other = ensure_default_model(str(tmp_path))
    assert other == os.path.join(str(tmp_path), DEFAULT_MODEL_DIRNAME)
    assert _digests(other) == _digests(default_dir)
    assert set(_digests(other)) == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json",
    }


def test_cached_after_first_build(default_dir: str) -> None:
    mtime = os.path.getmtime(os.path.join(default_dir, "model.safetensors"))
    assert ensure_default_model(os.path.dirname(default_dir)) == default_dir
    assert os.path.getmtime(os.path.join(default_dir, "model.safetensors")) == mtime


def test_env_cache_dir_and_concurrent_builders(
    tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_ADMIN_CACHE_DIR", str(tmp_path))
    results: list[str] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ensure_default_model())
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [os.path.join(str(tmp_path), DEFAULT_MODEL_DIRNAME)] * 3
    assert os.listdir(str(tmp_path)) == [DEFAULT_MODEL_DIRNAME]  # no temp dirs left over


def test_info(default_dir: str) -> None:
    info = load_model_info(default_dir)
    assert info.architectures == ["LlamaForCausalLM"]
    assert info.context_length >= 4096
    assert info.tokenizer_path == default_dir
    assert len(info.eos_token_ids) == 2
    # the embedded model's special ids (its bytes take 0-255)
    assert (info.bos_token_id, info.pad_token_id, sorted(info.eos_token_ids)) == (256, 260, [257, 259])


def test_loads_with_transformers_and_tokenizers(default_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(default_dir)
    info = load_model_info(default_dir)
    assert len(tok) == info.vocab_size
    assert tok.eos_token_id in info.eos_token_ids
    assert tok.pad_token_id == info.pad_token_id
    text = "Hello, wörld! 你好"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    raw = Tokenizer.from_file(os.path.join(default_dir, "tokenizer.json"))
    assert raw.encode(text).ids == ids
    assert raw.encode("<|im_end|>").ids == [tok.convert_tokens_to_ids("<|im_end|>")]

    model = transformers.AutoModelForCausalLM.from_pretrained(default_dir)
    assert model.config.max_position_embeddings >= 4096
    assert model.config.vocab_size == len(tok)


def test_greedy_output_is_varied(default_dir: str) -> None:
    from sglang_admin.messages import SamplingParams
    from sglang_admin.model.runner import ModelRunner, SeqInput

    runner = ModelRunner(default_dir, device="cpu", max_total_tokens=512,
                         max_running_requests=2)
    outputs = []
    for text in ("Hello world", "The quick brown fox"):
        runner.reset()
        prompt = list(text.encode())
        out: list[int] = []
        slots = iter(range(1, 513))
        seq = SeqInput(0, 0, prompt, 0, [next(slots) for _ in prompt], SamplingParams(),
                       prompt, out)
        for _ in range(32):
            (res,) = runner.forward_step([seq])
            assert res is not None
            out.append(res.token_id)
            pos = len(prompt) + len(out) - 1
            seq = SeqInput(0, pos, [res.token_id], pos, [next(slots)], SamplingParams(),
                           prompt, out)
        outputs.append(out)
        assert len(set(out)) >= 12, out
    assert outputs[0] != outputs[1]
