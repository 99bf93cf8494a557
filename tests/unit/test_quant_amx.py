"""The AMX kernel for batched steps on kept int4 weights and int8-block LM heads
(model/quant/amx.py, csrc/quant_amx.c): its layout holds each code where the kernel reads
it, it multiplies exactly the dense bfloat16 copy's weights and computes what the dense GEMM
computes at the rows it serves, an int8 head's logits come out in float32 as stored, other
rows keep their paths, and a CPU without AMX keeps the dense copy (the detector
monkeypatched)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_admin.model.quant import amx
from sglang_admin.model.quant import linear as linear_mod
from sglang_admin.model.quant.gguf_blocks import Int4Groups, Int8Blocks
from sglang_admin.model.quant.linear import QuantLinear, refined_logits
from sglang_admin.model.quant.store import QuantStore

needs_kernel = pytest.mark.skipif(amx.amx_kernel() is None,
                                  reason="no AMX-BF16 kernel on this CPU")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SGLANG_ADMIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _weight(rng: np.random.Generator, n: int, k: int) -> Int4Groups:
    return Int4Groups(rng.integers(0, 16, (n, k)).astype(np.uint8),
                      rng.uniform(0.001, 0.1, (n, k // 32)).astype(np.float32),
                      rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float32))


def _dense(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The dense copy's matmul (what batched rows took before the kernel)."""
    if layer._dense_packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, layer._dense_packed, None, "none", [], "")
    assert layer.dense is not None
    return torch.nn.functional.linear(x, layer.dense)


