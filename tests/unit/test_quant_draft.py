"""STANDALONE speculative decoding with a GGUF draft model kept quantized (model/quant/)
beside a kept GGUF target: the draft keeps its projections quantized when the target keeps
its own, and drafts on the real engine (scheduler and both runners in this process)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf")

from sglang_admin.messages import GenerateReq, SamplingParams  # noqa: E402
from sglang_admin.model.gguf import resolve_model_path  # noqa: E402
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.scheduler.rank.model_step import batch_inputs  # noqa: E402
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from sglang_admin.scheduler.speculative.draft_drafter import DraftModelDrafter  # noqa: E402
from sglang_admin.scheduler.speculative.draft_model import load_draft_runner  # noqa: E402
from sglang_admin.scheduler.speculative.policy import SpecConfig  # noqa: E402
from tests.gguf_models import write_gguf  # noqa: E402

ROWS = 4
PROMPTS = [list(range(5 + i, 17 + i)) for i in range(3)]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SGLANG_ADMIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _generate(target: ModelRunner, draft: ModelRunner | None) -> tuple[list[list[int]], Scheduler]:
    """Greedy outputs of PROMPTS through the scheduler, drafting with ``draft`` if given."""
    target.reset()
    sched = Scheduler(SchedulerConfig(
        token_capacity=target.token_capacity, max_running_requests=ROWS,
        max_prefill_tokens=256, context_length=target.info.context_length,
        eos_token_ids=tuple(target.info.eos_token_ids),
        speculative=SpecConfig("STANDALONE", num_draft_tokens=4) if draft else None))
    if draft is not None:
        sched.drafter = DraftModelDrafter(draft.forward_step, ROWS, draft.token_capacity,
                                          lambda: sched.running)
    for i, p in enumerate(PROMPTS):
        sched.add_request(GenerateReq(f"r{i}", p, SamplingParams(max_new_tokens=12,
                                                                  ignore_eos=True)))
    out: dict[str, list[int]] = {}
    while True:
        batch = sched.schedule()
        updates = sched.take_outputs()
        if batch is not None:
            updates += sched.postprocess(batch, target.forward_step(batch_inputs(batch)))
        for u in updates:
            assert u.error is None, u.error
            out.setdefault(u.rid, []).extend(u.new_token_ids)
        if batch is None and sched.is_idle:
            return [out[f"r{i}"] for i in range(len(PROMPTS))], sched


def test_a_gguf_draft_is_kept_quantized_beside_a_kept_target(tmp_path: Path) -> None:
    path = resolve_model_path(str(write_gguf(tmp_path / "t.gguf", qtype="Q4_0", seed=3)))
    # float32: every step through the dense copy, so verify steps (many rows) and plain
    # decode steps compute alike (in bfloat16 a few rows take the int4 kernel, many the
    # dense copy: a near-tie may go another way, as on any batch-size-dependent path)
    target = ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=1024,
                         max_running_requests=ROWS, quantization="gguf")
    draft = load_draft_runner(path, target, ROWS, 1024)
    assert draft.model.quant is not None and draft.dtype == target.dtype
    assert draft.model.quant.summary == target.model.quant.summary
    plain, _ = _generate(target, None)
    got, sched = _generate(target, draft)
    assert got == plain
    # the target as its own draft, kept the same way: every draft token is accepted
    assert sched.spec.drafted > 0 and sched.spec.accepted == sched.spec.drafted
    # a dense target (--gguf-dequantize) keeps a GGUF draft dense too
    dense = ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=512,
                        max_running_requests=ROWS)
    assert load_draft_runner(path, dense, ROWS, 512).model.quant is None
