"""The CPU kernels (model/cpu_kernels.py) against torch, and the runner's choice of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_admin.messages import SamplingParams
from sglang_admin.model import cpu_kernels, cpu_kernels_build, extend_batch
from sglang_admin.model.attention import AttentionMetadata, choice
from sglang_admin.model.config import LlamaConfig
from sglang_admin.model.cpu_features import cpu_flags
from sglang_admin.model.cpu_kernels_build import load_cpu_kernels, reference_attend
from sglang_admin.model.decode_batch import DecodeBatch
from sglang_admin.model.llama import DecoderLayer
from sglang_admin.model.loader import ModelLoadError
from sglang_admin.model.rotary import RotaryEmbedding, apply_rope
from sglang_admin.model.runner import ModelRunner, SeqInput

kernel = load_cpu_kernels()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler builds the kernel here")


def test_the_kernels_build_and_agree_with_torch_where_there_is_a_compiler() -> None:
    """Every kernel test below skips without the kernels; with a compiler they must load (a
    kernel that disagrees with torch at load time is dropped, which would hide it)."""
    import shutil

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    assert kernel is not None


def _case(heads: int, kv_heads: int, dim: int, lens: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lens) + 3
    slots = 1 + len(lens) * width
    k = torch.randn(slots, kv_heads, dim, generator=gen)
    v = torch.randn(slots, kv_heads, dim, generator=gen)
    # scattered slots, as a pool hands them out after some traffic
    table = (1 + torch.randperm(slots - 1, generator=gen)[: len(lens) * width]).view(len(lens), width)
    rows = torch.randperm(len(lens), generator=gen)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    return q, k, v, table.contiguous(), rows, torch.tensor(lens)


@needs_kernel
@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(8, 2, 32), (14, 2, 64), (4, 4, 128), (6, 3, 16), (3, 1, 12), (16, 8, 128),
     (9, 3, 64), (7, 1, 32), (5, 1, 64)],  # groups of 3, 7, 5: SmolLM2's, Qwen's
)
@pytest.mark.parametrize("window", [None, 1, 7, 300])
def test_kernel_matches_torch(heads: int, kv_heads: int, dim: int, window: int | None) -> None:
    """Vector (D % 8 == 0, any group: 4 query heads at a time, then the rest) and plain paths,
    GQA and MHA, windows shorter and longer than the sequences, a sequence of one token."""
    lens = [1, 2, 9, 33, 100, 257]
    q, k, v, table, rows, lens_t = _case(heads, kv_heads, dim, lens)
    scores = torch.empty(heads * max(lens))
    got = kernel.attend(q, k, v, table, rows, lens_t, dim**-0.5, window, scores)
    want = reference_attend(q, k, v, table, rows, lens_t, dim**-0.5, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_kernel_reads_strided_queries_and_large_scores() -> None:
    """q as the runner hands it (a view of the rotated q and k heads) and scores far apart
    (the softmax subtracts the row's maximum: no overflow)."""
    lens = [5, 64]
    q, k, v, table, rows, lens_t = _case(8, 2, 32, lens, seed=3)
    qk = torch.cat([q * 40, torch.zeros(2, 2, 32)], dim=1)  # [n, H + KV, D]
    q_view = qk[:, :8]
    assert not q_view.is_contiguous()
    got = kernel.attend(q_view, k, v, table, rows, lens_t, 0.2, None, torch.empty(8 * 64))
    want = reference_attend(q_view.contiguous(), k, v, table, rows, lens_t, 0.2, None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_kernel_refuses_unexpected_layouts() -> None:
    q, k, v, table, rows, lens_t = _case(8, 2, 32, [4])
    with pytest.raises(ValueError, match="laid out"):
        kernel.attend(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, table, rows,
                      lens_t, 0.2, None, torch.empty(64))


@needs_kernel
@pytest.mark.parametrize(("prefix", "n", "heads", "kv_heads", "dim", "window"), [
    (0, 2, 8, 2, 32, None), (0, 5, 8, 2, 32, None), (0, 16, 8, 2, 32, None),
    (0, 17, 8, 2, 32, 3), (0, 100, 14, 2, 64, None), (0, 37, 7, 7, 32, None),
    (0, 200, 6, 2, 128, 50), (0, 64, 4, 1, 64, 64), (0, 300, 8, 2, 32, 299),
    (960, 64, 8, 2, 32, None), (5, 1, 8, 2, 32, None), (33, 40, 14, 2, 64, 20),
    (100, 3, 5, 5, 32, 101),
])
def test_prefill_kernel_matches_torch(prefix: int, n: int, heads: int, kv_heads: int, dim: int,
                                      window: int | None) -> None:
    """A prefill chunk's causal attention, keys and values read from the pool through scattered
    slots: with and without a cached prefix, query-head groups of 1 to 7 (the 4-head score
    blocks and their remainders), lengths on and off the 16-key blocks, windows shorter and
    longer than the sequence; q as the layer hands it (a view with a token stride of its own),
    scores far apart."""
    gen = torch.Generator().manual_seed(prefix + n)
    length = prefix + n
    k_pool = torch.randn(length + 9, kv_heads, dim, generator=gen)
    v_pool = torch.randn(length + 9, kv_heads, dim, generator=gen)
    slots = torch.randperm(length + 9, generator=gen)[:length]
    q = (torch.randn(n, heads + 2 * kv_heads, dim, generator=gen) * 6)[:, :heads]
    assert kernel.extend_applies(dim)
    got = kernel.extend_attend(q, k_pool, v_pool, slots, prefix, dim**-0.5, window)
    assert torch.isfinite(got).all()
    want = cpu_kernels_build.reference_extend(q, k_pool, v_pool, slots, prefix, dim**-0.5, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_prefill_kernel_leaves_what_it_does_not_cover_to_torch() -> None:
    """No fast path for a head size off 32 (the runner then keeps torch's attention, and a
    call is refused); layouts it cannot read are refused."""
    assert not kernel.extend_applies(24)
    pool = torch.randn(40, 2, 24)
    with pytest.raises(ValueError, match="no fast path"):
        kernel.extend_attend(torch.randn(8, 8, 24), pool, pool, torch.arange(8), 0, 0.2, None)
    pool = torch.randn(40, 2, 32)
    q = torch.randn(8, 8, 32)
    for bad in ((q.transpose(1, 2).contiguous().transpose(1, 2), torch.arange(8), 0),
                (q, torch.arange(9), 0),  # slots of 9 positions for a prefix of 0 + 8
                (q, torch.arange(8, dtype=torch.int32), 0)):
        with pytest.raises(ValueError, match="laid out"):
            kernel.extend_attend(bad[0], pool, pool, bad[1], bad[2], 0.2, None)


def _check_elementwise(kernels: cpu_kernels.CpuKernels) -> None:
    gen = torch.Generator().manual_seed(7)
    for rows, width in [(1, 256), (64, 256), (3, 21), (2048, 64), (5, 7)]:
        x = torch.randn(rows, width, generator=gen) * 30
        w = torch.randn(width, generator=gen)
        torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), F.rms_norm(x, (width,), w, 1e-6),
                                   atol=1e-5, rtol=1e-5)
        gate_up = torch.randn(rows, 2 * width, generator=gen) * 12  # exp overflows past 88
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up,
                                   atol=1e-5, rtol=1e-5)
    for tokens, heads, dim in [(1, 10, 32), (64, 10, 32), (5, 3, 6), (2048, 4, 128)]:
        qkv = torch.randn(tokens, heads + 2, dim, generator=gen)
        x = qkv[:, :heads]  # the q and k heads of a fused row: a token stride of its own
        cos, sin = (torch.randn(tokens, 1, dim, generator=gen) for _ in range(2))
        # the same float ops in the same order: equal to the last bit
        assert torch.equal(kernels.rope(x, cos, sin), apply_rope(x, cos, sin))
    heads = torch.randn(4, 3, 32, generator=gen)  # [T, heads, D]: q/k norms of Qwen3
    w = torch.randn(32, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(heads, w, 1e-6), F.rms_norm(heads, (32,), w, 1e-6),
                               atol=1e-5, rtol=1e-5)
    # projections: row counts around the 3-row blocks and the 16-row panels (12: one padded
    # panel; 17 and 24: a panel, then row blocks; 25: a padded last panel), widths off the
    # 8-float vector and the 4-row and 12-row weight blocks, with and without a bias
    for rows in (1, 2, 3, 4, 5, 7, 12, 17, 24, 25, 64):
        for n, k in ((384, 256), (261, 256), (5, 21), (46, 36), (256, 688)):
            x = torch.randn(rows, k, generator=gen)
            w = torch.randn(n, k, generator=gen)
            b = torch.randn(n, generator=gen)
            torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b),
                                       atol=1e-4, rtol=1e-4)


