"""The real engine (scheduler + model runner) under a tiny KV pool: eviction and retraction
change no output and leak no slot."""

from __future__ import annotations

import random

import pytest

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig

torch = pytest.importorskip("torch")
from sglang_admin.model.runner import ModelRunner, SeqInput  # noqa: E402

POOL = 512


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.set_num_threads(1)
    return ModelRunner(None, device="cpu", dtype="float32", max_total_tokens=POOL,
                       max_running_requests=32)


def _engine(runner: ModelRunner) -> Scheduler:
    runner.reset()
    return Scheduler(
        SchedulerConfig(
            token_capacity=runner.token_capacity, max_running_requests=32,
            max_prefill_tokens=256, context_length=runner.info.context_length,
            eos_token_ids=tuple(runner.info.eos_token_ids),
        )
    )


def _drive(runner: ModelRunner, sched: Scheduler) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(20_000):
        batch = sched.schedule()
        updates = sched.take_outputs()
        if batch is not None:
            seqs = [
                SeqInput(sp.req.req_idx, sp.start, sp.req.fill_ids[sp.start:sp.end],
                         sp.table_start, sp.req.slots[sp.table_start:sp.end],
                         sp.req.sampling.params,
                         sp.req.prompt_ids, sp.req.output_ids, sample=sp.sample)
                for sp in batch.spans
            ]
            results = runner.forward_step(seqs)
            updates += sched.postprocess(batch, results)
        for u in updates:
            assert u.error is None, u.error
            out.setdefault(u.rid, []).extend(u.new_token_ids)
        if batch is None and sched.is_idle:
            return out
    raise AssertionError("engine did not finish")


def test_tiny_pool_32_requests_equal_solo_and_leak_nothing(runner: ModelRunner) -> None:
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(30)]
    work = []
    for i in range(32):
        prompt = shared[: rng.randrange(0, 30)] + [rng.randrange(3, 250) for _ in range(rng.randrange(5, 40))]
        work.append((f"r{i}", prompt, rng.randrange(20, 60)))

    solo = {}
    for rid, prompt, n in work:
        sched = _engine(runner)
        sched.add_request(GenerateReq(rid, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        solo[rid] = _drive(runner, sched)[rid]

    sched = _engine(runner)
    for rid, prompt, n in work:
        sched.add_request(GenerateReq(rid, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    together = _drive(runner, sched)
    assert sched.num_retracted > 0, "the pool was meant to be too small for all at once"
    for rid, _, n in work:
        assert len(together[rid]) == n
        assert together[rid] == solo[rid], rid
    assert sched.cache.protected_size == 0
    assert sched.allocator.available + sched.cache.total_size() == POOL
    sched.flush()
    assert sched.allocator.available == POOL
