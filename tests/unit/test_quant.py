"""GGUF weights kept quantized (model/quant/): the repacked blocks stand for the stored
values, the served model computes what the dequantized load computes (float32: to rounding;
bfloat16: the same greedy tokens on the tiny models), and the paths around the weights
(GetWeightsByName, refits, refusals) behave as docs/gguf.md says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

from sglang_admin.messages import SamplingParams  # noqa: E402
from sglang_admin.model.gguf import resolve_model_path  # noqa: E402
from sglang_admin.model.loader import ModelLoadError, WeightMismatch, load_weights  # noqa: E402
from sglang_admin.model.quant.flags import served_quantization  # noqa: E402
from sglang_admin.model.quant.gguf_blocks import (  # noqa: E402
    Int4Groups,
    Int8Blocks,
    dequantize_int4,
    dequantize_int8_blocks,
    int4_groups,
    int8_blocks,
    int8_rows,
    nibble_halves,
    plan_for,
)
from sglang_admin.model.quant.linear import KERNEL_MAX_ROWS, QuantLinear  # noqa: E402
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.model.step_io import SeqInput  # noqa: E402
from sglang_admin.model.weights import (  # noqa: E402
    RefitError,
    refit_from_disk,
    weight_values,
    weights_digest,
)
from tests.gguf_models import random_q4_k, write_gguf  # noqa: E402
from tests.unit.test_model_runner import Req, simulate  # noqa: E402


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SGLANG_ADMIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _runner(path: str, dtype: str, quantized: bool) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=1024,
                       max_running_requests=8, quantization="gguf" if quantized else "")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_groups_stand_for_the_stored_values(qtype: str) -> None:
    from gguf import quants

    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    raw = quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(48, 128)
    groups = int4_groups(raw, qtype, 48, 128)
    assert groups.q.max() <= 15
    np.testing.assert_array_equal(dequantize_int4(groups), ref)


def test_q8_0_blocks_and_their_nibble_halves_stand_for_the_stored_values() -> None:
    from gguf import quants

    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 96)).astype(np.float32) * rng.uniform(0.01, 3, (40, 1))
    w[0, :32] = 0  # an all-zero block
    raw = quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(40, 96)
    blocks = int8_blocks(raw, 40, 96)
    np.testing.assert_array_equal(dequantize_int8_blocks(blocks), ref)
    halves = nibble_halves(blocks)
    assert halves.q.max() <= 15 and halves.q.shape == (40, 192)
    h = dequantize_int4(halves)
    np.testing.assert_allclose(h[:, :96] + h[:, 96:], ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("qtype", "rel"), [("Q4_K", 0.12), ("Q6_K", 0.03)])
def test_k_quant_writers_write_what_the_gguf_reader_reads(qtype: str, rel: float) -> None:
    """model/quant/kquants.py (the quality tool's Q4_K / Q6_K inputs): the blocks read back
    by the gguf package near the values written, and Q4_K read by ours alike."""
    from gguf import quants

    from sglang_admin.model.quant.kquants import quantize_q4_k, quantize_q6_k

    rng = np.random.default_rng(4)
    w = rng.standard_normal((6, 512)).astype(np.float32) * rng.uniform(0.01, 1, (6, 1))
    raw = (quantize_q4_k if qtype == "Q4_K" else quantize_q6_k)(w)
    back = quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(6, 512)
    err = np.sqrt(((back - w) ** 2).mean(axis=1)) / w.std(axis=1)
    assert err.max() < rel, err
    if qtype == "Q4_K":
        np.testing.assert_allclose(dequantize_int4(int4_groups(raw, "Q4_K", 6, 512)), back,
                                   rtol=1e-5, atol=1e-6)


def test_q4_k_sub_blocks_stand_for_the_stored_values() -> None:
    blocks, ref = random_q4_k(8, 512, np.random.default_rng(2))
    np.testing.assert_allclose(dequantize_int4(int4_groups(blocks, "Q4_K", 8, 512)), ref,
                               rtol=1e-6, atol=1e-6)


def test_plans_name_what_is_kept() -> None:
    assert [plan_for(t) for t in ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K", "Q5_0", "F16")] == [
        "int4", "int4", "int4", "int8x32", "int8", "dense", "dense"]


@pytest.mark.parametrize("seed", range(6))
def test_quant_linear_matches_its_dequantized_weight_at_any_rows(seed: int) -> None:
    """Fuzz: random shapes, the three kinds, rows on both sides of the kernel switch,
    float32 and bfloat16; the kernel and the dense copy multiply with ``dequantized()``."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 100)), int(rng.integers(1, 9)) * 32
    values = rng.standard_normal((n, k)).astype(np.float32)
    if seed % 3 == 1:
        weight = int8_rows(values)
    elif seed % 3 == 2:
        weight = Int8Blocks(rng.integers(-128, 128, (n, k)).astype(np.int8),
                            rng.uniform(1e-4, 0.05, (n, k // 32)).astype(np.float32))
    else:
        weight = Int4Groups(rng.integers(0, 16, (n, k)).astype(np.uint8),
                            rng.uniform(0.001, 0.1, (n, k // 32)).astype(np.float32),
                            rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float32))
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        layer = QuantLinear(weight, dtype)
        dense = layer.dequantized().float()
        if isinstance(weight, Int4Groups) and dtype == torch.float32:
            torch.testing.assert_close(dense, torch.from_numpy(dequantize_int4(weight)))
        if isinstance(weight, Int8Blocks) and dtype == torch.float32:
            torch.testing.assert_close(dense, torch.from_numpy(dequantize_int8_blocks(weight)))
        for rows in (1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40):
            x = torch.randn(rows, k, dtype=dtype)
            bias = torch.randn(n, dtype=dtype)
            got = layer(x, bias).float()
            ref = x.float() @ dense.t() + bias.float()
            scale = ref.abs().max().item() + 1
            assert (got - ref).abs().max().item() <= tol * scale, (rows, dtype)
        # without a dense copy every step takes the kernel (float32 too, where a layer with
        # a copy does not: kernel_rows)
        bare = QuantLinear(weight, dtype, dense_copy=False)
        # the values read back from the dense copy are the quantized ones, bit for bit
        assert layer.dense_is_values and not bare.dense_is_values
        assert torch.equal(layer.dequantized(), bare.dequantized())
        x = torch.randn(3, k, dtype=dtype)
        ref = x.float() @ dense.t()
        assert (bare(x).float() - ref).abs().max().item() <= tol * (ref.abs().max().item() + 1)


def _logprobs(runner: ModelRunner, ids: list[int], decode: bool) -> torch.Tensor:
    """Logprobs of each next prompt token: one decode step each (``decode``, the kernel's
    rows), or one prefill (the dense copy's)."""
    greedy = SamplingParams(temperature=0.0)
    slots = list(range(1, len(ids) + 1))
    if not decode:
        seq = SeqInput(0, 0, ids, 0, slots, greedy, ids, [], logprob_start_len=0)
        out = runner.forward_step([seq])[0]
        assert out is not None and out.input_logprobs is not None
        return torch.tensor([lp for _, lp, _ in out.input_logprobs[1:]])
    values = []
    for t in range(len(ids) - 1):
        seq = SeqInput(0, t, [ids[t]], 0, slots if t == 0 else [], greedy, ids[:1],
                       ids[1:t + 1], return_logprob=True, token_ids_logprob=[ids[t + 1]])
        out = runner.forward_step([seq])[0]
        assert out is not None and out.token_ids_logprobs
        values.append(out.token_ids_logprobs[0][1])
    return torch.tensor(values)


CASES = [("llama", "Q4_0", False), ("llama", "Q4_1", True), ("llama", "Q8_0", False),
         ("llama", "Q4_K", False), ("qwen2", "Q4_1", False), ("llama", "Q5_0", False)]


@pytest.mark.parametrize(("arch", "qtype", "tied"), CASES,
                         ids=[f"{a}-{q}-{'tied' if t else 'untied'}" for a, q, t in CASES])
def test_kept_model_computes_what_the_dequantized_load_computes(
        tmp_path: Path, arch: str, qtype: str, tied: bool) -> None:
    path = write_gguf(tmp_path / f"{arch}-{qtype}.gguf", arch=arch, qtype=qtype, tied=tied,
                      seed=11)
    out = resolve_model_path(str(path))
    ref = _runner(out, "float32", quantized=False)
    kept32 = _runner(out, "float32", quantized=True)
    summary = kept32.model.quant.summary
    assert f"{qtype}->{plan_for(qtype)}" in summary
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, ref.info.vocab_size, (24,), generator=g).tolist()
    exact = plan_for(qtype) != "int8"  # int8 (Q6_K): requantized per row, its own rounding
    for decode in (True, False):
        want = _logprobs(ref, ids, decode)
        got = _logprobs(kept32, ids, decode)
        assert (got - want).abs().max().item() < (1e-3 if exact else 5e-2), decode
    # bfloat16 activations (the default for kept weights): the same greedy tokens
    kept16 = _runner(out, "auto", quantized=True)
    assert kept16.dtype == torch.bfloat16 or not torch.backends.mkldnn.is_available()
    prompts = [ids[:5], ids[:19]]
    want_tokens = [r.out for r in simulate(ref, [Req(p) for p in prompts], 6)]
    if exact:
        assert [r.out for r in simulate(kept32, [Req(p) for p in prompts], 6)] == want_tokens
    bf16_tokens = [r.out for r in simulate(kept16, [Req(p) for p in prompts], 6)]
    agree = sum(a == b for x, y in zip(bf16_tokens, want_tokens) for a, b in zip(x, y))
    assert agree >= 9, (bf16_tokens, want_tokens)  # of 12; random tiny models have near-ties


def test_weights_by_name_give_the_dequantized_view_and_writes_are_refused(
        tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", qtype="Q4_0", seed=4)
    out = resolve_model_path(str(path))
    ref = _runner(out, "float32", quantized=False)
    kept = _runner(out, "float32", quantized=True)
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        shape, values = weight_values(kept.model, name, 50)
        want_shape, want = weight_values(ref.model, name, 50)
        assert shape == want_shape
        np.testing.assert_allclose(values, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(WeightMismatch, match="kept quantized"):
        load_weights(kept.model, [("model.layers.0.mlp.up_proj.weight",
                                   torch.zeros(128, 64))])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_kept_weights_are_released_and_reloaded_from_the_gguf_file(tmp_path: Path,
                                                                   tied: bool) -> None:
    """ReleaseMemoryOccupation of weights kept quantized frees the kept projections too (no
    reference to them is left), and the reload after resume computes what it computed."""
    import gc
    import weakref

    from sglang_admin.model.weights import reload_weights

    path = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", qtype="Q4_1", seed=6,
                                             tied=tied)))
    kept = _runner(path, "float32", quantized=True)
    ids = list(range(5, 25))
    before = _logprobs(kept, ids, True)
    projections = kept.model.quant.projections()
    assert projections
    alive = [weakref.ref(p) for p in projections]
    del projections
    assert kept.release_weights() == kept.weight_bytes
    gc.collect()
    assert kept.weights_released
    assert [r for r in alive if r() is not None] == [], "a kept projection outlived the release"
    kept.resume_weights()
    reload_weights(kept.model, path)
    assert kept.model.quant.projections()
    assert (_logprobs(kept, ids, True) - before).abs().max().item() < 1e-6
    # weights quantized at load are still refused, with the way out named
    online = ModelRunner(resolve_model_path(str(write_gguf(tmp_path / "o.gguf", qtype="F32",
                                                           seed=6))),
                         device="cpu", dtype="float32", max_total_tokens=1024,
                         max_running_requests=8, quantization="int8wo")
    with pytest.raises(ModelLoadError, match="--torchao-config int8wo"):
        online.release_weights()


def test_refit_from_another_gguf_file_and_refusals(tmp_path: Path) -> None:
    first = resolve_model_path(str(write_gguf(tmp_path / "a.gguf", qtype="Q4_0", seed=1)))
    second = resolve_model_path(str(write_gguf(tmp_path / "b.gguf", qtype="Q8_0",
                                               seed=2)))
    kept = _runner(first, "float32", quantized=True)
    fresh_second = _runner(second, "float32", quantized=True)
    ids = list(range(5, 25))
    before = _logprobs(kept, ids, True)
    refit_from_disk(kept.model, second, first)
    assert "Q8_0->int8" in kept.model.quant.summary
    got, want = _logprobs(kept, ids, True), _logprobs(fresh_second, ids, True)
    assert (got - want).abs().max().item() < 1e-5  # as a fresh start on that file
    assert (got - before).abs().max().item() > 1e-2  # and other weights than before
    # a safetensors directory cannot replace weights kept quantized: nothing changes
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in Path(second).iterdir():
        if f.name != "source.json":
            (plain / f.name).symlink_to(f)
    with pytest.raises(RefitError, match="takes a GGUF file") as info:
        refit_from_disk(kept.model, str(plain), second)
    assert info.value.restored
    assert (_logprobs(kept, ids, True) - got).abs().max().item() == 0


def test_served_quantization_decides_from_the_path_and_flags(tmp_path: Path) -> None:
    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", qtype="Q4_1")))
    assert served_quantization(out, None, False) == "gguf"
    assert served_quantization(out, "gguf", False) == "gguf"
    assert served_quantization(out, None, True) == ""
    assert served_quantization(out, None, False, "cuda") == ""
    assert served_quantization(None, None, False) == ""
    with pytest.raises(ValueError, match="contradict"):
        served_quantization(out, "gguf", True)
    with pytest.raises(ValueError, match="needs a GGUF model"):
        served_quantization(None, "gguf", False)
    with pytest.raises(ValueError, match="CPU only"):
        served_quantization(out, "gguf", False, "cuda")


def test_int4_quantize_stays_within_half_a_step() -> None:
    from sglang_admin.model.quant.gguf_blocks import int4_quantize

    rng = np.random.default_rng(7)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    for group in (32, 64, 128, 256):
        q = int4_quantize(w, group)
        step = np.repeat(q.scale, group, axis=1)
        assert (np.abs(dequantize_int4(q) - w) <= step / 2 + 1e-6).all(), group


@pytest.mark.parametrize("scheme", ["int8wo", "int4wo-32", "int4wo-64"])
def test_torchao_config_quantizes_a_checkpoint_at_load(scheme: str) -> None:
    """The embedded model (a dense checkpoint) quantized at load: its projections are
    served by the store and compute what the dense model computes with the quantized
    values (the embedded model's random weights say nothing of the quantization's own
    error: tools/quant_quality.py measures that on a real model)."""
    from sglang_admin.model.default_model import ensure_default_model

    path = ensure_default_model()
    dense = _runner(path, "float32", quantized=False)
    kept = ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=1024,
                       max_running_requests=8, quantization=scheme)
    store = kept.model.quant
    assert store is not None and store.scheme == scheme and "dense" in store.summary
    assert kept.weight_bytes > 0
    load_weights(dense.model, [(name, store.dequantized(name)) for name in store.by_name])
    ids = list(range(10, 40))
    for decode in (True, False):
        diff = (_logprobs(kept, ids, decode) - _logprobs(dense, ids, decode)).abs().max()
        assert diff.item() < 1e-3, decode
    with pytest.raises(RefitError, match="not refit yet") as info:
        refit_from_disk(kept.model, path, path)
    assert info.value.restored


def test_torchao_config_flags() -> None:
    assert served_quantization(None, None, False, "cpu", "int8wo") == "int8wo"
    with pytest.raises(ValueError, match="contradict"):
        served_quantization(None, "gguf", False, "cpu", "int8wo")
    with pytest.raises(ValueError, match="CPU only"):
        served_quantization(None, None, False, "cuda", "int4wo-128")


def test_where_quantized_weights_are_refused_each_says_why() -> None:
    from sglang_admin.model.quant.attach import check_applies

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    check_applies("gguf", cpu, torch.bfloat16)  # the served case
    cases = [
        (("gguf", cuda, torch.bfloat16), "CPU only.*--gguf-dequantize"),
        (("int8wo", cuda, torch.float32), "CPU only.*without --torchao-config"),
        (("gguf", cpu, torch.float16), "bfloat16 or float32"),
        (("int3wo", cpu, torch.float32), "not supported"),
    ]
    for args, words in cases:
        with pytest.raises(ModelLoadError, match=words):
            check_applies(*args)


@pytest.mark.parametrize("kind", ["int8", "int8x32", "int4"])
def test_a_quantized_heads_top_logits_are_refined_in_float32(kind: str) -> None:
    from sglang_admin.model.quant.linear import refined_logits

    rng = np.random.default_rng(5)
    values = rng.standard_normal((300, 64)).astype(np.float32)
    if kind == "int8":
        head = QuantLinear(int8_rows(values), torch.bfloat16)
        weight = head.q8.float() * head.row_scale_f32[:, None]
    elif kind == "int4":
        groups = Int4Groups(rng.integers(0, 16, (300, 64)).astype(np.uint8),
                            rng.uniform(0.01, 0.3, (300, 2)).astype(np.float32),
                            rng.uniform(-0.1, 0.1, (300, 2)).astype(np.float32))
        head = QuantLinear(groups, torch.bfloat16, dense_copy=False, keep_rows=True)
        weight = torch.from_numpy(dequantize_int4(groups))
    else:
        blocks = Int8Blocks(rng.integers(-127, 128, (300, 64)).astype(np.int8),
                            rng.uniform(0.001, 0.03, (300, 2)).astype(np.float32))
        head = QuantLinear(blocks, torch.bfloat16, dense_copy=False, keep_rows=True)
        weight = torch.from_numpy(dequantize_int8_blocks(blocks))
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32) * 4).to(torch.bfloat16)
    exact = x.float() @ weight.t()
    served = head(x)
    got = refined_logits(head, x, served)
    assert got.dtype == torch.float32
    # the rows refined are the served logits' top 8 (the exact top 8 may differ at the 8th
    # place by a bfloat16 near tie)
    top = served.float().topk(8, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))


