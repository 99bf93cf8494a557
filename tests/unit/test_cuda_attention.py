"""The CUDA attention path (model/attention/choice.py), checked on the CPU: the Triton paged
decode kernel, run by Triton's interpreter, and the mask-free prefix prefill must equal
torch's path (SDPA over gathered rows) on the same pool, and a model run through them must
produce transformers' greedy tokens, eagerly and through the decode graphs' static buffers.
The kernels are also compiled for an H200 (no GPU needed to compile)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sglang_admin.messages import SamplingParams  # noqa: E402
from sglang_admin.model.attention import AttentionMetadata, paged_attention  # noqa: E402
from sglang_admin.model.attention.choice import cuda_attention_applies  # noqa: E402
from sglang_admin.model.attention.triton_decode import split_count  # noqa: E402
from sglang_admin.model.batch import BatchBuilder  # noqa: E402
from sglang_admin.model.runner import SeqInput  # noqa: E402

CONTEXT = 512
CAPACITY = 4096
HEAD_DIM = 32


def _builder(cuda_attention: bool, heads: int, kv_heads: int, dtype: torch.dtype,
             window: int | None) -> BatchBuilder:
    return BatchBuilder(
        device=torch.device("cpu"), dtype=dtype, max_running_requests=8,
        context_length=CONTEXT, token_capacity=CAPACITY, sliding_window=window,
        num_heads=heads, kv_width=kv_heads * HEAD_DIM, cpu_kernels=None, extend_kernel=False,
        lanes=1, cuda_attention=cuda_attention)


def _batch(decode_lengths: list[int], extend: list[tuple[int, int]]) -> list[SeqInput]:
    """Decode sequences of these lengths (their new token included), then extend sequences
    of (cached prefix, new tokens); slots interleaved across sequences, as decode steps
    hand them out."""
    g = torch.Generator().manual_seed(3)
    shapes = [(length - 1, 1) for length in decode_lengths] + extend
    total = sum(p + n for p, n in shapes)
    slots = (torch.randperm(CAPACITY, generator=g)[:total] + 1).tolist()
    seqs = []
    for row, (p, n) in enumerate(shapes):
        own, slots = slots[: p + n], slots[p + n :]
        seqs.append(SeqInput(req_idx=row, prefix_len=p, token_ids=[5] * n, table_start=0,
                             table_slots=own, sampling=SamplingParams(), prompt_ids=[5],
                             output_ids=[]))
    return seqs


def _attend(cuda_attention: bool, seqs: list[SeqInput], heads: int, kv_heads: int,
            dtype: torch.dtype, window: int | None) -> tuple[torch.Tensor, AttentionMetadata]:
    """One layer's attention of the batch's new tokens over a random pool (the same pool,
    queries and new keys for both paths)."""
    g = torch.Generator().manual_seed(11)
    builder = _builder(cuda_attention, heads, kv_heads, dtype, window)
    decode = [s for s in seqs if len(s.token_ids) == 1]
    extend = [s for s in seqs if len(s.token_ids) > 1]
    batch = builder.prepare(list(seqs), list(decode), extend, one_lane=True)
    meta = batch.metas[0]
    tokens = batch.input_ids.shape[0]
    k_cache = torch.randn(CAPACITY + 1, kv_heads, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(CAPACITY + 1, kv_heads, HEAD_DIM, generator=g).to(dtype)
    q = torch.randn(tokens, heads, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(tokens, kv_heads, HEAD_DIM, generator=g).to(dtype)
    k_cache.index_copy_(0, meta.out_slots, k)
    v_cache.index_copy_(0, meta.out_slots, v)
    out = paged_attention(q, k, v, meta, k_cache, v_cache, HEAD_DIM**-0.5, window, None)
    # decode rows come in the builder's order (shortest first): back to the batch's
    order = {id(s): i for i, s in enumerate(batch.ordered)}
    rows = [order[id(s)] for s in decode]
    return torch.cat([out[rows], out[len(decode):]]), meta


# mixed lengths: one token, under a block, several blocks, past MIN_SPLIT_TOKENS (split)
DECODE_LENGTHS = [1, 7, 300, 64]


@pytest.mark.parametrize(("heads", "kv_heads", "dtype", "window"), [
    (2, 2, torch.float32, None),  # group 1
    (3, 1, torch.float32, None),  # group 3
    (14, 2, torch.float32, None),  # group 7
    (7, 1, torch.float32, 50),  # a sliding window some sequences reach
    (3, 1, torch.bfloat16, None),
    (7, 1, torch.bfloat16, 50),
], ids=["g1", "g3", "g7", "g7-window", "g3-bf16", "g7-window-bf16"])
def test_paged_decode_kernel_equals_torchs_gathered_path(
        heads: int, kv_heads: int, dtype: torch.dtype, window: int | None) -> None:
    seqs = _batch(DECODE_LENGTHS, [])
    new, meta = _attend(True, seqs, heads, kv_heads, dtype, window)
    old, old_meta = _attend(False, seqs, heads, kv_heads, dtype, window)
    assert meta.paged_decode is not None and not meta.decode_groups  # the kernel ran
    assert old_meta.paged_decode is None and old_meta.decode_groups
    assert meta.paged_decode.num_splits == 2  # the 300-long one is cut: the merge weighs
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(new.float(), old.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "window"), [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.float32, 40)],
                         ids=["f32", "bf16", "window-in-reach"])
def test_prefix_prefill_without_a_mask_equals_the_masked_path(
        dtype: torch.dtype, window: int | None) -> None:
    # a mixed step: two decodes, a chunk after a cached prefix, a prompt without one
    seqs = _batch([9, 60], [(37, 11), (0, 6)])
    new, meta = _attend(True, seqs, 14, 2, dtype, window)
    old, _ = _attend(False, seqs, 14, 2, dtype, window)
    prefixed = meta.extend_seqs[0]
    # the mask is what rules out SDPA's flash kernel; past the window the mask stays
    assert prefixed.lower_right == (window is None)
    assert (prefixed.mask is None) == (window is None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(new.float(), old.float(), atol=tol, rtol=tol)


def test_the_cuda_path_is_chosen_on_cuda_alone_and_torch_native_keeps_torchs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_admin.model.attention import choice

    checked: list[tuple] = []
    monkeypatch.setattr(choice, "kernel_problem", lambda *a: checked.append(a))  # passes
    cuda, shape = torch.device("cuda", 0), (14, 2, 64, torch.bfloat16)
    assert cuda_attention_applies(cuda, "auto", *shape)
    assert checked == [(cuda, *shape)]  # the start-up check ran, for the model's heads
    assert not cuda_attention_applies(cuda, "torch_native", *shape)
    assert not cuda_attention_applies(torch.device("cpu"), "auto", *shape)
    assert len(checked) == 1


def test_a_kernel_that_fails_its_start_up_check_leaves_torchs_path_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from sglang_admin.model.attention import choice, triton_decode

    cpu = torch.device("cpu")
    # the real check, on the CPU through the interpreter: the kernel passes it
    assert choice.kernel_problem(cpu, 6, 2, 32, torch.float32) is None
    assert choice.kernel_problem(cpu, 6, 2, 32, torch.bfloat16) is None

    def wrong(*args: object) -> torch.Tensor:
        return torch.zeros(2, 6 * 32)

    monkeypatch.setattr(triton_decode, "decode_attention", wrong)
    assert "differs from torch's" in (choice.kernel_problem(cpu, 6, 2, 32, torch.float32) or "")

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("no compiler to build the launcher")

    monkeypatch.setattr(triton_decode, "decode_attention", broken)
    problem = choice.kernel_problem(cpu, 6, 2, 32, torch.float32)
    assert problem == "RuntimeError: no compiler to build the launcher"
    # on a CUDA rank that answer keeps torch's path, the reason logged
    monkeypatch.setattr(choice, "kernel_problem", lambda *args: problem)
    with caplog.at_level("WARNING"):
        assert not cuda_attention_applies(torch.device("cuda", 0), "auto", 6, 2, 32,
                                          torch.float32)
    assert "start-up check" in caplog.text and problem in caplog.text


def test_splits_fill_the_gpu_without_cutting_short_sequences_thin() -> None:
    assert split_count(1, 2, 100) == 1  # shorter than a split's least
    assert split_count(1, 2, 4096) == 16  # one sequence: cut to fill the GPU
    assert split_count(1, 2, 1 << 20) == 32  # at most MAX_SPLITS
    assert split_count(128, 8, 4096) == 1  # enough programs already


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama (4 heads, 2 KV heads) written by transformers."""
    from tests.unit.test_model_runner import _build

    path = str(tmp_path_factory.mktemp("llama") / "llama")
    _build("llama", path)
    return path


