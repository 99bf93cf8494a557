"""GGUF loading (model/gguf.py): small files written with the gguf package, loaded by us and
by transformers (``gguf_file=``), must give the same weights and the same greedy tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package is not installed")
transformers = pytest.importorskip("transformers")

from sglang_admin.model.gguf import (  # noqa: E402
    GgufError,
    find_gguf,
    open_gguf,
    resolve_model_path,
)
from sglang_admin.model.gguf_tokenizer import byte_alphabet  # noqa: E402
from sglang_admin.model.loader import iter_checkpoint  # noqa: E402
from tests.gguf_models import (  # noqa: E402
    QUANT_TYPES,
    argmax_tokens,
    pack_q4_k,
    q4_k_reference,
    write_gguf,
)
from tests.unit.test_model_runner import Req, _runner, simulate  # noqa: E402

MAX_NEW = 8
# (architecture, general.name, quant type, tied embeddings)
CASES = [("llama", "tiny", q, False) for q in QUANT_TYPES] + [
    ("llama", "tiny", "Q8_0", True),
    ("llama", "mistral-tiny", "Q4_0", True),
    ("qwen2", "tiny", "F16", False),
    ("qwen2", "tiny", "Q5_0", True),
    ("qwen3", "tiny", "BF16", False),
    ("qwen3", "tiny", "Q4_K", True),
]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SGLANG_ADMIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def hf_from_gguf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_q4_k_blocks_dequantize_to_their_reference() -> None:
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(3)
    n = 6
    d, dmin = rng.uniform(-0.1, 0.1, n), rng.uniform(-0.1, 0.1, n)
    sc = rng.integers(0, 64, (n, 8)).astype(np.uint16)  # every bit of the 6-bit fields
    m = rng.integers(0, 64, (n, 8)).astype(np.uint16)
    q = rng.integers(0, 16, (n, 256)).astype(np.uint16)
    blocks = pack_q4_k(d, dmin, sc, m, q)
    got = quants.dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(n, 256)
    np.testing.assert_allclose(got, q4_k_reference(d, dmin, sc, m, q), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("arch", "name", "qtype", "tied"), CASES,
                         ids=[f"{a}-{n}-{q}-{'tied' if t else 'untied'}" for a, n, q, t in CASES])
def test_weights_and_greedy_tokens_match_transformers(
    tmp_path: Path, arch: str, name: str, qtype: str, tied: bool
) -> None:
    path = write_gguf(tmp_path / f"{arch}-{qtype}.gguf", arch=arch, qtype=qtype, tied=tied,
                      name=name, seed=len(qtype) + 7 * tied)
    out = resolve_model_path(str(path))
    config = json.loads(Path(out, "config.json").read_text())
    expected_arch = {"llama": "MistralForCausalLM" if "mistral" in name else "LlamaForCausalLM",
                     "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert config["architectures"] == [expected_arch]
    assert config["tie_word_embeddings"] is tied
    assert config["gguf_weight_type"] == qtype  # what --dtype auto reads (cpu_dtype.py)

    ref = hf_from_gguf(path)
    theirs = ref.state_dict()
    ours = dict(iter_checkpoint(out))
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if tied else set())
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key  # names, permutation, dequantization

    runner = _runner(out)
    vocab = runner.info.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 19)]
    reqs = simulate(runner, [Req(p) for p in prompts], MAX_NEW)
    for r in reqs:
        assert r.out == argmax_tokens(ref, r.prompt, MAX_NEW)


def test_tokenizer_and_chat_template_match_transformers(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tok.gguf")
    out = resolve_model_path(str(path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = transformers.AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "the cat sat on the wall"}]
    text = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
    for sample in (text, "there in the ape  wc\n\n x", "naïve 日本"):
        assert ours(sample)["input_ids"] == theirs(sample)["input_ids"], sample
    assert ours.encode("<|im_start|>")[0] == 1  # a control token stays whole
    cfg = json.loads(Path(out, "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert set(byte_alphabet().values()) <= set(ours.get_vocab())


def test_second_resolve_uses_the_cache_and_a_changed_file_is_converted_again(
    tmp_path: Path, cache_dir: Path
) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    lines: list[str] = []
    first = resolve_model_path(str(path), progress=lines.append)
    assert len(lines) == 1 and "converting" in lines[0]
    assert resolve_model_path(str(tmp_path), progress=lines.append) == first  # the directory
    assert len(lines) == 1  # no second conversion
    write_gguf(path, seed=99)
    os.utime(path, ns=(1, 1))
    assert resolve_model_path(str(path), progress=lines.append) != first
    assert len(lines) == 2


def test_starts_at_once_convert_a_file_once(tmp_path: Path, cache_dir: Path) -> None:
    """Workers started together (a PD pair, data-parallel ranks, test processes) convert a
    new file once: the others wait on the lock beside it and take the result."""
    import concurrent.futures as cf

    path = write_gguf(tmp_path / "m.gguf")
    lines: list[str] = []
    with cf.ThreadPoolExecutor(3) as pool:
        dirs = list(pool.map(lambda _: resolve_model_path(str(path), progress=lines.append),
                             range(3)))
    assert len(set(dirs)) == 1 and os.path.isfile(os.path.join(dirs[0], "config.json"))
    assert len(lines) == 1 and "converting" in lines[0], lines


def test_starts_at_once_prepare_kept_projections_once(tmp_path: Path) -> None:
    """The same for the repacked projections of weights kept quantized: one rank builds
    them, the others read what it saved."""
    import concurrent.futures as cf
    import threading
    import time

    from sglang_admin.model.quant.gguf_blocks import int4_quantize
    from sglang_admin.model.quant.linear import QuantLinear
    from sglang_admin.model.quant.prepared import Prepared, prepared_once

    weight = int4_quantize(np.random.default_rng(0).standard_normal((32, 64)), 32)
    builds: list[QuantLinear] = []
    lock = threading.Lock()

    def build() -> Prepared:
        p = Prepared(summary="one projection")
        p.projections[("w",)] = QuantLinear(weight, torch.bfloat16)
        with lock:
            builds.append(p.projections[("w",)])
        time.sleep(0.3)  # the others arrive while it builds
        return p

    with cf.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda _: prepared_once(str(tmp_path), torch.bfloat16, build),
                            range(3)))
    assert len(builds) == 1
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    outs = [p.projections[("w",)](x) for p in got]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], builds[0](x))
    # the builder too serves what it saved, read from the file as the others do (the
    # built tensors are heap memory that a weight release could not all hand back)
    assert all(p.projections[("w",)] is not builds[0] for p in got)
    assert all(p.summary == "one projection" for p in got)


def test_hf_directories_pass_through(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(str(tmp_path)) is None
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(GgufError, match="no .gguf file"):
        resolve_model_path(str(tmp_path), "gguf")


def test_truncated_file_is_refused(tmp_path: Path, cache_dir: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", qtype="Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GgufError, match="truncated") as err:
        resolve_model_path(str(path))
    assert err.value.code == "INVALID_ARGUMENT"
    assert not cache_dir.exists() or not [p for p in (cache_dir / "gguf").iterdir()
                                          if not p.name.startswith(".")]


def test_unsupported_architecture_quant_type_and_missing_tokenizer(tmp_path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(GgufError, match="unsupported architecture 'gpt2'") as err:
        open_gguf(str(tmp_path / "gpt2.gguf"))
    assert err.value.code == "FAILED_PRECONDITION"

    w = gguf.GGUFWriter(str(tmp_path / "i8.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.int8))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(GgufError, match="quant type I8"):
        open_gguf(str(tmp_path / "i8.gguf"))

    path = write_gguf(tmp_path / "notok.gguf", tokenizer=False)
    with pytest.raises(GgufError, match="no tokenizer") as err:
        resolve_model_path(str(path))
    assert err.value.code == "FAILED_PRECONDITION"


def test_model_path_names(tmp_path: Path) -> None:
    from sglang_admin.cli import served_model_path

    assert served_model_path(None) is None and served_model_path("toy") is None
    with pytest.raises(ValueError, match="no such file or directory"):
        served_model_path(str(tmp_path / "nope"))
    path = write_gguf(tmp_path / "m.gguf")
    out = served_model_path(str(path))
    assert out is not None and os.path.isfile(os.path.join(out, "config.json"))
    assert served_model_path(str(tmp_path), "gguf") == out
    with pytest.raises(ValueError, match="no .gguf file"):
        served_model_path(out, "gguf")


@pytest.mark.parametrize(("flags", "want"), [
    (frozenset({"avx512f", "avx512_bf16", "amx_bf16"}), "bfloat16"),  # native bfloat16
    (frozenset({"avx2", "avx512f", "avx512bw"}), "float32"),  # it would be emulated
], ids=["native-bf16", "emulated-bf16"])
def test_dtype_auto_serves_a_quantized_gguf_as_the_cpu_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    flags: frozenset[str], want: str,
) -> None:
    """The runner as `make serve` builds it (--dtype auto) on a Q4_1 file: bfloat16 where the
    CPU has native bfloat16, float32 elsewhere; the start line says which and why."""
    import logging

    from sglang_admin.model import cpu_dtype
    from sglang_admin.model.runner import ModelRunner

    if want == "bfloat16" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    out = resolve_model_path(str(write_gguf(tmp_path / "q.gguf", qtype="Q4_1", seed=3)))
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": flags)
    with caplog.at_level(logging.INFO, logger="sglang_admin.model.runner"):
        runner = ModelRunner(out, device="cpu", dtype="auto", max_total_tokens=256,
                             max_running_requests=2)
    assert runner.dtype == getattr(torch, want) and runner.info.dtype == want
    lines = [r.getMessage() for r in caplog.records if " loaded: " in r.getMessage()]
    why = "and a CPU with native bfloat16" if want == "bfloat16" else "would be emulated"
    assert len(lines) == 1 and f"loaded: {want} on cpu (--dtype auto: Q4_1 GGUF weights" in lines[0]
    assert why in lines[0], lines[0]
    reqs = simulate(runner, [Req([5, 6, 7, 8])], 4)  # and it serves
    assert len(reqs[0].out) == 4

