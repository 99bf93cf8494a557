"""A decode step on projections kept quantized, every layer in one C call
(model/quant/decode_step.py, csrc/quant_decode.c): it calls the same kernels in the same
order as ``LlamaForCausalLM.decode_bf16``'s loop, so a served model's tokens and logprobs
are the same bits with it and without it (batch 1 and 2 through the few-row kernel, int4 and
Q8_0 projections; batched steps of 5-64 rows through the AMX kernel, int4); a CPU without
the kernel, and steps it does not fit, keep the loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_admin.model.quant import amx, decode_step, gemv

pytest.importorskip("gguf", reason="the gguf package is not installed")

needs_kernel = pytest.mark.skipif(decode_step.load() is None,
                                  reason="no AVX512_VNNI + AVX512_BF16 kernel on this CPU")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SGLANG_ADMIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _model_path(tmp_path: Path, qtype: str, hidden: int) -> str:
    from sglang_admin.model.gguf import resolve_model_path
    from tests.gguf_models import write_gguf

    return resolve_model_path(str(write_gguf(tmp_path / f"m-{qtype}.gguf", arch="llama",
                                             qtype=qtype, tied=True, seed=3, hidden=hidden)))


def _runner(tmp_path: Path, qtype: str, hidden: int, requests: int = 2
            ):  # noqa: ANN202 - a ModelRunner
    from sglang_admin.model.runner import ModelRunner

    return ModelRunner(_model_path(tmp_path, qtype, hidden), device="cpu", dtype="bfloat16",
                       max_total_tokens=128 * requests, max_running_requests=requests,
                       quantization="gguf")


def _serve(runner, prompts: list[list[int]], steps: int,  # noqa: ANN001, ANN202
           stagger: bool = True):
    """Greedy tokens and logprobs of each prompt; ``stagger``: prompt i admitted at step i
    (else all at once: the steps after the first decode every one of them)."""
    from sglang_admin.model.sampling import SamplingParams
    from tests.unit.test_model_runner import Req, simulate

    reqs = [Req(p, arrive=i if stagger else 0, params=SamplingParams(temperature=0.0), return_logprob=True,
                top_logprobs_num=3) for i, p in enumerate(prompts)]
    simulate(runner, reqs, steps)
    return [(r.out, [(o.token_id, o.logprob, o.top_logprobs) for o in r.outputs])
            for r in reqs]


def _counting(monkeypatch: pytest.MonkeyPatch, heads: list[int] | None = None) -> list[int]:
    """Count the steps the C step served (rows of each; ``heads``: the rows of those whose
    call computed the LM head's logits too)."""
    served: list[int] = []
    real = decode_step.run

    def run(model, x, cos, sin, meta, *args):  # noqa: ANN001, ANN202
        out = real(model, x, cos, sin, meta, *args)
        if out is not None:
            served.append(x.shape[0])
            if heads is not None and meta.logits is not None:
                heads.append(x.shape[0])
        return out

    monkeypatch.setattr(decode_step, "run", run)
    return served


@needs_kernel
@pytest.mark.parametrize(("qtype", "hidden"), [("Q4_1", 64), ("Q4_0", 128), ("Q8_0", 128)])
def test_the_c_step_gives_the_loops_tokens_and_logprobs_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str, hidden: int) -> None:
    runner = _runner(tmp_path, qtype, hidden)
    prompts = [list(range(5, 14)), list(range(20, 26))]  # one row, then two
    heads: list[int] = []
    with monkeypatch.context() as m:
        served = _counting(m, heads)
        got = _serve(runner, prompts, 6)
    assert 1 in served and 2 in served  # batch 1 and batch 2 steps went through it
    # a Q8_0 head (the tied embedding in Q8_0) is computed in the same call, at both sizes;
    # an int4 one after it, as before
    assert sorted(set(heads)) == ([1, 2] if qtype == "Q8_0" else [])
    with monkeypatch.context() as m:
        m.setattr(decode_step, "run", lambda *a: None)  # the layer loop alone
        want = _serve(_runner(tmp_path, qtype, hidden), prompts, 6)
    assert got == want