def _greedy_through_the_cuda_path(path: str, graphs_max_bs: int) -> list[int]:
    """Chunked prompts, a shared prefix and decode batches of 1 to 3 sequences through the
    CUDA path forced on the CPU (and its decode graphs, run eagerly, when asked for): each
    request's tokens must be transformers'; returns the decode batch sizes the graphs ran."""
    from tests.unit.test_model_runner import Req, _prompts, _runner, hf_greedy, simulate

    runner = _runner(path, attention_backend="torch_native")
    runner.batches.cuda_attention = True  # what a CUDA rank runs, forced on the CPU
    ran: list[int] = []
    if graphs_max_bs:
        runner.graphs = runner._decode_graphs(graphs_max_bs, True, None)
        assert runner.graphs is not None
        # as on CUDA, the first decode step captures; on the CPU that fails, and the steps
        # run the same static-buffer forward eagerly
        runner.graphs.capture_enabled = True
        run = runner.graphs.run

        def counted(*args: torch.Tensor) -> torch.Tensor | None:
            out = run(*args)
            if out is not None:
                ran.append(args[0].shape[0])
            return out

        runner.graphs.run = counted  # type: ignore[method-assign]
    p = _prompts(96)
    reqs = [Req(p[1]), Req(p[2], chunk=16),  # a chunk after its own first: a cached prefix
            Req(p[1][:12] + p[3][:5], arrive=1, share_from=0, share_len=12)]  # a shared one
    max_new = 3
    simulate(runner, reqs, max_new)
    for r in reqs:
        assert r.out == hf_greedy(path, r.prompt, max_new)[0]
    return ran