PREPARED = [("llama", "Q4_1", True, None), ("qwen2", "Q8_0", False, None),
            ("llama", "Q6_K", False, None), ("llama", "Q4_0", False, "F16"),
            ("llama", "Q4_1", False, "Q8_0")]


@pytest.mark.parametrize(("arch", "qtype", "tied", "v_qtype"), PREPARED)
def test_a_second_start_reads_the_prepared_projections_and_computes_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        arch: str, qtype: str, tied: bool, v_qtype: str | None) -> None:
    """The first start repacks the file and saves the result beside its conversion; the next
    start reads that instead of the GGUF file, with the same logprobs to the bit (batch-1
    kernel rows and the dense copy's); a damaged file is repacked and written again. q/k/v
    of mixed types (``v_qtype``) are parts run side by side (ConcatLinear)."""
    from sglang_admin.model.quant import gguf_load
    from sglang_admin.model.quant.prepared import prepared_path

    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", arch=arch, qtype=qtype,
                                            tied=tied, seed=5, v_qtype=v_qtype)))
    saved = Path(prepared_path(out, torch.bfloat16))
    assert not saved.exists()
    first = _runner(out, "bfloat16", quantized=True)
    assert saved.is_file()
    kinds = {type(p).__name__ for p in first.model.quant.projections()}
    assert ("ConcatLinear" in kinds) == (v_qtype is not None), kinds
    ids = list(range(5, 21))
    want = [_logprobs(first, ids, decode) for decode in (True, False)]

    def no_repack(*args: object, **kwargs: object) -> None:
        raise AssertionError("repacked from the GGUF file although prepared")

    with monkeypatch.context() as m:
        m.setattr(gguf_load, "read_projections", no_repack)
        second = _runner(out, "bfloat16", quantized=True)
    assert second.model.quant.summary == first.model.quant.summary
    assert second.model.quant.nbytes == first.model.quant.nbytes
    # the digest (a release's record of what resume must restore) reads the same values
    assert weights_digest(second.model) == weights_digest(first.model)
    head = second.model.quant.tied_head  # its dense copy is the embedding, not its values
    assert head is None or not head.dense_is_values
    for decode, w in zip((True, False), want):
        assert torch.equal(_logprobs(second, ids, decode), w)
    saved.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    third = _runner(out, "bfloat16", quantized=True)
    assert "cannot be read" in caplog.text
    assert torch.equal(_logprobs(third, ids, True), want[0])
    with monkeypatch.context() as m:
        m.setattr(gguf_load, "read_projections", no_repack)
        _runner(out, "bfloat16", quantized=True)  # written again, whole