@needs_kernel
def test_a_replaced_weight_is_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan holds pointers: a projection given new layouts (or a norm a new weight) is
    planned again, never read through stale pointers."""
    runner = _runner(tmp_path, "Q4_1", 64)
    prompts = [list(range(5, 14))]
    first = _serve(runner, prompts, 3)
    model = runner.model
    plan = model.__dict__["_quant_step_plan"][1]
    assert plan is not None and plan.current()
    proj = plan.projections[0]()
    proj.gemv_w = proj.gemv_w.clone()
    norm = plan.norm_modules[1]()
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
    assert not plan.current()
    served = _counting(monkeypatch)
    again = _serve(runner, prompts, 3)
    assert served and model.__dict__["_quant_step_plan"][1] is not plan
    assert again[0][0] == first[0][0]


def test_a_cpu_without_the_kernel_keeps_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv, "cpu_has_gemv_kernel", lambda flags=None: False)
    assert decode_step.load() is None
    runner = _runner(tmp_path, "Q4_1", 64)
    served = _counting(monkeypatch)
    out = _serve(runner, [list(range(5, 14))], 4)
    assert not served and len(out[0][0]) == 4
    assert all(getattr(p, "gemv_w", None) is None for p in runner.model.quant.projections())


@needs_kernel
def test_a_model_that_does_not_fit_keeps_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Biased q/k/v (Qwen2) are not what the C step computes: no plan, the loop serves
    the same tokens."""
    from sglang_admin.model.gguf import resolve_model_path
    from sglang_admin.model.runner import ModelRunner
    from tests.gguf_models import write_gguf

    path = resolve_model_path(str(write_gguf(tmp_path / "qwen2.gguf", arch="qwen2",
                                             qtype="Q4_1", tied=True, seed=4)))
    runner = ModelRunner(path, device="cpu", dtype="bfloat16", max_total_tokens=256,
                         max_running_requests=2, quantization="gguf")
    assert any(getattr(p, "gemv_w", None) is not None for p in runner.model.quant.projections())
    served = _counting(monkeypatch)
    out = _serve(runner, [list(range(5, 14))], 3)
    assert not served and len(out[0][0]) == 3
    assert decode_step.build_plan(runner.model) is None


@needs_kernel
def test_released_weights_are_freed_and_the_reload_is_planned_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ReleaseMemoryOccupation frees the kept projections and the step plan's layouts (none
    outlives it), and the reload after resume is planned again, the same tokens."""
    import gc
    import weakref

    from sglang_admin.model.weights import reload_weights

    runner = _runner(tmp_path, "Q8_0", 128)  # a Q8_0 head: the plan holds its layouts
    prompts = [list(range(5, 14))]
    first = _serve(runner, prompts, 4)
    plan = runner.model.__dict__["_quant_step_plan"][1]
    assert plan is not None and plan.head is not None
    # the plan holds the head's layouts strongly (views of the huge-page buffer of every
    # projection's): they must go with the release too
    alive = [weakref.ref(p) for p in runner.model.quant.projections()]
    alive += [weakref.ref(t.untyped_storage()) for t in plan.head]
    del plan
    runner.release_weights()
    gc.collect()
    assert [r for r in alive if r() is not None] == [], "kept weights outlived the release"
    runner.resume_weights()
    reload_weights(runner.model, _model_path(tmp_path, "Q8_0", 128))
    served = _counting(monkeypatch)
    assert _serve(runner, prompts, 4) == first
    assert served


needs_amx = pytest.mark.skipif(decode_step.load(use_amx=True) is None,
                               reason="no AMX kernel (or few-row kernel) on this CPU")


def _batched_prompts(n: int) -> list[list[int]]:
    # token ids within the tiny vocabulary's 269 (ids 5-250)
    return [[5 + (7 * i + j) % 246 for j in range(4 + i % 5)] for i in range(n)]


def _counting_team(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the batched steps the one-region C function served (rows of each)."""
    kernel = decode_step._load()
    assert kernel is not None and kernel.amx_team
    real, served = kernel._amx_team, []

    def team(x, rows, *args):  # noqa: ANN001, ANN202
        served.append(rows)
        return real(x, rows, *args)

    monkeypatch.setattr(kernel, "_amx_team", team)
    return served


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("qtype", "hidden", "n"), [
    ("Q4_1", 64, 6), ("Q4_1", 128, 5), ("Q4_0", 128, 17), ("Q4_1", 128, 32),
    ("Q4_0", 64, 50)])
