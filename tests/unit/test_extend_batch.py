"""Every bfloat16 prefill chunk of a step in one kernel call (model/extend_batch.py over
csrc/cpu_kernels.c's extend_attention_bf16_seqs): against float64 attention for many chunks
of varied lengths with and without a cached prefix, GQA, a sliding window and scattered pool
slots, on AMX tiles and on AVX512_BF16 alone; equal to the per-sequence kernel bit for bit;
the same on any team; the runner's greedy tokens through it equal torch's SDPA path's; and
bad arguments refused with ValueError, never a crash."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_admin.messages import SamplingParams
from sglang_admin.model.attention import choice
from sglang_admin.model.cpu_kernels_build import load_cpu_kernels, reference_extend
from sglang_admin.model.extend_batch import ExtendBatch, extend_attend_seqs, tile_kernel
from sglang_admin.model.runner import ModelRunner, SeqInput

BF16 = torch.bfloat16
kernel = load_cpu_kernels()
pytestmark = pytest.mark.skipif(
    kernel is None or not kernel.extend_applies(64, BF16),
    reason="no bfloat16 prefill kernel in this build (AVX512_BF16)")
TILES = kernel is not None and tile_kernel(kernel)
# both paths where the CPU has AMX tiles (the vector one with the tiles turned off)
PATHS = [True, False] if TILES else [False]

# (prefix, new tokens) of the chunks of one call: lengths around the 16-row and 64-key blocks
CHUNKS = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 100), (37, 70), (5, 1), (200, 64), (0, 130),
          (64, 17), (1, 15)]


@pytest.fixture
def tiles_path(request: pytest.FixtureRequest):  # noqa: ANN201
    """Runs the test with the kernel's AMX tiles on or off (``request.param``)."""
    tile_kernel(kernel, request.param)
    yield request.param
    tile_kernel(kernel, True)


def _problem(heads: int, kv_heads: int, dim: int, chunks: list[tuple[int, int]], seed: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """q as the layer hands it (a token stride of its own), pools with spare rows, each
    chunk's slots scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(p + n for p, n in chunks)
    tokens = sum(n for _, n in chunks)
    k_pool = torch.randn(total + 11, kv_heads, dim, generator=gen).to(BF16)
    v_pool = torch.randn(total + 11, kv_heads, dim, generator=gen).to(BF16)
    order = torch.randperm(total + 11, generator=gen)[:total]
    q = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 3).to(BF16)[:, :heads]
    rows, at, off = [], 0, 0
    for p, n in chunks:
        rows.append((at, n, p, order[off:off + p + n]))
        at, off = at + n, off + p + n
    return q, k_pool, v_pool, rows


@pytest.mark.parametrize("tiles_path", PATHS, indirect=True)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window"), [
    (9, 3, 64, None),    # SmolLM2-135M
    (14, 2, 64, None),   # Qwen2.5-0.5B: a group of 7
    (9, 3, 64, 17),      # a window shorter than a block
    (8, 1, 64, 100),     # a window over blocks, a group of 8
    (4, 4, 128, None),   # MHA, head size 128
    (6, 2, 32, 40),
    (8, 2, 256, None),
])
def test_batched_prefill_is_float64_attention_within_bf16_rounding(
        tiles_path: bool, heads: int, kv_heads: int, dim: int, window: int | None) -> None:
    """Each chunk's rows within the bfloat16 kernel's bound of float64 attention (the
    output's rounding and the probabilities', as the per-sequence test), and bit-equal to
    the per-sequence kernel (the same tasks)."""
    q, k_pool, v_pool, rows = _problem(heads, kv_heads, dim, CHUNKS, heads + dim)
    scale = dim**-0.5
    batch = ExtendBatch.of(kernel, rows)
    out = torch.full((q.shape[0], heads * dim), float("nan"), dtype=BF16)
    got = batch.attend(q, k_pool, v_pool, scale, window, out)
    assert got is out and not got.isnan().any()
    v_max = v_pool.double().abs().max()
    for a, n, p, slots in rows:
        exact = reference_extend(q[a:a + n].double(), k_pool.double(), v_pool.double(), slots,
                                 p, scale, window)
        mine = got[a:a + n].double()
        bound = exact.abs() * 2.0**-8 + 2.0**-9 * v_max
        assert ((mine - exact).abs() <= bound).all(), (p, n)
        alone = kernel.extend_attend(q[a:a + n], k_pool, v_pool, slots, p, scale, window)
        assert torch.equal(got[a:a + n], alone), (p, n)


@pytest.mark.skipif(not TILES, reason="no AMX tiles here")
def test_tiles_and_vectors_agree_but_for_the_order_of_sums() -> None:
    """The AMX path and the AVX512_BF16 path: the same arithmetic but the order of a dot
    product's float32 sums, so nearly every output equal and the rest a step apart."""
    q, k_pool, v_pool, rows = _problem(9, 3, 64, CHUNKS, 5)
    batch = ExtendBatch.of(kernel, rows)
    outs = []
    for use in (True, False):
        tile_kernel(kernel, use)
        try:
            outs.append(batch.attend(q, k_pool, v_pool, 0.125, None,
                                     torch.empty(q.shape[0], 9 * 64, dtype=BF16)))
        finally:
            tile_kernel(kernel, True)
    assert (outs[0] == outs[1]).float().mean().item() >= 0.99
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2.0**-6,
                               atol=2.0**-9 * v_pool.float().abs().max().item())


