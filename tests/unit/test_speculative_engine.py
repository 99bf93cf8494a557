"""Speculative decoding on the real engine (issue 47): the embedded model's scheduler and
runner in this process, the same requests with NGRAM on and off. Greedy outputs equal token
for token (logprobs, penalties, stop tokens, min_new_tokens, n > 1 included) with drafts
accepted; sampled outputs keep the target's distribution (a chi-square test)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig
from sglang_admin.scheduler.speculative.policy import SpecConfig

torch = pytest.importorskip("torch")
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.scheduler.rank.model_step import batch_inputs  # noqa: E402

# prompts on which the embedded model's greedy output falls into a loop (found by a probe):
# n-gram drafts get accepted there
LOOPING = [[132] * 20, [220] * 20, [72] * 20, [12] * 20, [116] * 20]
OTHER = [[(7 * j + 3) % 200 + 20 for j in range(30)]]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.set_num_threads(1)
    return ModelRunner(None, device="cpu", dtype="float32", max_total_tokens=8192,
                       max_running_requests=64, seed=0)


def engine(runner: ModelRunner, spec: SpecConfig | None) -> Scheduler:
    runner.reset()
    return Scheduler(SchedulerConfig(
        token_capacity=runner.token_capacity, max_running_requests=64,
        max_prefill_tokens=2048, context_length=runner.info.context_length,
        eos_token_ids=tuple(runner.info.eos_token_ids), speculative=spec))


def run(runner: ModelRunner, spec: SpecConfig | None, reqs: list[GenerateReq]
        ) -> tuple[dict[str, dict], Scheduler]:
    """Every request to its end: per output key (rid, sample index) its tokens, logprobs
    and finish reason; and the scheduler (its accept figures)."""
    sched = engine(runner, spec)
    for r in reqs:
        sched.add_request(r)
    out: dict[str, dict] = {}
    for _ in range(100_000):
        batch = sched.schedule()
        updates = sched.take_outputs()
        if batch is not None:
            updates += sched.postprocess(batch, runner.forward_step(batch_inputs(batch)))
        for u in updates:
            assert u.error is None, u.error
            o = out.setdefault(f"{u.rid}/{u.index}", {"ids": [], "lps": [], "tops": []})
            o["ids"] += u.new_token_ids
            o["lps"] += u.logprobs
            o["tops"] += u.top_logprobs
            if u.finish_reason is not None:
                o["finish"] = (u.finish_reason, u.matched_token_id)
        if batch is None and sched.is_idle:
            assert sched.num_used_tokens == 0
            assert (sched.allocator.available + sched.cache.total_size()
                    == sched.allocator.capacity)
            return out, sched
    raise AssertionError("engine did not finish")


def greedy_reqs(**params) -> list[GenerateReq]:
    return [GenerateReq(f"g{i}", p, SamplingParams(**params))
            for i, p in enumerate(LOOPING + OTHER)]


@pytest.mark.parametrize("params", [
    dict(max_new_tokens=48, ignore_eos=True),
    dict(max_new_tokens=40, frequency_penalty=0.3, repetition_penalty=1.1, ignore_eos=True),
    dict(max_new_tokens=40, min_new_tokens=9, stop_token_ids=[32, 34, 60]),
], ids=["plain", "penalties", "stops"])
def test_greedy_outputs_equal_the_plain_worker_token_for_token(runner, params) -> None:
    off, _ = run(runner, None, greedy_reqs(**params))
    on, sched = run(runner, SpecConfig(num_draft_tokens=6), greedy_reqs(**params))
    assert sched.spec.accepted > 0, "no draft accepted: the test proves nothing"
    for key in off:
        assert on[key]["ids"] == off[key]["ids"], key
        assert on[key]["finish"] == off[key]["finish"], key


def test_logprobs_and_n_samples_per_accepted_token(runner) -> None:
    def reqs() -> list[GenerateReq]:
        return [GenerateReq(f"l{i}", p, SamplingParams(max_new_tokens=32, ignore_eos=True),
                            return_logprob=True, top_logprobs_num=3, n=2,
                            token_ids_logprob=[5, 32])
                for i, p in enumerate(LOOPING[:3])]

    off, _ = run(runner, None, reqs())
    on, sched = run(runner, SpecConfig(num_draft_tokens=4), reqs())
    assert sched.spec.accepted > 0
    assert set(on) == set(off) and len(on) == 6
    for key in off:
        assert on[key]["ids"] == off[key]["ids"], key
        assert len(on[key]["lps"]) == len(on[key]["ids"]) == len(on[key]["tops"])
        assert on[key]["lps"] == pytest.approx(off[key]["lps"], abs=1e-4), key
        assert [[t for t, _ in top] for top in on[key]["tops"]] == \
            [[t for t, _ in top] for top in off[key]["tops"]], key


def _first_tokens(runner: ModelRunner, spec: SpecConfig | None, count: int, seed: int
                  ) -> tuple[list[tuple[int, ...]], Scheduler]:
    runner.generator.manual_seed(seed)
    params = SamplingParams(temperature=0.7, max_new_tokens=4, ignore_eos=True)
    reqs = [GenerateReq(f"s{i}", LOOPING[0], params) for i in range(count)]
    out, sched = run(runner, spec, reqs)
    return [tuple(o["ids"]) for o in out.values()], sched


def _chi_square(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Two-sample chi-square statistic over categories pooled below min_count; its dof."""
    cats = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cats if a[c] + b[c] >= min_count]
    rest = [c for c in cats if a[c] + b[c] < min_count]
    na, nb = sum(a.values()), sum(b.values())
    groups = [[c] for c in big] + ([rest] if rest else [])
    stat = 0.0
    for g in groups:
        oa, ob = sum(a[c] for c in g), sum(b[c] for c in g)
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return stat, len(groups) - 1