def test_the_c_step_gives_the_loops_tokens_on_batched_amx_rows_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str, hidden: int,
        n: int, threads: int) -> None:
    """Steps of 5, 6, 17, 32 and 50 rows (one 16-row block; two with a partial one; two
    whole; two passes over the weights) through the AMX kernel inside the C step: on one
    thread layer by layer (q4_decode_layers), on a team of two in one parallel region (the
    projections' blocks, the sequences and the SwiGLU split between them; head_dim 16
    through the per-kv-head attention, 32 the per-sequence one, which the loop takes per kv
    head below 4 sequences a thread: 5 rows): the loop's tokens and logprobs, the same
    bits."""
    prompts = _batched_prompts(n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with monkeypatch.context() as m:
            served, team = _counting(m), _counting_team(m)
            got = _serve(_runner(tmp_path, qtype, hidden, n), prompts, 5, stagger=False)
        assert n in served  # the batched steps went through the C step
        assert (n in team) == (threads > 1)  # a team's in one region
        with monkeypatch.context() as m:
            m.setattr(decode_step, "run", lambda *a: None)  # the layer loop alone
            want = _serve(_runner(tmp_path, qtype, hidden, n), prompts, 5, stagger=False)
    finally:
        torch.set_num_threads(before)
    assert got == want


@needs_amx
def test_a_replaced_amx_layout_is_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                       ) -> None:
    runner = _runner(tmp_path, "Q4_1", 64, 6)
    prompts = _batched_prompts(6)
    first = _serve(runner, prompts, 3, stagger=False)
    model = runner.model
    plan = model.__dict__["_quant_step_plan_amx"][1]
    assert plan is not None and plan.current() and plan.layout == "amx_codes"
    proj = plan.projections[2]()
    proj.amx_codes = proj.amx_codes.clone()
    assert not plan.current()
    served = _counting(monkeypatch)
    again = _serve(runner, prompts, 3, stagger=False)
    assert 6 in served and model.__dict__["_quant_step_plan_amx"][1] is not plan
    assert [r[0] for r in again] == [r[0] for r in first]


def test_a_cpu_without_amx_keeps_the_loop_on_batched_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AMX (the detector says so) the projections get no AMX layouts and a batched
    step goes through the loop (torch's int4 kernel), the same tokens as the loop alone."""
    monkeypatch.setattr(amx, "cpu_has_amx_kernel", lambda flags=None: False)
    assert decode_step.load(use_amx=True) is None
    runner = _runner(tmp_path, "Q4_1", 64, 6)
    assert all(getattr(p, "amx_codes", None) is None for p in runner.model.quant.projections())
    prompts = _batched_prompts(6)
    with monkeypatch.context() as m:
        served = _counting(m)
        got = _serve(runner, prompts, 4, stagger=False)
    assert 6 not in served and all(len(r[0]) == 4 for r in got)
    assert decode_step.build_plan(runner.model, use_amx=True) is None
    with monkeypatch.context() as m:
        m.setattr(decode_step, "run", lambda *a: None)
        want = _serve(_runner(tmp_path, "Q4_1", 64, 6), prompts, 4, stagger=False)
    assert got == want


@needs_kernel
def test_a_build_without_openmp_gives_the_same_bits(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Built without OpenMP (a compiler without it), the one-region step runs on the calling
    thread alone: the same tokens and logprobs as the loop, the head in the call too."""
    from sglang_admin.model import cpu_kernels_build

    sets = cpu_kernels_build._FLAG_SETS
    no_omp = [s for s in sets if "-fopenmp" not in s[0] and "-march=native" in s[0]]
    assert no_omp
    prompts = [list(range(5, 14)), list(range(20, 26))]
    decode_step._load.cache_clear()
    heads: list[int] = []
    try:
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels_build, "_FLAG_SETS", (no_omp[0],))
            assert decode_step._load() is not None
            served = _counting(m, heads)
            got = _serve(_runner(tmp_path, "Q8_0", 128), prompts, 6)
    finally:
        decode_step._load.cache_clear()
    assert 1 in served and 2 in served and sorted(set(heads)) == [1, 2]
    with monkeypatch.context() as m:
        m.setattr(decode_step, "run", lambda *a: None)
        want = _serve(_runner(tmp_path, "Q8_0", 128), prompts, 6)
    assert got == want


def test_the_plain_c_build_compiles_and_declines() -> None:
    """The build for machines without AVX-512 (no intrinsics): the joined source compiles,
    and says the step does not apply, so the loop serves."""
    import ctypes
    import shutil

    from sglang_admin.model import cpu_kernels_build

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    path = cpu_kernels_build._compile(cc, *cpu_kernels_build._FLAG_SETS[-1],
                                      source=decode_step._combined_source())
    assert path is not None
    lib = ctypes.CDLL(path)
    assert lib.q4_decode_applies() == 0 and lib.gemv_applies() == 0
