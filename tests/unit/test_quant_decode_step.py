"""A decode step of a few rows on projections kept quantized, every layer in one C call
(model/quant/decode_step.py, csrc/quant_decode.c): it calls the same kernels in the same
order as ``LlamaForCausalLM.decode_bf16``'s loop, so a served model's tokens and logprobs
are the same bits with it and without it (batch 1 and 2, int4 and Q8_0 projections); a CPU
without the few-row kernel, and steps it does not fit, keep the loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_admin.model.quant import decode_step, gemv

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


def _runner(tmp_path: Path, qtype: str, hidden: int):  # noqa: ANN202 - a ModelRunner
    from sglang_admin.model.runner import ModelRunner

    return ModelRunner(_model_path(tmp_path, qtype, hidden), device="cpu", dtype="bfloat16",
                       max_total_tokens=256, max_running_requests=2, quantization="gguf")


def _serve(runner, prompts: list[list[int]], steps: int):  # noqa: ANN001, ANN202
    from sglang_admin.model.sampling import SamplingParams
    from tests.unit.test_model_runner import Req, simulate

    reqs = [Req(p, arrive=i, params=SamplingParams(temperature=0.0), return_logprob=True,
                top_logprobs_num=3) for i, p in enumerate(prompts)]
    simulate(runner, reqs, steps)
    return [(r.out, [(o.token_id, o.logprob, o.top_logprobs) for o in r.outputs])
            for r in reqs]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the steps the C step served (rows of each)."""
    served: list[int] = []
    real = decode_step.run

    def run(model, x, *args):  # noqa: ANN001, ANN202
        out = real(model, x, *args)
        if out is not None:
            served.append(x.shape[0])
        return out

    monkeypatch.setattr(decode_step, "run", run)
    return served


@needs_kernel
@pytest.mark.parametrize(("qtype", "hidden"), [("Q4_1", 64), ("Q4_0", 128), ("Q8_0", 128)])
def test_the_c_step_gives_the_loops_tokens_and_logprobs_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str, hidden: int) -> None:
    runner = _runner(tmp_path, qtype, hidden)
    prompts = [list(range(5, 14)), list(range(20, 26))]  # one row, then two
    with monkeypatch.context() as m:
        served = _counting(m)
        got = _serve(runner, prompts, 6)
    assert 1 in served and 2 in served  # batch 1 and batch 2 steps went through it
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
    """The plan holds its weights weakly: ReleaseMemoryOccupation frees the kept projections
    (none outlives it), and the reload after resume is planned again, the same tokens."""
    import gc
    import weakref

    from sglang_admin.model.weights import reload_weights

    runner = _runner(tmp_path, "Q4_1", 64)
    prompts = [list(range(5, 14))]
    first = _serve(runner, prompts, 4)
    assert runner.model.__dict__["_quant_step_plan"][1] is not None
    alive = [weakref.ref(p) for p in runner.model.quant.projections()]
    runner.release_weights()
    gc.collect()
    assert [r for r in alive if r() is not None] == [], "a kept projection outlived the release"
    runner.resume_weights()
    reload_weights(runner.model, _model_path(tmp_path, "Q4_1", 64))
    served = _counting(monkeypatch)
    assert _serve(runner, prompts, 4) == first
    assert served