def test_the_detector_reads_the_flags() -> None:
    flags = {"avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert amx.cpu_has_amx_kernel(frozenset(flags | {"avx2"}))
    assert not amx.cpu_has_amx_kernel(frozenset(flags - {"amx_bf16"}))
    assert not amx.cpu_has_amx_kernel(frozenset(flags - {"avx512_bf16"}))
    assert not amx.cpu_has_amx_kernel(frozenset({"avx2", "fma"}))
    assert amx.shape_applies(32, 64, 32) and not amx.shape_applies(40, 64, 32)
    assert not amx.shape_applies(32, 48, 32) and not amx.shape_applies(32, 64, 64)


def test_the_layout_puts_each_code_where_the_kernel_reads_it() -> None:
    """Unpacked by the layout's documented rules (no kernel): codes, scales and zeros."""
    rng = np.random.default_rng(0)
    n, k = 32, 96
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    scale = torch.rand(n, k // 32).to(torch.bfloat16).float()
    zero = torch.randn(n, k // 32).to(torch.bfloat16).float()
    codes, sz = amx.pack_int4(q, scale, zero)
    assert tuple(codes.shape) == (2, 3, 16, 16) and tuple(sz.shape) == (2, 3, 2, 16)
    for row in (0, 7, 15, 16, 31):
        b, j = divmod(row, 16)
        for kk in (0, 1, 2, 31, 32, 63, 95):
            g, within = divmod(kk, 32)
            r, odd = divmod(within, 2)
            lane = 2 * j + odd
            byte = int(codes[b, g, r, lane % 16])
            assert (byte >> (4 * (lane // 16))) & 15 == q[row, kk], (row, kk)
        assert sz[b, 2, 0, j].float() == scale[row, 2]
        assert sz[b, 2, 1, j].float() == zero[row, 2]
    q8 = rng.integers(-128, 128, (n, k)).astype(np.int8)
    d = rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float32)
    codes8, d8 = amx.pack_int8(q8, d)
    assert tuple(codes8.shape) == (2, 3, 16, 32) and tuple(d8.shape) == (2, 3, 16)
    for row, kk in ((0, 0), (3, 9), (17, 40), (31, 95)):
        b, j = divmod(row, 16)
        g, within = divmod(kk, 32)
        r, odd = divmod(within, 2)
        assert int(codes8[b, g, r, 2 * j + odd]) == q8[row, kk]
        assert float(d8[b, g, j]) == d[row, g]


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
def test_the_kernel_multiplies_the_dense_copys_weights(seed: int) -> None:
    """Fuzz: random shapes and rows across the kernel's range (off the 16-row blocks, past
    one 48-row pass): its weights (the kernel on the identity) are the dense copy's bit for
    bit, and its outputs the dense GEMM's to a bfloat16 rounding."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 8)) * 16, int(rng.integers(1, 12)) * 32
    layer = QuantLinear(_weight(rng, n, k), torch.bfloat16)
    assert layer._amx is not None and layer.amx_codes is not None
    eye = torch.eye(k, dtype=torch.bfloat16)
    got_w = torch.cat([layer(eye[i:i + amx.MAX_ROWS]) for i in range(0, k, amx.MAX_ROWS)])
    assert torch.equal(got_w.t(), layer.dequantized())
    for rows in (amx.MIN_ROWS, int(rng.integers(amx.MIN_ROWS, amx.MAX_ROWS + 1)),
                 amx.MAX_ROWS):
        x = (torch.randn(rows, k) * float(rng.uniform(0.1, 10))).to(torch.bfloat16)
        got, theirs = layer(x), _dense(layer, x)
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == (rows, n)
        ref = x.float() @ layer.dequantized().float().t()
        tol = 1e-2 * (ref.abs().max().item() + 1e-3)
        assert (got.float() - theirs.float()).abs().max().item() <= tol
        assert (got.float() - ref).abs().max().item() <= tol
    bias = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(amx.MIN_ROWS, k).to(torch.bfloat16)
    assert torch.equal(layer(x, bias), layer(x) + bias)


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_an_int8_head_gives_float32_logits_as_stored(seed: int) -> None:
    """Q8_0 blocks at the kernel's rows: float32 logits of the stored values to float32
    rounding, so the store does not refine them (and the greedy token is the exact one);
    fewer rows keep torch's halves, refined."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 20)) * 16, int(rng.integers(1, 10)) * 32
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)
    d = rng.uniform(1e-4, 0.05, (n, k // 32)).astype(np.float16).astype(np.float32)
    head = QuantLinear(Int8Blocks(q, d), torch.bfloat16, keep_rows=True)
    assert head._amx is not None and head.amx_codes is not None
    w = (torch.from_numpy(q).double().view(n, -1, 32)
         * torch.from_numpy(d).double()[..., None]).view(n, k)
    store = QuantStore("test")
    placeholder = torch.empty(n, k)
    store.add(placeholder, head)
    for rows in (amx.MIN_ROWS, int(rng.integers(amx.MIN_ROWS, amx.MAX_ROWS + 1)),
                 amx.MAX_ROWS):
        x = (torch.randn(rows, k) * 3).to(torch.bfloat16)
        ref = x.double() @ w.t()
        exact = head.exact_logits(x)
        assert exact is not None and exact.dtype == torch.float32
        assert (exact.double() - ref).abs().max().item() <= 1e-5 * (ref.abs().max().item() + 1)
        assert torch.equal(store.logits(x, placeholder, None), exact)  # type: ignore[arg-type]
        assert torch.equal(exact.argmax(1), ref.argmax(1))
    x = torch.randn(amx.MIN_ROWS - 1, k).to(torch.bfloat16)
    assert amx.MIN_ROWS - 1 > linear_mod.GEMV_MAX_ROWS and head.exact_logits(x) is None
    served = store.logits(x, placeholder, None)  # type: ignore[arg-type]
    assert torch.equal(served, refined_logits(head, x, head._int4(x)))
    # the head's bfloat16 matmul (not its logits) keeps its paths at the kernel's rows
    x = torch.randn(amx.MIN_ROWS, k).to(torch.bfloat16)
    assert torch.equal(head(x), head._int4(x))
    x = torch.randn(linear_mod.KERNEL_MAX_ROWS + 1, k).to(torch.bfloat16)
    assert torch.equal(head(x), _dense(head, x))


@needs_kernel
def test_rows_outside_its_range_keep_their_paths() -> None:
    rng = np.random.default_rng(3)
    layer = QuantLinear(_weight(rng, 48, 64), torch.bfloat16)
    few = torch.randn(amx.MIN_ROWS - 1, 64).to(torch.bfloat16)
    assert torch.equal(layer(few), layer._int4(few))  # torch's int4 kernel
    many = torch.randn(amx.MAX_ROWS + 1, 64).to(torch.bfloat16)
    assert torch.equal(layer(many), _dense(layer, many))  # the dense copy (prefill)
    assert layer.nbytes > QuantLinear(_weight(rng, 48, 64), torch.bfloat16,
                                      dense_copy=False).nbytes
    # float32 models and weights off the tile's shape: no layout
    assert QuantLinear(_weight(rng, 48, 64), torch.float32).amx_codes is None
    assert QuantLinear(_weight(rng, 40, 64), torch.bfloat16).amx_codes is None


def test_a_cpu_without_amx_keeps_the_dense_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amx, "cpu_has_amx_kernel", lambda flags=None: False)
    assert amx.amx_kernel() is None
    rng = np.random.default_rng(4)
    layer = QuantLinear(_weight(rng, 48, 64), torch.bfloat16)
    assert layer._amx is None and layer.amx_codes is None
    x = torch.randn(32, 64).to(torch.bfloat16)
    assert torch.equal(layer(x), _dense(layer, x))
    head = QuantLinear(Int8Blocks(rng.integers(-128, 128, (48, 64)).astype(np.int8),
                                  np.full((48, 2), 0.01, np.float32)),
                       torch.bfloat16, keep_rows=True)
    assert head._amx is None and head.exact_logits(x) is None  # refined as before


@needs_kernel
def test_a_prepared_file_follows_whether_the_kernel_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prepared projections (model/quant/prepared.py) say whether they hold the AMX
    layouts: written with them, prepared again where AMX does not serve (and back); a
    batched decode computes the same tokens either way."""
    pytest.importorskip("gguf", reason="the gguf package is not installed")
    from sglang_admin.model.gguf import resolve_model_path
    from sglang_admin.model.quant.prepared import load_prepared, prepared_path
    from sglang_admin.model.runner import ModelRunner
    from tests.gguf_models import write_gguf
    from tests.unit.test_model_runner import Req, simulate

    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", arch="llama", qtype="Q4_1",
                                            tied=True, seed=5)))

    def runner() -> ModelRunner:
        return ModelRunner(out, device="cpu", dtype="bfloat16", max_total_tokens=1024,
                           max_running_requests=12, quantization="gguf")

    reqs = [Req(list(range(5 + i, 12 + 2 * i))) for i in range(12)]  # 12-row decode steps
    first = runner()
    assert Path(prepared_path(out, torch.bfloat16)).is_file()
    assert any(getattr(p, "amx_codes", None) is not None
               for p in first.model.quant.projections())
    want = [r.out for r in simulate(first, reqs, 5)]
    restored = runner()  # read back from the prepared file: the layouts and the kernel
    assert any(getattr(p, "_amx", None) is not None for p in restored.model.quant.projections())
    assert [r.out for r in simulate(restored, [Req(list(r.prompt)) for r in reqs], 5)] == want
    with monkeypatch.context() as m:
        m.setattr(amx, "cpu_has_amx_kernel", lambda flags=None: False)
        assert load_prepared(out, torch.bfloat16) is None  # holds the layouts: not for it
        other = runner()
        assert all(getattr(p, "amx_codes", None) is None
                   for p in other.model.quant.projections())
        got = [r.out for r in simulate(other, [Req(list(r.prompt)) for r in reqs], 5)]
        assert got == want  # the same weights and, at these shapes, the same sums
        assert load_prepared(out, torch.bfloat16) is not None  # written for this CPU
    assert load_prepared(out, torch.bfloat16) is None  # and prepared again with the kernel
