"""The few-row kernel on kept int4 / int8-block weights (model/quant/gemv.py,
csrc/quant_gemv.c): its layouts hold the codes where the kernel reads them, it computes
what torch's int4 kernel and the dequantized weights compute (bfloat16 rows), the LM head's
logits come out in float32 as stored, and a CPU without its instructions keeps torch's
kernels (the detector monkeypatched both ways)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_admin.model.quant import gemv
from sglang_admin.model.quant import linear as linear_mod
from sglang_admin.model.quant.gguf_blocks import Int4Groups, Int8Blocks
from sglang_admin.model.quant.linear import QuantLinear, refined_logits
from sglang_admin.model.quant.store import QuantStore

needs_kernel = pytest.mark.skipif(gemv.gemv_kernel() is None,
                                  reason="no AVX512_VNNI + AVX512_BF16 kernel on this CPU")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SGLANG_ADMIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_detector_reads_the_flags() -> None:
    assert gemv.cpu_has_gemv_kernel(frozenset({"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni",
                                           "avx2"}))
    assert not gemv.cpu_has_gemv_kernel(frozenset({"avx512f", "avx512bw", "avx512_vnni", "avx2"}))
    assert not gemv.cpu_has_gemv_kernel(frozenset({"avx512f", "avx512bw", "avx512_bf16"}))
    assert not gemv.cpu_has_gemv_kernel(frozenset())


def test_layouts_put_each_code_where_the_kernel_reads_it() -> None:
    """Unpacked by the layouts' documented rules (no kernel): the codes, scales and zeros
    come back in place, padded rows zero."""
    rng = np.random.default_rng(0)
    n, k = 21, 64
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    scale = torch.rand(n, k // 32).to(torch.bfloat16).float()
    zero = torch.randn(n, k // 32).to(torch.bfloat16).float()
    w, sz = gemv.pack_int4(q, scale, zero)
    assert tuple(w.shape) == (2, k // 8, 64) and tuple(sz.shape) == (2, k // 32, 2, 16)
    for row in (0, 5, 15, 16, 20):
        b, j = divmod(row, 16)
        for kk in (0, 1, 3, 4, 7, 8, 33, 63):
            c, r = divmod(kk, 8)
            half, i = divmod(r, 4)
            assert (int(w[b, c, 4 * j + i]) >> (4 * half)) & 15 == q[row, kk], (row, kk)
        assert sz[b, 1, 0, j].float() == scale[row, 1]
        assert sz[b, 1, 1, j].float() == zero[row, 1]
    assert torch.all(sz[1, :, :, 5:] == 0)  # rows 21..31: padding
    q8 = rng.integers(-128, 128, (n, k)).astype(np.int8)
    d = rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float16).astype(np.float32)
    packed = gemv.pack_int8(q8, d)
    assert packed is not None
    w8, d8 = packed
    assert tuple(w8.shape) == (2, k // 4, 64) and d8.dtype == torch.float16
    for row, kk in ((0, 0), (3, 9), (17, 40), (20, 63)):
        b, j = divmod(row, 16)
        c, i = divmod(kk, 4)
        assert int(w8[b, c, 4 * j + i]) - 128 == q8[row, kk]
        assert float(d8[b, kk // 32, j]) == d[row, kk // 32]
    d[2, 1] = 1e-9  # not a float16 value: no layout (torch's kernel serves that weight)
    assert gemv.pack_int8(q8, d) is None


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
def test_the_kernel_computes_what_torchs_int4_kernel_computes(seed: int) -> None:
    """Fuzz: random shapes (rows off the block of 16), the same bfloat16 scales and zeros;
    outputs within a bfloat16 rounding of torch's kernel and of the dequantized weights."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 90)), int(rng.integers(1, 12)) * 32
    weight = Int4Groups(rng.integers(0, 16, (n, k)).astype(np.uint8),
                        rng.uniform(0.001, 0.1, (n, k // 32)).astype(np.float32),
                        rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float32))
    layer = QuantLinear(weight, torch.bfloat16, dense_copy=False)
    assert layer.gemv_w is not None
    x = (torch.randn(1, k) * float(rng.uniform(0.1, 10))).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (1, n)
    theirs = layer._int4(x).float()
    ref = x.float() @ layer.dequantized().float().t()
    tol = 1e-2 * (ref.abs().max().item() + 1e-3)
    assert (got.float() - theirs).abs().max().item() <= tol
    assert (got.float() - ref).abs().max().item() <= tol


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_an_int8_head_gives_float32_logits_as_stored(seed: int) -> None:
    """Q8_0 blocks (float16 scales): the kernel's float32 logits are the stored weights'
    to float32 rounding, so the store does not refine them; torch's path (the nibble
    halves, bfloat16 out) stays within bfloat16 rounding and is refined as before."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 300)), int(rng.integers(1, 10)) * 32
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)
    d = rng.uniform(1e-4, 0.05, (n, k // 32)).astype(np.float16).astype(np.float32)
    head = QuantLinear(Int8Blocks(q, d), torch.bfloat16, dense_copy=False, keep_rows=True)
    x = (torch.randn(1, k) * 3).to(torch.bfloat16)
    ref = (x.double() @ (torch.from_numpy(q).double().view(n, -1, 32)
                          * torch.from_numpy(d).double()[..., None]).view(n, k).t())
    exact = head.exact_logits(x)
    assert exact is not None and exact.dtype == torch.float32
    assert (exact.double() - ref).abs().max().item() <= 1e-5 * (ref.abs().max().item() + 1)
    store = QuantStore("test")
    placeholder = torch.empty(n, k)
    store.add(placeholder, head)
    assert torch.equal(store.logits(x, placeholder, None), exact)  # type: ignore[arg-type]
    # more rows than the kernel takes: torch's halves, refined
    x2 = torch.cat([x] * (linear_mod.GEMV_MAX_ROWS + 1))
    served = store.logits(x2, placeholder, None)  # type: ignore[arg-type]
    assert torch.equal(served, refined_logits(head, x2, head._int4(x2)))
    assert served[0].argmax() == exact[0].argmax()


def test_a_cpu_without_the_instructions_keeps_torchs_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv, "cpu_has_gemv_kernel", lambda flags=None: False)
    assert gemv.gemv_kernel() is None
    rng = np.random.default_rng(4)
    weight = Int4Groups(rng.integers(0, 16, (40, 64)).astype(np.uint8),
                        rng.uniform(0.001, 0.1, (40, 2)).astype(np.float32),
                        rng.uniform(-0.1, 0.1, (40, 2)).astype(np.float32))
    layer = QuantLinear(weight, torch.bfloat16, dense_copy=False)
    assert layer.gemv_w is None and layer._gemv_call is None
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert torch.equal(layer(x), layer._int4(x))
    head = QuantLinear(Int8Blocks(rng.integers(-128, 128, (40, 64)).astype(np.int8),
                                  np.full((40, 2), 0.01, np.float32)),
                       torch.bfloat16, dense_copy=False, keep_rows=True)
    assert head.gemv_w is None and head.exact_logits(x) is None
    assert layer.quantized_bytes() == (layer.packed.numel()  # type: ignore[union-attr]
                                       + 2 * layer.scales_zeros.numel())  # type: ignore[union-attr]


@needs_kernel
def test_float32_weights_and_wide_batches_never_take_the_kernel() -> None:
    rng = np.random.default_rng(5)
    weight = Int4Groups(rng.integers(0, 16, (24, 64)).astype(np.uint8),
                        rng.uniform(0.001, 0.1, (24, 2)).astype(np.float32),
                        rng.uniform(-0.1, 0.1, (24, 2)).astype(np.float32))
    assert QuantLinear(weight, torch.float32, dense_copy=False).gemv_w is None
    layer = QuantLinear(weight, torch.bfloat16, dense_copy=False)
    x = torch.randn(linear_mod.GEMV_MAX_ROWS + 1, 64).to(torch.bfloat16)
    assert torch.equal(layer(x), layer._int4(x))  # torch's kernel above GEMV_MAX_ROWS
    assert gemv.shape_applies(64, 32) and not gemv.shape_applies(64, 64)
    assert not gemv.shape_applies(48, 32)


@needs_kernel
def test_a_prepared_file_follows_whether_the_kernel_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prepared projections (model/quant/prepared.py) say whether they hold the
    kernel's layouts: a file written with them is prepared again where the kernel does not
    serve (and back), and a model without them still computes its tokens."""
    pytest.importorskip("gguf", reason="the gguf package is not installed")
    from sglang_admin.model.gguf import resolve_model_path
    from sglang_admin.model.quant.prepared import load_prepared, prepared_path
    from sglang_admin.model.runner import ModelRunner
    from tests.gguf_models import write_gguf
    from tests.unit.test_model_runner import Req, simulate

    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", arch="llama", qtype="Q4_1",
                                            tied=True, seed=5)))

    def runner() -> ModelRunner:
        return ModelRunner(out, device="cpu", dtype="bfloat16", max_total_tokens=256,
                           max_running_requests=2, quantization="gguf")

    first = runner()
    assert Path(prepared_path(out, torch.bfloat16)).is_file()
    assert any(getattr(p, "gemv_w", None) is not None for p in first.model.quant.projections())
    want = [r.out for r in simulate(first, [Req(list(range(5, 12)))], 5)]
    with monkeypatch.context() as m:
        m.setattr(gemv, "cpu_has_gemv_kernel", lambda flags=None: False)
        assert load_prepared(out, torch.bfloat16) is None  # holds the layouts: not for it
        other = runner()
        assert all(getattr(p, "gemv_w", None) is None for p in other.model.quant.projections())
        got = [r.out for r in simulate(other, [Req(list(range(5, 12)))], 5)]
        assert sum(a == b for a, b in zip(got[0], want[0])) >= 4  # near-ties aside
        assert load_prepared(out, torch.bfloat16) is not None  # written for this CPU
    assert load_prepared(out, torch.bfloat16) is None  # and prepared again with the kernel