def _check_decode_layer(kernels: cpu_kernels.CpuKernels, window: int | None) -> None:
    """A decoder layer through ``decode_layer`` (one call) against the same layer through torch's
    ops (attention through the attend kernel, checked against torch above): the output, and the
    new K/V rows in the pool. A Qwen2-like layer (q/k/v biases), hidden and intermediate sizes
    off the vector width, GQA, sequences of 1 to 15 tokens around a sliding window."""
    cfg = LlamaConfig(architecture="Qwen2ForCausalLM", model_type="qwen2", vocab_size=50,
                      hidden_size=46, intermediate_size=36, num_layers=1, num_heads=6,
                      num_kv_heads=2, head_dim=8, qkv_bias=True, sliding_windows=[window])
    torch.manual_seed(11)
    layer = DecoderLayer(cfg, 0)
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data.uniform_(0.5, 1.5)
    layer.self_attn.fuse()
    layer.mlp.fuse()
    gen = torch.Generator().manual_seed(12)
    # 4 sequences: the row-block path of the projections; 21: a packed panel, then row
    # blocks; 27: two panels, the last padded
    for count in (4, 21, 27):
        lens = torch.cat([torch.tensor([1, 7, 15]), torch.randint(1, 16, (count - 3,),
                                                                   generator=gen)])
        table = (1 + torch.randperm(count * 20, generator=gen)).view(count, 20).contiguous()
        rows = torch.randperm(count, generator=gen)
        out_slots = table[rows, lens - 1].contiguous()
        k_pool = torch.randn(count * 20 + 1, 2, 8, generator=gen)
        v_pool = torch.randn(count * 20 + 1, 2, 8, generator=gen)
        x = torch.randn(count, 46, generator=gen) * 3
        _compare_decode_layer(kernels, layer, cfg, x, lens, table, rows, out_slots, k_pool,
                              v_pool)
    layer.mlp.lora = object()  # LoRA, q/k norms, unfused weights: torch's path
    assert layer.decode_weights() is None


def _compare_decode_layer(kernels: cpu_kernels.CpuKernels, layer: DecoderLayer, cfg: LlamaConfig,
                          x: torch.Tensor, lens: torch.Tensor, table: torch.Tensor,
                          rows: torch.Tensor, out_slots: torch.Tensor, k_pool: torch.Tensor,
                          v_pool: torch.Tensor) -> None:
    count = x.shape[0]
    cos, sin = RotaryEmbedding(cfg)(lens - 1, torch.float32)
    batch = DecodeBatch(kernels, table, rows, lens, int(lens.max()), torch.empty(6 * 15))
    meta = AttentionMetadata(out_slots=out_slots, num_decode=count, decode_batch=batch)
    for module in layer.modules():  # torch's ops, but the attend kernel (tested above)
        if hasattr(module, "kernels"):
            module.kernels = None

    k_want, v_want = k_pool.clone(), v_pool.clone()
    with torch.inference_mode():
        want = layer(x, cos, sin, meta, k_want, v_want)
        for module in layer.modules():  # what LlamaForCausalLM.use_cpu_kernels does
            if hasattr(module, "kernels"):
                module.kernels = kernels
        weights = layer.decode_weights()
        assert weights is not None
        got = x.clone()
        kernels.decode_layer(got, weights, cos, sin, k_pool, v_pool, out_slots, batch)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_pool, k_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_pool, v_want, atol=1e-5, rtol=1e-5)
    small = DecodeBatch(kernels, table, rows, lens, int(lens.max()), torch.empty(6 * 14))
    with pytest.raises(ValueError, match="scores scratch"):  # never written past its end
        kernels.decode_layer(x.clone(), weights, cos, sin, k_pool, v_pool, out_slots, small)


@needs_kernel
def test_elementwise_kernels_match_torch() -> None:
    """RMSNorm, RoPE, silu(gate) * up and projections: widths on and off the vector width,
    large values."""
    _check_elementwise(kernel)
    with pytest.raises(ValueError, match="laid out"):
        kernel.rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="laid out"):
        kernel.silu_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="laid out"):
        kernel.linear(torch.randn(4, 8), torch.randn(8, 5))