def _chi2_critical(dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square 0.999 quantile."""
    z = 3.09
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampled_tokens_keep_the_target_distribution(runner) -> None:
    """Rejection sampling against point-mass drafts: the 2nd to 4th sampled tokens'
    distributions with NGRAM equal the plain worker's (chi-square at 0.999, 400 samples
    each); drafts were accepted and rejected both."""
    off, _ = _first_tokens(runner, None, 400, seed=1)
    on, sched = _first_tokens(runner, SpecConfig(num_draft_tokens=3), 400, seed=2)
    assert 0 < sched.spec.accepted < sched.spec.drafted
    for pos in (1, 2, 3):
        stat, dof = _chi_square(Counter(s[pos] for s in off), Counter(s[pos] for s in on))
        assert dof >= 1
        assert stat < _chi2_critical(dof), (pos, stat, dof)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_transformers_checkpoints_spec_on_equals_off(kind, tmp_path) -> None:
    """A tiny random Llama and Qwen2 (transformers' save_pretrained): greedy outputs with
    NGRAM equal those without, drafts accepted."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.lora_models import build_base

    path = build_base(kind, tmp_path / kind)
    tiny = ModelRunner(str(path), device="cpu", dtype="float32", max_total_tokens=4096,
                       max_running_requests=16)
    prompts = [[(5 * i + 3 * j) % 300 + 2 for j in range(6)] * 4 for i in range(12)]

    def reqs() -> list[GenerateReq]:
        return [GenerateReq(f"t{i}", p, SamplingParams(max_new_tokens=40, ignore_eos=True))
                for i, p in enumerate(prompts)]

    off, _ = run(tiny, None, reqs())
    on, sched = run(tiny, SpecConfig(num_draft_tokens=5), reqs())
    assert sched.spec.accepted > 0
    assert on == off


@pytest.mark.parametrize("seed", [3])
def test_fuzz_random_settings_and_requests_never_fail_a_request(runner, seed) -> None:
    """Random NGRAM settings and random requests (repeating or not; greedy or sampled;
    penalties, logprobs, stop ids, min_new_tokens, n) on the real engine: no request fails,
    nothing leaks (run() checks), and the greedy ones equal the plain engine's."""
    import random

    rng = random.Random(seed)
    spec = SpecConfig(num_draft_tokens=rng.randint(1, 64), min_window=(lo := rng.randint(1, 3)),
                      max_window=rng.randint(lo, 16))

    def reqs() -> list[GenerateReq]:
        r = random.Random(seed + 1)
        out = []
        for i in range(24):
            unit = [r.randrange(3, 255) for _ in range(r.randint(1, 5))]
            prompt = (unit * 40)[: r.randint(2, 80)]
            params = SamplingParams(
                temperature=r.choice([0.0, 0.0, 0.8]), top_k=r.choice([-1, 5]),
                max_new_tokens=r.randint(1, 40), min_new_tokens=r.choice([0, 3]),
                frequency_penalty=r.choice([0.0, 0.5]), stop_token_ids=r.choice([[], [34]]),
                ignore_eos=r.random() < 0.5)
            out.append(GenerateReq(f"z{i}", prompt, params, return_logprob=r.random() < 0.3,
                                   n=r.choice([1, 1, 2])))
        return out

    off, _ = run(runner, None, reqs())
    on, _ = run(runner, spec, reqs())
    assert set(on) == set(off)
    for r in reqs():
        if r.sampling.temperature == 0.0:
            for key in [k for k in off if k.startswith(f"{r.rid}/")]:
                assert on[key]["ids"] == off[key]["ids"], key


def test_bfloat16_spec_on_equals_off(tmp_path) -> None:
    """NGRAM on a bfloat16 runner (the tiny random Llama): greedy outputs with drafts
    equal those without on the same dtype, drafts accepted."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.lora_models import build_base

    path = build_base("llama", tmp_path / "llama")
    tiny = ModelRunner(str(path), device="cpu", dtype="bfloat16", max_total_tokens=4096,
                       max_running_requests=16)
    prompts = [[(5 * i + 3 * j) % 300 + 2 for j in range(6)] * 4 for i in range(12)]

    def reqs() -> list[GenerateReq]:
        return [GenerateReq(f"b{i}", p, SamplingParams(max_new_tokens=40, ignore_eos=True))
                for i, p in enumerate(prompts)]

    off, _ = run(tiny, None, reqs())
    on, sched = run(tiny, SpecConfig(num_draft_tokens=5), reqs())
    assert sched.spec.accepted > 0
    assert on == off