def test_a_model_through_the_cuda_path_gives_transformers_greedy_tokens(
        llama_path: str) -> None:
    _greedy_through_the_cuda_path(llama_path, 0)


def test_decode_graphs_pad_a_batch_to_its_size_and_the_tokens_stay_transformers(
        llama_path: str, caplog: pytest.LogCaptureFixture) -> None:
    # sizes 1, 2, 4: a batch of 3 runs padded to 4 (the padding row writes slot 0 only)
    with caplog.at_level("WARNING"):
        ran = _greedy_through_the_cuda_path(llama_path, 4)
    assert 3 in ran and 2 in ran
    assert caplog.text.count("CUDA graph capture failed") == 1  # tried once, then eager


def test_graph_sizes_and_padding() -> None:
    from sglang_admin.model.decode_graphs import graph_sizes, padded_size

    assert graph_sizes(1) == [1]
    assert graph_sizes(4) == [1, 2, 4]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(64)[-3:] == [48, 56, 64]
    sizes = graph_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20,
                                                                         None]


def test_the_gpu_checks_comparison_of_the_two_paths_runs_on_the_cpu(
        capsys: pytest.CaptureFixture[str]) -> None:
    from tools.check_attention import main

    assert main(["--device", "cpu", "--dtype", "float32", "--batch", "3", "--context", "40",
                 "--heads", "6", "--kv-heads", "2", "--head-dim", "16", "--prefix", "20",
                 "--chunk", "5", "--iters", "1", "--graphs", "--shape", "tiny",
                 "--graph-batch", "1", "2", "--graph-context", "8", "--graph-steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == [
        "PASS decode", "TIME decode torch", "TIME decode cuda-path",
        "PASS prefill", "TIME prefill torch", "TIME prefill cuda-path", "PASS graphs",
        "TIME graphs eager bs 1", "TIME graphs captured bs 1", "TIME graphs eager bs 2",
        "TIME graphs captured bs 2"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernels_compile_for_an_h200(dtype: str) -> None:
    # no GPU needed: Triton compiles to an sm_90 cubin with the ptxas it ships; the
    # interpreter above checks the numbers, this that the compiler takes the code
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_admin.model.attention import triton_decode

    pointers = {"Q": dtype, "K": dtype, "V": dtype, "Out": dtype, "Table": "i64", "Rows": "i64",
                "Lens": "i64", "PartOut": "fp32", "PartLse": "fp32"}
    constants = {"GROUP": 7, "BLOCK_H": 16, "BLOCK_N": triton_decode.BLOCK_N, "HEAD_DIM": 64,
                 "BLOCK_D": 64, "BLOCK_S": 4, "UPCAST": False}
    for fn in (triton_decode._decode_partial, triton_decode._decode_merge):
        names = list(inspect.signature(fn).parameters)
        signature = {name: ("constexpr" if name in constants else f"*{pointers[name]}"
                            if name in pointers else "fp32" if name == "scale" else "i32")
                     for name in names}
        compiled = triton.compile(
            ASTSource(triton.jit(fn), signature, {n: constants[n] for n in names
                                                  if n in constants}),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": triton_decode.NUM_WARPS,
                     "num_stages": triton_decode.NUM_STAGES})
        assert compiled.asm["cubin"]