@needs_kernel
def test_linear_writes_a_column_slice_of_a_wider_output() -> None:
    """The LM head cut among lane threads: each part written into its columns of the logits,
    the rest of the tensor untouched."""
    x, w = torch.randn(20, 24), torch.randn(50, 24)
    out = torch.full((20, 70), 7.0)
    kernel.linear(x, w[10:40].contiguous(), out=out[:, 5:35])
    torch.testing.assert_close(out[:, 5:35], F.linear(x, w[10:40]), atol=1e-5, rtol=1e-4)
    assert (out[:, :5] == 7.0).all() and (out[:, 35:] == 7.0).all()
    with pytest.raises(ValueError, match="out"):
        kernel.linear(x, w, out=torch.empty(20, 49))


@needs_kernel
@pytest.mark.parametrize("window", [None, 5])
def test_decode_layer_matches_the_torch_layer(window: int | None) -> None:
    _check_decode_layer(kernel, window)


def test_processes_building_at_once_compile_once(tmp_path, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    """Builds of one library started at once (a worker's ranks, a test run's processes)
    take turns: the compiler runs once and every caller gets the one file it built."""
    import concurrent.futures as cf
    import shutil
    import subprocess
    import threading
    import time

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = tmp_path / "tiny.c"
    source.write_text("int tiny(void) { return 7; }\n")
    monkeypatch.setattr(cpu_kernels_build, "_cache_dir", lambda: tmp_path / "kernels")
    runs: list[int] = []
    lock = threading.Lock()
    real_run = subprocess.run

    def counted_run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with lock:
            runs.append(1)
        time.sleep(0.3)  # the others arrive while it compiles
        return real_run(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels_build.subprocess, "run", counted_run)
    with cf.ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: cpu_kernels_build._compile(cc, ["-O1"], [],
                                                                    source=source), range(3)))
    assert len(runs) == 1
    assert paths[0] is not None and len(set(paths)) == 1
    import ctypes

    assert ctypes.CDLL(paths[0]).tiny() == 7


def test_plain_c_build_matches_torch() -> None:
    """The build for machines without AVX2 (no intrinsics, no libmvec) computes the same."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    path = cpu_kernels_build._compile(cc, *cpu_kernels_build._FLAG_SETS[-1])
    assert path is not None
    plain = cpu_kernels.CpuKernels(path)
    for heads, kv_heads, dim in [(8, 2, 32), (16, 8, 128), (3, 1, 12)]:
        lens = [1, 17, 64]
        q, k, v, table, rows, lens_t = _case(heads, kv_heads, dim, lens, seed=5)
        got = plain.attend(q, k, v, table, rows, lens_t, 0.3, 9, torch.empty(heads * 64))
        want = reference_attend(q, k, v, table, rows, lens_t, 0.3, 9)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    _check_elementwise(plain)
    _check_decode_layer(plain, 5)
    _check_argmax(plain)
    assert cpu_kernels_build._bf16_agrees_with_torch(plain)  # bfloat16's scalar loops too
    assert not plain.extend_applies(32)  # no prefill kernel without AVX2: torch's attention
    pool = torch.randn(20, 2, 32)
    with pytest.raises(ValueError, match="no fast path"):
        plain.extend_attend(torch.randn(9, 8, 32), pool, pool, torch.arange(9), 0, 0.2, None)


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill then decode a batch, one table row per prompt; the tokens each one produced."""
    greedy = SamplingParams(temperature=0.0)
    slot = 1
    seqs: list[SeqInput] = []
    for i, prompt in enumerate(prompts):
        slots = list(range(slot, slot + len(prompt) + steps))
        slot += len(slots)
        seqs.append(SeqInput(i, 0, prompt, 0, slots, greedy, prompt, []))
    outs = [[r.token_id] for r in runner.forward_step(seqs)]
    for step in range(1, steps):
        seqs = [SeqInput(i, len(p) + step - 1, [out[-1]], 0, [], greedy, p, out)
                for i, (p, out) in enumerate(zip(prompts, outs))]
        for out, r in zip(outs, runner.forward_step(seqs)):
            out.append(r.token_id)
    return outs


@needs_kernel
def test_runner_decodes_the_same_with_and_without_the_kernel() -> None:
    """The default model on CPU: greedy tokens through the kernels (prefill attention too)
    equal torch's ops."""
    prompts = [[5, 9, 13, 200, 7], list(range(40, 90)), [1]]
    fast = ModelRunner(None, device="cpu", dtype="float32", max_total_tokens=512,
                       max_running_requests=4)
    slow = ModelRunner(None, device="cpu", dtype="float32", max_total_tokens=512,
                       max_running_requests=4, attention_backend="torch_native")
    assert fast.cpu_kernels is not None and slow.cpu_kernels is None
    assert _greedy(fast, prompts, 12) == _greedy(slow, prompts, 12)


@needs_kernel
def test_bfloat16_prefill_attention_takes_torchs_flash_attention_where_the_cpu_has_amx() -> None:
    """bfloat16 chunks: the flash kernel without AMX tiles or where it runs on them, torch's
    SDPA where only torch does; float32 chunks up to EXTEND_MAX_TOKENS go to the kernel
    either way."""
    limit = choice.EXTEND_MAX_TOKENS
    for n in (1, 64, 2048):
        assert choice.extend_kernel_takes(BF16, 0, n, tile_matmul=False)
        assert not choice.extend_kernel_takes(BF16, 512, n, tile_matmul=True)
        # the kernel on the tiles itself: every chunk
        assert choice.extend_kernel_takes(BF16, 512, n, tile_matmul=True, kernel_tiles=True)
    assert not choice.extend_kernel_takes(BF16, 0, 0, tile_matmul=False)
    assert not choice.extend_kernel_takes(BF16, 0, 0, tile_matmul=True, kernel_tiles=True)
    for tiles in (False, True):
        assert choice.extend_kernel_takes(torch.float32, 0, limit, tile_matmul=tiles)
        assert not choice.extend_kernel_takes(torch.float32, 0, limit + 1, tile_matmul=tiles)
    assert choice.cpu_has_tile_matmul() == ("amx_bf16" in cpu_flags())


