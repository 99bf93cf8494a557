"""STANDALONE speculative decoding on the real engine (issue 47): a tiny target and a
perturbed copy of it as the draft model (tests/draft_models.py), the scheduler and both
runners in this process. Greedy outputs equal the plain engine's with drafts accepted (not
all); sampled requests finish with their lengths; retraction mid-run and a flush drop the
draft KV and change no output; a draft of another vocabulary is refused."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig
from sglang_admin.scheduler.speculative.policy import SpecConfig

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.scheduler.rank.model_step import batch_inputs  # noqa: E402
from sglang_admin.scheduler.speculative.draft_drafter import DraftModelDrafter  # noqa: E402
from sglang_admin.scheduler.speculative.draft_model import (  # noqa: E402
    DraftModelError,
    check_draft_model,
    load_draft_runner,
)
from sglang_admin.scheduler.step_plan import retract  # noqa: E402
from tests.draft_models import build_other_vocab, build_pair  # noqa: E402

ROWS = 16
PROMPTS = [[(5 * i + 3 * j) % 300 + 2 for j in range(6)] * 3 for i in range(6)]
PROMPTS += [[(11 * i + 7 * j) % 310 + 3 for j in range(17)] for i in range(3)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[tuple[Path, ModelRunner, ModelRunner]]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("standalone")
    target_path, draft_path = build_pair(root)
    target = ModelRunner(str(target_path), device="cpu", dtype="float32",
                         max_total_tokens=4096, max_running_requests=ROWS)
    draft = load_draft_runner(str(draft_path), target, ROWS, 4096)
    yield root, target, draft


def engine(target: ModelRunner, draft: ModelRunner | None) -> Scheduler:
    target.reset()
    spec = SpecConfig("STANDALONE", num_draft_tokens=5) if draft is not None else None
    sched = Scheduler(SchedulerConfig(
        token_capacity=target.token_capacity, max_running_requests=ROWS,
        max_prefill_tokens=2048, context_length=target.info.context_length,
        eos_token_ids=tuple(target.info.eos_token_ids), speculative=spec))
    if draft is not None:
        sched.drafter = DraftModelDrafter(draft.forward_step, ROWS, draft.token_capacity,
                                          lambda: sched.running)
    return sched


def run(sched: Scheduler, target: ModelRunner, reqs: list[GenerateReq],
        retract_at: int = -1) -> dict[str, list[int]]:
    """Every request to its end (the newest running one retracted at step ``retract_at``);
    the output tokens by rid."""
    for r in reqs:
        sched.add_request(r)
    out: dict[str, list[int]] = {}
    for step in range(10_000):
        if step == retract_at and len(sched.running) > 1:
            retract(sched, sched.running[-1])
        batch = sched.schedule()
        updates = sched.take_outputs()
        if batch is not None:
            updates += sched.postprocess(batch, target.forward_step(batch_inputs(batch)))
        for u in updates:
            assert u.error is None, u.error
            out.setdefault(f"{u.rid}/{u.index}", []).extend(u.new_token_ids)
        if batch is None and sched.is_idle:
            assert sched.num_used_tokens == 0
            return out
    raise AssertionError("engine did not finish")


def greedy(n: int = 40) -> list[GenerateReq]:
    return [GenerateReq(f"g{i}", p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]


def test_greedy_equals_the_plain_engine_with_drafts_accepted(pair) -> None:
    _, target, draft = pair
    plain = run(engine(target, None), target, greedy())
    sched = engine(target, draft)
    got = run(sched, target, greedy())
    assert got == plain
    assert 0 < sched.spec.accepted < sched.spec.drafted, "drafts never or always accepted"
    # the draft KV of ended requests goes back at the next drafting step or the flush
    sched.flush()
    assert sched.drafter.used_slots == 0 and not sched.drafter.rows


def test_the_target_as_its_own_draft_has_every_draft_accepted(pair) -> None:
    """The draft KV follows each request exactly: a draft model equal to the target
    proposes the target's own greedy tokens, so every draft token is accepted."""
    root, target, _ = pair
    same = load_draft_runner(str(root / "target"), target, ROWS, 2048)
    plain = run(engine(target, None), target, greedy(30))
    sched = engine(target, same)
    assert run(sched, target, greedy(30)) == plain
    assert sched.spec.drafted > 0 and sched.spec.accepted == sched.spec.drafted


def test_retraction_mid_run_and_flush_keep_the_plain_output(pair) -> None:
    _, target, draft = pair
    plain = run(engine(target, None), target, greedy(30))
    sched = engine(target, draft)
    assert run(sched, target, greedy(30), retract_at=6) == plain
    assert sched.num_retracted == 1 and sched.spec.accepted > 0
    sched.flush()
    assert run(sched, target, greedy(30)) == plain  # drafts recomputed from nothing


def test_sampled_requests_finish_with_their_lengths(pair) -> None:
    _, target, draft = pair
    sched = engine(target, draft)
    reqs = [GenerateReq(f"s{i}", p, SamplingParams(temperature=0.8, top_p=0.9,
                                                    max_new_tokens=25, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    out = run(sched, target, reqs)
    assert sorted(len(v) for v in out.values()) == [25] * len(PROMPTS)
    assert all(0 <= t < 320 for v in out.values() for t in v)
    assert sched.spec.verify_steps > 0


def _sampled(target: ModelRunner, draft: ModelRunner | None, count: int, seed: int
             ) -> tuple[list[list[int]], Scheduler]:
    target.generator.manual_seed(seed)
    params = SamplingParams(temperature=0.7, max_new_tokens=4, ignore_eos=True)
    reqs = [GenerateReq(f"c{i}", PROMPTS[0], params) for i in range(count)]
    sched = engine(target, draft)
    return list(run(sched, target, reqs).values()), sched


def test_sampled_tokens_keep_the_target_distribution(pair) -> None:
    """Greedy drafts verified against sampled rows (a point-mass draft distribution): the
    2nd to 4th tokens' distributions equal the plain engine's (chi-square at 0.999, 300
    samples each), drafts accepted and rejected both."""
    from tests.unit.test_speculative_engine import _chi2_critical, _chi_square

    _, target, draft = pair
    off, _ = _sampled(target, None, 300, seed=1)
    on, sched = _sampled(target, draft, 300, seed=2)
    assert 0 < sched.spec.accepted < sched.spec.drafted
    for pos in (1, 2, 3):
        stat, dof = _chi_square(Counter(s[pos] for s in off), Counter(s[pos] for s in on))
        assert dof >= 1
        assert stat < _chi2_critical(dof), (pos, stat, dof)


def test_a_draft_model_of_another_vocabulary_is_refused(pair) -> None:
    root, target, _ = pair
    other = build_other_vocab(root)
    why = "the draft model's vocabulary (256 tokens) differs from the target's (320)"
    assert check_draft_model(str(other), str(root / "target")) == why
    with pytest.raises(DraftModelError, match=r"vocabulary \(256 tokens\)"):
        load_draft_runner(str(other), target, ROWS, 1024)
    assert "does not load" in check_draft_model(str(root / "nothing"), str(root / "target"))