@pytest.mark.parametrize("tiles_path", PATHS, indirect=True)
def test_batched_prefill_is_the_same_on_any_team(tiles_path: bool) -> None:
    q, k_pool, v_pool, rows = _problem(14, 2, 64, CHUNKS, 9)
    batch = ExtendBatch.of(kernel, rows)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(batch.attend(q, k_pool, v_pool, 0.125, None,
                                     torch.empty(q.shape[0], 14 * 64, dtype=BF16)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_only_the_chunks_rows_are_written() -> None:
    """Rows of no chunk (those the runner sends to SDPA) keep what out held."""
    q, k_pool, v_pool, rows = _problem(9, 3, 64, [(0, 20), (3, 7), (0, 30)], 2)
    out = torch.full((q.shape[0], 9 * 64), 7.0, dtype=BF16)
    ExtendBatch.of(kernel, [rows[0], rows[2]]).attend(q, k_pool, v_pool, 0.125, None, out)
    assert (out[20:27] == 7.0).all() and not (out[:20] == 7.0).all()


def test_bad_arguments_are_a_value_error_never_a_crash() -> None:
    """Fuzzed chunk tables (negative, empty, out of range, overlapping, huge) and malformed
    tensors: ValueError, and the valid ones computed."""
    q, k_pool, v_pool, rows = _problem(9, 3, 64, [(2, 5), (0, 9)], 4)
    slots = torch.cat([rows[0][3], rows[1][3]])
    good = torch.tensor([[0, 5, 2, 0], [5, 9, 0, 7]])
    extend_attend_seqs(kernel, q, k_pool, v_pool, slots, good, 0.125, None)
    rng = random.Random(0)
    values = [-(2**63), -5, -1, 0, 1, 2, 5, 7, 9, 13, 14, 16, 2**31, 2**62, 2**63 - 1]
    refused = 0
    for _ in range(400):
        seqs = good.clone()
        for _ in range(rng.randint(1, 3)):
            seqs[rng.randrange(2), rng.randrange(4)] = rng.choice(values)
        valid = all(
            n >= 1 and p >= 0 and a >= (0 if i == 0 else seqs[0, 0] + seqs[0, 1])
            and a + n <= q.shape[0] and off >= 0 and off + p + n <= slots.numel()
            for i, (a, n, p, off) in enumerate(seqs.tolist()))
        try:
            extend_attend_seqs(kernel, q, k_pool, v_pool, slots, seqs, 0.125, None)
        except ValueError:
            assert not valid, seqs.tolist()
            refused += 1
        else:
            assert valid, seqs.tolist()
    assert refused > 200
    bad_calls = [
        (q.float(), k_pool, v_pool, slots, good),  # a float32 q
        (q, k_pool[:, :2], v_pool, slots, good),  # pools of different shapes
        (q, k_pool, v_pool, slots.int(), good),  # int32 slots
        (q, k_pool, v_pool, slots, good.view(-1)),  # a flat chunk table
        (q, k_pool, v_pool, slots, good[:, :3].contiguous()),
        (q, k_pool, v_pool, slots.view(2, -1) if slots.numel() % 2 == 0 else slots[None],
         good),
        (q[:, :8], k_pool, v_pool, slots, good),  # 8 heads over 3 kv heads
        (q[..., :48], k_pool[..., :48], v_pool[..., :48], slots, good),  # head size 48
        (q[0], k_pool, v_pool, slots, good),  # q not [T, H, D]
        (q, k_pool.transpose(0, 1), v_pool, slots, good),
        (q, k_pool, v_pool, slots, good.t()),  # not contiguous
        (q, k_pool, v_pool, "slots", good),
    ]
    for args in bad_calls:
        with pytest.raises(ValueError):
            extend_attend_seqs(kernel, *args, 0.125, None)
    with pytest.raises(ValueError, match="window"):
        extend_attend_seqs(kernel, q, k_pool, v_pool, slots, good, 0.125, 0)
    with pytest.raises(ValueError, match="out"):
        extend_attend_seqs(kernel, q, k_pool, v_pool, slots, good, 0.125, None,
                           torch.empty(3, 9 * 64, dtype=BF16))
    empty = extend_attend_seqs(kernel, q, k_pool, v_pool, slots,
                               torch.empty(0, 4, dtype=torch.int64), 0.125, None)
    assert empty.shape == (q.shape[0], 9 * 64)


def test_runner_prefill_of_several_prompts_gives_sdpas_greedy_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 step prefilling several prompts (2 to 70 tokens, one after a cached prefix;
    a 1-token prompt is a decode sequence there)
    through the one call per layer, then decoding: the greedy tokens of torch's SDPA path
    (the kernel kept off; bfloat16 near ties aside), and every layer calls the kernel once
    for all the chunks."""
    calls: list[int] = []
    real = ExtendBatch.attend

    def spy(self, *args):  # noqa: ANN001, ANN202
        calls.append(self.seqs.shape[0])
        return real(self, *args)

    monkeypatch.setattr(ExtendBatch, "attend", spy)
    runner = ModelRunner(None, device="cpu", dtype="bfloat16", max_total_tokens=2048,
                         max_running_requests=8)
    greedy = SamplingParams(temperature=0.0)
    prompts = [[(5 * i + 3 * j) % 300 + 3 for j in range(n)] for i, n in
               enumerate((2, 15, 16, 17, 70, 40))]

    def run() -> tuple[list[list[int]], list[dict[int, float]]]:
        """Greedy tokens of each prompt, and the prefill's top-2 logprobs of each."""
        runner.reset()
        # the last prompt's first 24 tokens first: its second chunk has a cached prefix
        runner.forward_step([SeqInput(5, 0, prompts[5][:24], 0, list(range(1000, 1024)),
                                      greedy, prompts[5], [], False)])
        seqs, slot = [], 0
        for i, p in enumerate(prompts[:5]):
            seqs.append(SeqInput(i, 0, p, 0, list(range(slot, slot + len(p))), greedy, p, [],
                                 True, True, 2))
            slot += len(p)
        seqs.append(SeqInput(5, 24, prompts[5][24:], 24, list(range(1024, 1040)), greedy,
                             prompts[5], [], True, True, 2))
        first = runner.forward_step(seqs)
        outs = [[r.token_id] for r in first]
        for step in range(4):  # a few decode steps on fresh slots
            dec = [SeqInput(i, len(p) + step, [outs[i][-1]], len(p) + step,
                            [1100 + 8 * step + i], greedy, p + outs[i], [])
                   for i, p in enumerate(prompts)]
            for out, r in zip(outs, runner.forward_step(dec)):
                out.append(r.token_id)
        return outs, [dict(r.top_logprobs) for r in first]

    if not runner.batches.kernel_tiles and choice.cpu_has_tile_matmul():
        pytest.skip("the CPU has AMX tiles the kernel does not use: torch's SDPA serves")
    layers = runner.model.config.num_layers
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ours, our_top = run()
        assert calls == [1] * layers + [6] * layers  # one call per layer for all six
        calls.clear()
        monkeypatch.setattr(runner.batches, "extend_kernel", False)  # torch's SDPA
        theirs, their_top = run()
        assert calls == []
    finally:
        torch.set_num_threads(before)
    # the two paths round in bfloat16 in other orders (sums of other lengths), so this
    # random model's flat logits can part at a near tie: most prompts token-equal, and where
    # a prefill token differs each path ranks the other's token second, within a few
    # bfloat16 steps (seen: 0.03 and 0.06 apart)
    assert sum(o == t for o, t in zip(ours, theirs)) >= len(prompts) - 2
    for o, t, mine, torchs in zip(ours, theirs, our_top, their_top):
        if o[0] != t[0]:
            assert mine[o[0]] - mine[t[0]] <= 0.125 and torchs[t[0]] - torchs[o[0]] <= 0.125