def _spy_extend_attend(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record (new tokens, prefix) of every ``CpuKernels.extend_attend`` call from now on, and
    of each sequence of every bfloat16 batched call (model/extend_batch.py)."""
    calls: list[tuple[int, int]] = []
    real = cpu_kernels.CpuKernels.extend_attend

    def spy(self, q, k_cache, v_cache, slots, prefix, scale, window):  # noqa: ANN001, ANN202
        calls.append((q.shape[0], prefix))
        return real(self, q, k_cache, v_cache, slots, prefix, scale, window)

    monkeypatch.setattr(cpu_kernels.CpuKernels, "extend_attend", spy)
    real_batch = extend_batch.ExtendBatch.attend

    def spy_batch(self, q, k_cache, v_cache, scale, window, out):  # noqa: ANN001, ANN202
        calls.extend((int(n), int(p)) for _, n, p, _ in self.seqs.tolist())
        return real_batch(self, q, k_cache, v_cache, scale, window, out)

    monkeypatch.setattr(extend_batch.ExtendBatch, "attend", spy_batch)
    return calls


def test_runner_sends_prefill_chunks_to_the_kernel_where_it_is_faster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of up to EXTEND_MAX_TOKENS new tokens go through the prefill kernel when torch
    runs one thread (a cached prefix too); longer chunks, torch on several threads (its
    attention spreads over them, the kernel does not) or a build without the kernel, through
    torch's attention."""
    calls = _spy_extend_attend(monkeypatch)
    runner = ModelRunner(None, device="cpu", dtype="float32", max_total_tokens=4096,
                         max_running_requests=4)
    layers = runner.model.config.num_layers
    long = choice.EXTEND_MAX_TOKENS + 1
    greedy = SamplingParams(temperature=0.0)
    before = torch.get_num_threads()
    try:
        for threads, want in ((1, [(5, 0), (3, 5)]), (2, [])):
            torch.set_num_threads(threads)
            runner.reset()
            calls.clear()
            prompt = list(range(3, 11))
            runner.forward_step([  # a 5-token chunk and a chunk too long for the kernel
                SeqInput(0, 0, prompt[:5], 0, [1, 2, 3, 4, 5], greedy, prompt, [], False),
                SeqInput(1, 0, [7] * long, 0, list(range(10, 10 + long)), greedy, [7] * long,
                         []),
            ])
            runner.forward_step([  # the rest of the first prompt, after its cached 5
                SeqInput(0, 5, prompt[5:], 5, [6, 7, 8], greedy, prompt, []),
            ])
            assert calls == [c for c in want for _ in range(layers)]
        # a build or head size without the kernel: torch's attention for every chunk
        monkeypatch.setattr(cpu_kernels.CpuKernels, "extend_applies",
                            lambda self, dim, dtype=torch.float32: False)
        torch.set_num_threads(1)
        plain = ModelRunner(None, device="cpu", dtype="float32", max_total_tokens=4096,
                            max_running_requests=4)
        calls.clear()
        plain.forward_step([SeqInput(0, 0, prompt[:5], 0, [1, 2, 3, 4, 5], greedy, prompt, [])])
        assert calls == []
    finally:
        torch.set_num_threads(before)


def test_cpu_paged_refuses_to_start_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sglang_admin.model.runner.load_cpu_kernels", lambda: None)
    with pytest.raises(ModelLoadError, match="cpu_paged"):
        ModelRunner(None, device="cpu", dtype="float32", max_total_tokens=64,
                    max_running_requests=2, attention_backend="cpu_paged")
    auto = ModelRunner(None, device="cpu", dtype="float32", max_total_tokens=64,
                       max_running_requests=2)
    assert auto.cpu_kernels is None  # auto falls back to torch


def test_build_without_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No compiler at all: no kernel, no exception (the runner keeps torch's path)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SGLANG_ADMIN_CACHE_DIR", str(tmp_path))
    cpu_kernels_build.load_cpu_kernels.cache_clear()
    try:
        assert cpu_kernels_build.load_cpu_kernels() is None
    finally:
        cpu_kernels_build.load_cpu_kernels.cache_clear()


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="attention backend"):
        ModelRunner(None, device="cpu", dtype="float32", max_total_tokens=64,
                    max_running_requests=2, attention_backend="flash")


@needs_kernel
def test_bench_cpu_kernels_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """tools/bench_cpu_kernels.py (docs/benchmarks.md's kernel figures) runs and prints both
    sides of every row. No decode warm-up (``--warm-tokens 0``: 8 steps per runner, the
    prompts' prefill and a few decodes, against 48 by default): the figures are not read."""
    from tools.bench_cpu_kernels import main

    torch_threads = torch.get_num_threads()
    try:
        assert main(["--steps", "1", "--rounds", "1", "--warm-tokens", "0"]) == 0
    finally:
        torch.set_num_threads(torch_threads)
    out = capsys.readouterr().out
    for row in ("      64 ", "rms_norm", "rope", "silu*up", "rows=64"):
        assert row in out
    assert out.count("x\n") >= 13  # 3 decode rows, 6 op rows, 4 projection rows, each a ratio



def _check_argmax(kernels: cpu_kernels.CpuKernels) -> None:
    """The greedy token of every row, as torch.argmax: the first of equal maxima, a NaN wins,
    at widths on and off the vector width."""
    for cols in (1, 7, 8, 15, 16, 17, 63, 64, 65, 200, 261, 1000):
        gen = torch.Generator().manual_seed(cols)
        x = torch.randn(12, cols, generator=gen)
        x[1] = float("-inf")  # a row with nothing allowed: index 0, as torch
        x[2, cols // 2] = x[2, cols - 1] = 50.0  # a tie
        x[3, cols - 1] = float("nan")  # a NaN at the end (past the vector part)
        x[4, 0] = float("nan")
        x[5, min(3, cols - 1)] = float("nan")  # a NaN in the first vector
        x[6, cols // 2] = float("inf")
        x[7] = 1.0  # all equal
        x[8, (cols * 2) // 3] = float("nan")  # a NaN inside the vector part
        x[9, cols // 3] = x[9, (cols * 3) // 4] = 40.0  # a tie across lanes and blocks
        x[10, 17 % cols] = x[10, 33 % cols] = 45.0  # a tie between two running maxima
        assert kernels.argmax(x) == x.argmax(dim=-1).tolist(), cols
    assert kernels.argmax(torch.empty(0, 5)) == []


@needs_kernel
def test_argmax_is_torchs_including_ties_infinities_and_nans() -> None:
    _check_argmax(kernel)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_of_a_real_vocabulary_is_torchs_on_one_or_two_threads(dtype: torch.dtype) -> None:
    """A decode batch's logits at a real vocabulary (a million values and more: rows spread
    over the OpenMP team), each row's maximum planted somewhere else, a tie in one row."""
    gen = torch.Generator().manual_seed(28)
    x = torch.randn(9, 151_936, generator=gen)
    where = torch.randint(0, 151_936, (9,), generator=gen)
    x[torch.arange(9), where] = 9.0
    x[4, 151_935] = 9.0  # a tie: the first wins
    x = x.to(dtype)
    want = x.argmax(dim=-1).tolist()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert kernel.argmax(x) == want
    finally:
        torch.set_num_threads(before)


# ---- bfloat16: the kernels against torch's bfloat16 ops (float32 inside, rounded where
# torch rounds), and the runner's bfloat16 path through them

BF16 = torch.bfloat16


def _bf16_close(got: torch.Tensor, want: torch.Tensor, min_exact: float) -> None:
    """Within bfloat16's tolerance everywhere, and bit-equal for at least ``min_exact`` of the
    elements (the kernels round where torch rounds; only a sum's order differs)."""
    assert got.dtype == BF16 and got.shape == want.shape
    torch.testing.assert_close(got, want.to(BF16), atol=1e-2, rtol=1.6e-2)
    assert (got == want.to(BF16)).float().mean().item() >= min_exact


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (14, 2, 64), (8, 2, 32), (4, 4, 128),
                                                (7, 1, 32), (6, 3, 16), (3, 1, 12), (12, 1, 64),
                                                (20, 1, 32), (16, 2, 256)])
@pytest.mark.parametrize("window", [None, 7])
def test_bf16_attention_reads_the_pool_in_place_for_any_group(heads: int, kv_heads: int,
                                                              dim: int,
                                                              window: int | None) -> None:
    """bfloat16 q and pool (SmolLM2's group of 3, Qwen2.5's 7, MHA, head sizes on and off the
    vector widths) against torch's bfloat16 attention (what transformers runs), which it
    follows: the weights rounded to bfloat16 before the values, not the sum (90% or more of
    the outputs bit-equal); and within bfloat16's tolerance of float32 attention."""
    lens = [1, 2, 9, 33, 100]
    q, k, v, table, rows, lens_t = _case(heads, kv_heads, dim, lens, seed=heads)
    q, k, v = q.to(BF16), k.to(BF16), v.to(BF16)
    got = kernel.attend(q, k, v, table, rows, lens_t, dim**-0.5, window,
                        torch.empty(heads * max(lens)))
    _bf16_close(got, reference_attend(q, k, v, table, rows, lens_t, dim**-0.5, window), 0.9)
    want = reference_attend(q.float(), k.float(), v.float(), table, rows, lens_t, dim**-0.5,
                            window)
    _bf16_close(got, want, min_exact=0.6)


@needs_kernel
def test_bf16_attention_matches_torchs_bf16_attention_on_a_strided_q() -> None:
    """The runner's q: a view of the rotated heads; torch's bfloat16 SDPA as the reference."""
    q, k, v, table, rows, lens_t = _case(9, 3, 64, [5, 64], seed=3)
    qk = torch.cat([q, torch.zeros(2, 3, 64)], dim=1).to(BF16)
    got = kernel.attend(qk[:, :9], k.to(BF16), v.to(BF16), table, rows, lens_t, 0.125, None,
                        torch.empty(9 * 64))
    want = reference_attend(qk[:, :9].contiguous(), k.to(BF16), v.to(BF16), table, rows,
                            lens_t, 0.125, None)
    _bf16_close(got, want, min_exact=0.9)


@needs_kernel
def test_bf16_kernels_refuse_mixed_dtypes() -> None:
    q, k, v, table, rows, lens_t = _case(4, 2, 32, [3])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel.attend(q.to(BF16), k, v, table, rows, lens_t, 0.2, None, torch.empty(12))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel.rms_norm(torch.ones(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16),
                        1e-6)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm's torch path (transformers' LlamaRMSNorm) in x's dtype."""
    from sglang_admin.model.layers import RMSNorm

    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.data = weight
    return norm(x)


@needs_kernel
@pytest.mark.parametrize("dim", [576, 21, 64])
def test_bf16_rms_norm_and_the_fused_residual_add(dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(33, dim, generator=gen) * 3).to(BF16)
    delta = torch.randn(33, dim, generator=gen).to(BF16)
    weight = (1 + torch.randn(dim, generator=gen) / 4).to(BF16)
    _bf16_close(kernel.rms_norm(x, weight, 1e-5), _torch_rms_norm(x, weight, 1e-5), 0.97)
    summed = x + delta
    got = kernel.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, summed)  # the residual add in place, rounded as torch's add
    _bf16_close(got, _torch_rms_norm(summed, weight, 1e-5), 0.97)


@needs_kernel
@pytest.mark.parametrize("dim", [64, 32, 12])
def test_bf16_rope_store_rotates_as_torch_and_writes_the_new_kv(dim: int) -> None:
    """Bit-equal to apply_rope in bfloat16 (each product and the sum rounded), the rotated k
    heads and the v heads written at the token's pool slots."""
    heads, kv_heads, tokens = 9, 3, 20
    gen = torch.Generator().manual_seed(dim)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim + 8, generator=gen) * 2).to(BF16)
    qkv = qkv[:, :-8].view(tokens, heads + 2 * kv_heads, dim)  # a token stride of its own
    cfg = LlamaConfig("LlamaForCausalLM", "llama", vocab_size=16, hidden_size=heads * dim,
                      intermediate_size=8, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=dim)
    cos, sin = RotaryEmbedding(cfg)(torch.arange(100, 100 + tokens), BF16)
    pool_k = torch.zeros(64, kv_heads, dim, dtype=BF16)
    pool_v = torch.zeros_like(pool_k)
    slots = torch.randperm(63, generator=gen)[:tokens] + 1
    got = kernel.rope_store(qkv, cos, sin, heads, pool_k, pool_v, slots)
    want = apply_rope(qkv[:, : heads + kv_heads], cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(pool_k[slots], want[:, heads:])
    assert torch.equal(pool_v[slots], qkv[:, heads + kv_heads :])
    assert torch.equal(kernel.rope(qkv[:, :heads], cos, sin), want[:, :heads])


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,window", [(14, 2, None), (9, 3, 5), (4, 4, None)])
def test_bf16_rope_attend_is_rope_store_then_attend(heads: int, kv_heads: int,
                                                    window: int | None) -> None:
    """The decode step's one call: bit-equal to rope_store then attend (the same pools
    written, the same output), into the buffers it is given."""
    dim, lens = 64, [1, 6, 40, 17]
    gen = torch.Generator().manual_seed(heads)
    q, k, v, table, rows, lens_t = _case(heads, kv_heads, dim, lens, seed=heads)
    k, v = k.to(BF16), v.to(BF16)
    n = len(lens)
    qkv = torch.randn(n, heads + 2 * kv_heads, dim, generator=gen).to(BF16)
    cfg = LlamaConfig("LlamaForCausalLM", "llama", vocab_size=16, hidden_size=heads * dim,
                      intermediate_size=8, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=dim)
    cos, sin = RotaryEmbedding(cfg)(lens_t - 1, BF16)
    out_slots = table[rows, lens_t - 1].contiguous()  # each sequence's new token
    scores = torch.empty(heads * max(lens))
    k2, v2 = k.clone(), v.clone()
    rotated = kernel.rope_store(qkv, cos, sin, heads, k, v, out_slots)
    want = kernel.attend(rotated[:, :heads], k, v, table, rows, lens_t, 0.125, window, scores)
    rot_buf = torch.empty(n, heads + kv_heads, dim, dtype=BF16)
    out_buf = torch.empty(n, heads * dim, dtype=BF16)
    got = kernel.rope_attend(qkv, cos, sin, heads, k2, v2, out_slots, table, rows, lens_t, 0.125,
                             window, scores, rot_buf, out_buf)
    assert got.data_ptr() == out_buf.data_ptr()
    assert torch.equal(got, want) and torch.equal(rot_buf, rotated)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    with pytest.raises(ValueError, match="scores scratch"):
        kernel.rope_attend(qkv, cos, sin, heads, k2, v2, out_slots, table, rows, lens_t, 0.125,
                           window, torch.empty(8))
    with pytest.raises(ValueError, match="not laid out"):
        kernel.rope_attend(qkv, cos, sin, heads, k2, v2, out_slots[:2], table, rows, lens_t,
                           0.125, window, scores)


@needs_kernel
@pytest.mark.parametrize("width", [1536, 19])
def test_bf16_silu_mul(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(17, 2 * width, generator=gen) * 4).to(BF16)
    # where exp(-gate) overflows or vanishes (the inline exp's clamps), zeros, a tiny value
    ends = torch.tensor([-200.0, -100.0, -89.0, -88.0, 88.0, 89.0, 100.0, 0.0, -1e30, 1e-30,
                         -30.0, 30.0, -1e-3, 1e-3, 17.0, -3e38, 1e30, -0.5, 3.0])
    gate_up[0, : min(width, ends.numel())] = ends[:width].to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    got = kernel.silu_mul(gate_up)
    _bf16_close(got, F.silu(gate) * up, 0.99)
    assert torch.equal(got[0], (F.silu(gate) * up)[0])  # the ends, bit-equal


@needs_kernel
def test_bf16_argmax_is_torchs_including_ties_infinities_and_nans() -> None:
    class AsBf16:  # the same cases as float32's, in bfloat16
        def argmax(self, x: torch.Tensor) -> list[int]:
            got = kernel.argmax(x.to(BF16))
            assert got == x.to(BF16).argmax(dim=-1).tolist()
            return x.argmax(dim=-1).tolist() if got == x.to(BF16).argmax(dim=-1).tolist() else got

    _check_argmax(AsBf16())


@needs_kernel
def test_runner_in_bf16_uses_the_kernels_and_decodes_as_torchs_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model in bfloat16: the kernels are on (attention, norms, RoPE, SwiGLU,
    argmax, prefill attention where the build has it; never the float32 decode layer or
    projections) and greedy tokens are torch's
    bfloat16 ops': most prompts token-equal, the others up to a near tie (both sides round
    in bfloat16, in different orders: test_bf16.py checks the ties against transformers)."""
    calls: list[str] = []
    for name in ("attend", "rope_store", "add_rms_norm", "silu_mul", "argmax", "decode_layer",
                 "linear", "extend_attend", "rope_attend"):
        real = getattr(cpu_kernels.CpuKernels, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):  # noqa: ANN001, ANN202
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cpu_kernels.CpuKernels, name, spy)
    real_batch = extend_batch.ExtendBatch.attend

    def spy_batch(self, *args):  # noqa: ANN001, ANN202
        calls.append("extend_batch")
        return real_batch(self, *args)

    monkeypatch.setattr(extend_batch.ExtendBatch, "attend", spy_batch)
    prompts = [[5, 9, 13, 200, 7], list(range(40, 90)), [1], list(range(100, 133))]
    fast = ModelRunner(None, device="cpu", dtype="bfloat16", max_total_tokens=1024,
                       max_running_requests=4)
    slow = ModelRunner(None, device="cpu", dtype="bfloat16", max_total_tokens=1024,
                       max_running_requests=4, attention_backend="torch_native")
    assert fast.cpu_kernels is not None and slow.cpu_kernels is None
    calls.clear()  # a first load checks every kernel against torch
    ours, theirs = _greedy(fast, prompts, 12), _greedy(slow, prompts, 12)
    assert sum(a == b for a, b in zip(ours, theirs)) >= 3
    assert all(a[:4] == b[:4] for a, b in zip(ours, theirs))
    assert {"rope_attend", "rope_store", "add_rms_norm", "silu_mul", "argmax"} <= set(calls)
    assert not {"decode_layer", "linear"} & set(calls)
    # prefill attention: every chunk of a step in one flash kernel call where the build has
    # it (AVX512_BF16) and it runs on the CPU's AMX tiles or the CPU has none (else torch's
    # flash attention, which runs on them)
    head_dim = fast.model.config.head_dim
    assert "extend_attend" not in calls
    assert ("extend_batch" in calls) == (fast.cpu_kernels.extend_applies(head_dim, BF16) and (
        extend_batch.tile_kernel(fast.cpu_kernels) or not choice.cpu_has_tile_matmul()))


@needs_kernel
def test_bf16_decode_step_without_per_op_dispatch_is_the_layers_arithmetic(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 decode step through LlamaForCausalLM.decode_bf16 (the residual adds fused
    into the norms, RoPE + K/V write + attention in one call) computes the logits the layer
    modules compute through the same kernels, bit for bit, every step."""
    from sglang_admin.model.llama import LlamaForCausalLM

    calls: list[str] = []
    real_lean = LlamaForCausalLM.decode_bf16

    def lean(self, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append("decode_bf16")
        return real_lean(self, *args, **kwargs)

    def run(lean_path: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(DecoderLayer, "decodes_in_bf16_kernels",
                            DecoderLayer.decodes_in_bf16_kernels if lean_path
                            else (lambda self: False))
        runner = ModelRunner(None, device="cpu", dtype="bfloat16", max_total_tokens=1024,
                             max_running_requests=4)
        logits: list[torch.Tensor] = []
        real = runner._compute_logits

        def keep(hidden: torch.Tensor) -> torch.Tensor:
            out = real(hidden)
            logits.append(out.clone())
            return out

        runner._compute_logits = keep  # type: ignore[method-assign]
        _greedy(runner, [[5, 9, 13, 200, 7], list(range(40, 90)), [1], list(range(7, 40))], 10)
        return logits

    monkeypatch.setattr(LlamaForCausalLM, "decode_bf16", lean)
    lean_logits = run(True)
    assert calls.count("decode_bf16") == 9  # every decode step
    calls.clear()
    layer_logits = run(False)
    assert not calls
    assert len(lean_logits) == len(layer_logits) == 10
    for a, b in zip(lean_logits, layer_logits):
        assert torch.equal(a, b)


@needs_kernel
def test_bf16_attention_spread_over_threads_is_bit_equal_to_one_thread() -> None:
    """Each sequence x kv head is a task of its own on torch's threads: the same sums as one
    thread, whatever the team (a scratch for two teams' scores, or one)."""
    lens = [3, 40, 17, 64, 1, 29]
    q, k, v, table, rows, lens_t = _case(9, 3, 64, lens, seed=7)
    q, k, v = q.to(BF16), k.to(BF16), v.to(BF16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.attend(q, k, v, table, rows, lens_t, 0.125, None, torch.empty(9 * 64))
        torch.set_num_threads(2)
        for scores in (torch.empty(9 * 64), torch.empty(3 * 64)):
            got = kernel.attend(q, k, v, table, rows, lens_t, 0.125, None, scores)
            assert torch.equal(got, one)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_bf16_silu_mul_spread_over_threads_is_bit_equal_to_one_thread() -> None:
    gate_up = (torch.randn(32, 2 * 1536, generator=torch.Generator().manual_seed(5)) * 4).to(BF16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.silu_mul(gate_up)
        torch.set_num_threads(2)
        assert torch.equal(kernel.silu_mul(gate_up), one)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_bf16_prefill_rows_spread_over_threads_are_bit_equal_to_one_thread() -> None:
    """A prefill's RMSNorm, add + RMSNorm and RoPE + K/V store rows (past the size where
    they spread over the team) give the same bits on 2 threads as on 1, and as row by row."""
    gen = torch.Generator().manual_seed(6)
    T, D, H, KV, HD = 300, 576, 9, 3, 64
    x = (torch.randn(T, D, generator=gen) * 3).to(BF16)
    delta = torch.randn(T, D, generator=gen).to(BF16)
    w = (torch.rand(D, generator=gen) + 0.5).to(BF16)
    qkv = torch.randn(T, H + 2 * KV, HD, generator=gen).to(BF16)
    angles = torch.rand(T, 1, HD // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(BF16)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(BF16)
    slots = torch.randperm(T + 17, generator=gen)[:T]

    def run() -> list[torch.Tensor]:
        k_cache = torch.zeros(T + 17, KV, HD, dtype=BF16)
        v_cache = torch.zeros(T + 17, KV, HD, dtype=BF16)
        added = x.clone()
        normed = kernel.add_rms_norm(added, delta, w, 1e-5)
        rotated = kernel.rope_store(qkv, cos, sin, H, k_cache, v_cache, slots)
        return [kernel.rms_norm(x, w, 1e-5), added, normed, rotated, k_cache, v_cache]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    by_row = torch.cat([kernel.rms_norm(x[t : t + 1], w, 1e-5) for t in range(T)])
    assert torch.equal(by_row, one[0])
    assert torch.equal(one[1], x + delta)  # the residual add rounded as torch's


def flash_bf16_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, prefix: int, scale: float, window: int | None,
                         block: int = 64) -> torch.Tensor:
    """The bfloat16 prefill kernel's arithmetic, written with torch ops over the same blocks of
    64 keys (what torch's CPU flash kernel does over its own blocks): float32 scores of the
    bfloat16 q and k, an online softmax in float32, each block's probabilities rounded to
    bfloat16 before the values, the output accumulated in float32 and rounded once."""
    n, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    length = prefix + n
    k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v_cache[slots].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    keys = torch.arange(length)[None, :]
    pos = torch.arange(prefix, length)[:, None]
    mask = keys <= pos
    if window is not None:
        mask &= keys > pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    m = torch.full((heads, n), float("-inf"))
    total = torch.zeros(heads, n)
    out = torch.zeros(heads, n, dim)
    for j0 in range(0, length, block):
        s = scores[..., j0 : j0 + block]
        new_m = torch.maximum(m, s.amax(-1))
        started = torch.isfinite(new_m)
        alpha = torch.where(torch.isfinite(m), torch.exp(m - new_m), torch.zeros_like(m))
        alpha = torch.where(started, alpha, torch.ones_like(m))
        p = torch.exp(s - torch.where(started, new_m, torch.zeros_like(new_m))[..., None])
        total = total * alpha + p.sum(-1)
        out = out * alpha[..., None] + p.to(BF16).float() @ v[j0 : j0 + block].transpose(0, 1)
        m = new_m
    return (out / total[..., None]).to(BF16).transpose(0, 1).reshape(n, heads * dim)


needs_bf16_prefill = pytest.mark.skipif(
    kernel is None or not kernel.extend_applies(64, BF16),
    reason="no bfloat16 prefill kernel in this build (AVX512_BF16)")


def test_the_bf16_prefill_kernel_loads_where_the_cpu_has_avx512_bf16() -> None:
    """The tests below skip without the kernel; where the CPU has the instructions it must
    load (the bfloat16 kernels are dropped at load when one disagrees with torch, which would
    hide it)."""
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    if kernel is None or not cpuinfo.exists() or "avx512_bf16" not in cpuinfo.read_text():
        pytest.skip("no AVX512_BF16 here")
    assert kernel.bf16 and kernel.extend_applies(64, BF16)


@needs_bf16_prefill
@pytest.mark.parametrize(("prefix", "n", "heads", "kv_heads", "dim", "window"), [
    (0, 150, 14, 2, 64, None),   # Qwen2.5-0.5B's group of 7, lengths off the 64 blocks
    (37, 70, 9, 3, 64, None),    # SmolLM2-135M's group of 3 after a cached prefix
    (0, 1, 14, 2, 64, None),     # one token
    (200, 1, 9, 3, 64, None),    # one token after a prefix (a decode-like chunk)
    (5, 67, 4, 4, 128, None),    # MHA, head size 128
    (100, 130, 6, 2, 32, 17),    # a sliding window shorter than a block
    (0, 300, 8, 1, 64, 100),     # a window over several blocks, a group of 8
    (70, 64, 16, 8, 128, 64),
])
def test_bf16_prefill_kernel_is_torchs_flash_arithmetic(prefix: int, n: int, heads: int,
                                                        kv_heads: int, dim: int,
                                                        window: int | None) -> None:
    """bfloat16 prefill attention through scattered pool slots: against the same arithmetic
    written in torch (flash_bf16_reference) bit-equal but for rare ties of the roundings (the
    scores' sums run in another order: 99.9% equal, the rest within a step or 2^-10 max |v|; without
    the bfloat16 rounding of the probabilities many differ); against torch's own bfloat16
    SDPA (other blocks, so other roundings of P) within 2 steps or 2^-10 max |v|, mostly
    equal (80-100% at these cases); and within bfloat16 rounding of float32 attention."""
    gen = torch.Generator().manual_seed(prefix + n + heads)
    length = prefix + n
    k_pool = torch.randn(length + 9, kv_heads, dim, generator=gen).to(BF16)
    v_pool = torch.randn(length + 9, kv_heads, dim, generator=gen).to(BF16)
    slots = torch.randperm(length + 9, generator=gen)[:length]
    # q as the layer hands it: a view with a token stride of its own; scores far apart
    q = (torch.randn(n, heads + 2 * kv_heads, dim, generator=gen) * 3).to(BF16)[:, :heads]
    scale = dim**-0.5
    got = kernel.extend_attend(q, k_pool, v_pool, slots, prefix, scale, window)
    assert got.dtype == BF16 and got.shape == (n, heads * dim)
    emulated = flash_bf16_reference(q, k_pool, v_pool, slots, prefix, scale, window)
    v_max = v_pool.float().abs().max().item()
    # where a probability rounds the other way (its score summed in another order): a step
    # of that weight times its value, 2^-9 x 2^-1 x max |v| at most
    torch.testing.assert_close(got.float(), emulated.float(), rtol=2.0**-7,
                               atol=2.0**-10 * v_max)
    assert (got == emulated).float().mean().item() >= 0.999
    sdpa = cpu_kernels_build.reference_extend(q, k_pool, v_pool, slots, prefix, scale, window)
    # two steps, or (near zero, where the weighted values cancel) P's other roundings
    torch.testing.assert_close(got.float(), sdpa.float(), rtol=2.0**-6, atol=2.0**-10 * v_max)
    assert (got == sdpa).float().mean().item() >= 0.75
    exact = cpu_kernels_build.reference_extend(q.float(), k_pool.float(), v_pool.float(), slots,
                                         prefix, scale, window)
    # the output's rounding (half a step) and P's (2^-9 of each weight: 2^-9 of max |v|),
    # and no further from float32 than torch's bfloat16 SDPA is (to within a step)
    bound = exact.abs() * 2.0**-8 + 2.0**-9 * v_pool.float().abs().max()
    assert ((got.float() - exact).abs() <= bound).all()
    ours, torchs = (got.float() - exact).abs().max(), (sdpa.float() - exact).abs().max()
    assert ours <= torchs + 2.0**-7 * exact.abs().max()


@needs_bf16_prefill
def test_bf16_prefill_kernel_spread_over_threads_is_bit_equal_to_one_thread() -> None:
    """Each kv head x block of 64 queries is a task of its own: the same sums on any team."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(200, 14, 64, generator=gen).to(BF16)
    pool = torch.randn(2, 260, 2, 64, generator=gen).to(BF16)
    slots = torch.randperm(260, generator=gen)[:250]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.extend_attend(q, pool[0], pool[1], slots, 50, 0.125, None)
        torch.set_num_threads(2)
        assert torch.equal(kernel.extend_attend(q, pool[0], pool[1], slots, 50, 0.125, None), one)
    finally:
        torch.set_num_threads(before)


@needs_bf16_prefill
def test_bf16_prefill_kernel_refuses_what_it_does_not_cover() -> None:
    """Head sizes off 32 or over 256 (the runner keeps torch's SDPA), mixed dtypes, a head
    count no multiple of the kv heads: a clear error, nothing computed."""
    assert not kernel.extend_applies(48, BF16) and not kernel.extend_applies(512, BF16)
    pool = torch.zeros(40, 2, 48, dtype=BF16)
    with pytest.raises(ValueError, match="no bfloat16 path"):
        kernel.extend_attend(torch.zeros(8, 8, 48, dtype=BF16), pool, pool, torch.arange(8), 0,
                             0.2, None)
    pool = torch.zeros(40, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel.extend_attend(torch.zeros(8, 8, 64), pool, pool, torch.arange(8), 0, 0.2, None)
    with pytest.raises(ValueError, match="no bfloat16 path"):
        kernel.extend_attend(torch.zeros(8, 7, 64, dtype=BF16), pool, pool, torch.arange(8), 0,
                             0.2, None)


@needs_bf16_prefill
def test_runner_in_bf16_sends_every_prefill_chunk_to_the_flash_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 on a CPU without AMX tiles: every chunk goes through the flash kernel, on two
    torch threads, past EXTEND_MAX_TOKENS, after a cached prefix; the tokens are those of
    torch's SDPA path, which a CPU with AMX tiles takes for every chunk."""
    from sglang_admin.model import batch as batch_module

    monkeypatch.setattr(choice, "cpu_has_tile_matmul", lambda: False)
    calls = _spy_extend_attend(monkeypatch)
    runner = ModelRunner(None, device="cpu", dtype="bfloat16", max_total_tokens=4096,
                         max_running_requests=4)
    layers = runner.model.config.num_layers
    long = choice.EXTEND_MAX_TOKENS + 1
    greedy = SamplingParams(temperature=0.0)
    prompt = list(range(3, 11))
    long_prompt = [(7 * i) % (runner.info.vocab_size - 2) + 2 for i in range(long)]

    def run(with_long: bool) -> list[int]:
        runner.reset()
        first = runner.forward_step([
            SeqInput(0, 0, prompt[:5], 0, [1, 2, 3, 4, 5], greedy, prompt, [], False),
            SeqInput(1, 0, long_prompt, 0, list(range(10, 10 + long)), greedy, long_prompt, []),
        ][: 2 if with_long else 1])
        rest = runner.forward_step([SeqInput(0, 5, prompt[5:], 5, [6, 7, 8], greedy, prompt, [])])
        return [r.token_id for r in first[1:] + rest]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run(with_long=True)
        assert calls == ([(5, 0), (long, 0)] * layers + [(3, 5)] * layers)
        ours = run(with_long=False)
        calls.clear()
        monkeypatch.setattr(batch_module, "extend_kernel_takes",
                            lambda dtype, prefix, n, **_: dtype == torch.float32)
        assert run(with_long=False) == ours and calls == []
        monkeypatch.setattr(batch_module, "extend_kernel_takes", choice.extend_kernel_takes)
        monkeypatch.setattr(choice, "cpu_has_tile_matmul", lambda: True)
        tiles = runner.batches.kernel_tiles
        runner.batches.kernel_tiles = False  # AMX tiles the kernel does not use: torch's
        assert run(with_long=False) == ours and calls == []
        runner.batches.kernel_tiles = True  # the kernel on the tiles (where it has them)
        if extend_batch.tile_kernel(runner.cpu_kernels):
            assert run(with_long=False) == ours and calls == [(5, 0)] * layers + [(3, 5)] * layers
        runner.batches.kernel_tiles = tiles
    finally:
        torch.set_num_threads(before)
