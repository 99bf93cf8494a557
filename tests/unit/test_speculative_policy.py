"""Speculative decoding in the batching policy (issue 47), against a fake model that checks
every KV slot it reads: n-gram lookup, the settings' checks, the verify spans' KV (rejected
draft tokens' slots freed at once, the figures adding up after every step, no leak after
1000 requests with random accept lengths) and the stop checks inside an accepted run."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.model.step_io import SeqOutput
from sglang_admin.scheduler.request import Batch, Req
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig
from sglang_admin.scheduler.speculative.policy import (
    SpecConfig,
    SpecProgress,
    check_config,
    ngram_lookup,
)
from tests.unit.test_scheduler import VOCAB, next_token, solo


def _lookup(seq: list[int], k: int, lo: int = 1, hi: int = 12) -> list[int]:
    prog = SpecProgress(k)
    where: dict[int, list[int]] = {}
    for i, t in enumerate(seq):
        where.setdefault(t, []).append(i)
    prog.tokens = seq
    return ngram_lookup(seq, where, k, lo, hi)


def test_ngram_lookup_takes_the_longest_then_latest_match() -> None:
    # "1 2 3" occurs twice: the later occurrence's continuation wins
    assert _lookup([1, 2, 3, 7, 8, 1, 2, 3, 9, 5, 1, 2, 3], 2) == [9, 5]
    # a longer suffix match (4 tokens: 0 1 2 3) beats a later shorter one (1 2 3)
    assert _lookup([0, 1, 2, 3, 7, 8, 6, 1, 2, 3, 9, 5, 0, 1, 2, 3], 3) == [7, 8, 6]
    # the continuation stops at the sequence's end, unless the text loops
    assert _lookup([4, 5, 4], 8) == [5, 4]
    assert _lookup([9, 4, 5, 4, 5, 4], 5) == [5, 4, 5, 4, 5]
    assert _lookup([34, 34, 34], 4) == [34, 34, 34, 34]
    # no earlier occurrence, or one shorter than the minimum window: no draft
    assert _lookup([1, 2, 3], 4) == []
    assert _lookup([9, 2, 1, 2], 4, lo=2) == []
    assert _lookup([1, 2, 9, 1, 2], 4, lo=2) == [9, 1, 2]


def test_settings_are_checked_with_a_clear_reason() -> None:
    assert check_config(None, None, 1, 12) is None
    assert check_config("NGRAM", 4, 1, 12) is None
    assert "not one of" in check_config("EAGLE", 4, 1, 12)
    assert "out of range" in check_config("NGRAM", 0, 1, 12)
    assert "out of range" in check_config("NGRAM", 65, 1, 12)
    assert "min <= max" in check_config("NGRAM", 4, 5, 2)
    assert "needs --speculative-draft-model-path" in check_config("STANDALONE", 4, 1, 12)
    assert check_config("STANDALONE", 4, 1, 12, "/m") is None
    assert "STANDALONE" in check_config(None, None, 1, 12, "/m")


class OracleDrafter:
    """Drafts the fake model's true continuation, corrupted at a random place (or not at
    all): random accept lengths, every one of 0..k."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        drafts = []
        for req, limit in zip(reqs, limits):
            k = self.rng.randint(0, limit)
            draft = solo(req.fill_ids, k) if k else []
            if draft and self.rng.random() < 0.6:
                bad = self.rng.randrange(len(draft))
                draft[bad] = 1 + (draft[bad] % (VOCAB - 1))  # another token
            drafts.append(draft)
        return drafts


class SpecFakeRunner:
    """The fake model of test_scheduler.py, verifying drafts: it writes every span token's
    KV into its slot, checks what it reads back, and answers a verify span with the run a
    greedy target gives (accepted draft tokens, then its own)."""

    def __init__(self, capacity: int, rows: int, context: int) -> None:
        self.kv: list[tuple[int, int] | None] = [None] * (capacity + 1)
        self.table = [[0] * context for _ in range(rows)]

    def run(self, batch: Batch) -> list[SeqOutput | None]:
        out: list[SeqOutput | None] = []
        for sp in batch.spans:
            req = sp.req
            row = self.table[req.req_idx]
            row[sp.table_start : sp.end] = req.slots[sp.table_start : sp.end]
            fill = req.fill_ids[: sp.start + 1] + (sp.draft or []) if sp.draft else req.fill_ids
            assert len(fill) >= sp.end
            for pos in range(sp.start, sp.end):
                slot = row[pos]
                assert 1 <= slot < len(self.kv), f"bad slot {slot}"
                self.kv[slot] = (fill[pos], pos)
            seen = [self.kv[row[p]] for p in range(sp.end)]
            assert [s[0] for s in seen] == fill[: sp.end], f"corrupt KV for {req.rid}"
            assert [s[1] for s in seen] == list(range(sp.end))
            if not sp.sample:
                out.append(None)
                continue
            if not sp.draft:
                out.append(SeqOutput(next_token(fill[: sp.end])))
                continue
            run = []
            for i in range(len(sp.draft) + 1):
                token = next_token(fill[: sp.start + 1 + i])
                run.append(SeqOutput(token))
                if i == len(sp.draft) or token != sp.draft[i]:
                    break
            run[0].more = run[1:]
            out.append(run[0])
        return out


def _sched(capacity: int, rows: int = 16, context: int = 512, k: int = 6) -> Scheduler:
    return Scheduler(SchedulerConfig(
        token_capacity=capacity, max_running_requests=rows, max_prefill_tokens=256,
        context_length=context, eos_token_ids=(0,),
        speculative=SpecConfig(num_draft_tokens=k)))


def _figures_add_up(sched: Scheduler) -> None:
    assert (sched.num_used_tokens + sched.cache.evictable_size + sched.num_free_tokens
            == sched.allocator.capacity)


def _drive(sched: Scheduler, runner: SpecFakeRunner) -> dict[str, list]:
    tokens: dict[str, list[int]] = {}
    finals: dict[str, object] = {}
    for _ in range(200_000):
        batch = sched.schedule()
        outs = sched.take_outputs()
        if batch is not None:
            outs += sched.postprocess(batch, runner.run(batch))
        _figures_add_up(sched)
        for o in outs:
            assert o.error is None, o.error
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finals[o.rid] = o
        if batch is None and sched.is_idle:
            return {"tokens": tokens, "finals": finals}
    raise AssertionError("did not finish")


def test_1000_requests_with_random_accept_lengths_equal_solo_and_leak_nothing() -> None:
    rng = random.Random(47)
    capacity = 1500  # small: eviction and retraction happen beside the drafts
    sched = _sched(capacity)
    sched.drafter = OracleDrafter(rng)
    runner = SpecFakeRunner(capacity, 16, 512)
    shared = [rng.randrange(1, VOCAB) for _ in range(40)]
    prompts: dict[str, list[int]] = {}
    lengths: dict[str, int] = {}
    for wave in range(10):
        for i in range(100):
            rid = f"w{wave}r{i}"
            prompt = (shared if i % 3 == 0 else []) + [
                rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
            prompts[rid], lengths[rid] = prompt, rng.randrange(1, 40)
            sched.add_request(GenerateReq(rid, prompt, SamplingParams(
                max_new_tokens=lengths[rid], ignore_eos=True)))
        res = _drive(sched, runner)
        for rid in [r for r in prompts if r.startswith(f"w{wave}r")]:
            assert res["tokens"][rid] == solo(prompts[rid], lengths[rid]), rid
        assert sched.num_used_tokens == 0 and sched.cache.protected_size == 0
        assert sched.allocator.available + sched.cache.total_size() == capacity
    sched.allocator.check()
    spec = sched.spec
    assert spec.verify_steps > 1000 and 0 < spec.accepted < spec.drafted
    assert spec.accept_length > 1.0
    # the prefix cache holds only accepted tokens: every cached path is some request's
    # prompt + output prefix, so a new request with a finished one's sequence reuses it
    # (the fake model's KV check above would catch a draft token's KV in the tree)


def test_drafts_run_on_a_pool_full_of_evictable_cache() -> None:
    """A long-running worker's pool is full of prefix cache nobody holds: drafts evict from
    it as a decode step's tokens do (they waited for free slots before), and nothing leaks."""
    capacity = 256
    sched = _sched(capacity)
    sched.drafter = _PerfectDrafter()
    runner = SpecFakeRunner(capacity, 16, 512)
    shared = [2] * 30
    for i in range(140):  # one shared prefix, then 2 tokens of each: leaves of 2 tokens, so
        # an eviction frees 2 slots at a time, less than a draft needs
        prompt = shared + [1 + i % (VOCAB - 1), 1 + (i // (VOCAB - 1)) % (VOCAB - 1)]
        sched.add_request(GenerateReq(f"fill{i}", prompt, SamplingParams(
            max_new_tokens=1, ignore_eos=True)))
    sched.drafter = None
    _drive(sched, runner)
    assert sched.allocator.available <= 2 and sched.cache.evictable_size >= 250  # full
    sched.drafter = _PerfectDrafter()
    prompt = [3, 5, 7, 11]
    sched.add_request(GenerateReq("r", prompt, SamplingParams(max_new_tokens=20,
                                                              ignore_eos=True)))
    res = _drive(sched, runner)
    assert res["tokens"]["r"] == solo(prompt, 20)
    assert sched.spec.accepted > 0
    assert sched.num_used_tokens == 0
    assert sched.allocator.available + sched.cache.total_size() == capacity


def test_stops_inside_an_accepted_run_truncate_it() -> None:
    """A run of accepted tokens meets a stop token, a stop token id, max_new_tokens: the
    output ends at the first stop, exactly as without speculation."""
    prompt = [5, 9, 13, 2, 44]
    full = solo(prompt, 30)
    cases = {
        "len": SamplingParams(max_new_tokens=7, ignore_eos=True),
        "stop_id": SamplingParams(max_new_tokens=30, stop_token_ids=[full[11]]),
        "min_new": SamplingParams(max_new_tokens=30, stop_token_ids=[full[3]],
                                  min_new_tokens=5),
    }
    for rid, params in cases.items():
        results = {}
        for spec in (False, True):
            sched = _sched(512)
            sched.drafter = _PerfectDrafter() if spec else None
            runner = SpecFakeRunner(512, 16, 512)
            sched.add_request(GenerateReq(rid, prompt, params))
            results[spec] = _drive(sched, runner)
            assert sched.allocator.available + sched.cache.total_size() == 512
        assert sched.spec.accepted > 0
        on, off = results[True], results[False]
        assert on["tokens"][rid] == off["tokens"][rid], rid
        assert on["finals"][rid].finish_reason == off["finals"][rid].finish_reason
        assert on["finals"][rid].matched_token_id == off["finals"][rid].matched_token_id


class _PerfectDrafter:
    """Always the true continuation, as long as allowed."""

    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        return [solo(req.fill_ids, limit) for req, limit in zip(reqs, limits)]

    def reset(self) -> None:
        """Nothing kept between steps."""


@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_random_settings_and_prompts_never_break_the_policy(seed: int) -> None:
    """Random spec settings, n-gram drafts from random prompts (repeating or not): outputs
    equal solo, figures add up, nothing leaks."""
    rng = random.Random(seed)
    k = rng.randint(1, 64)
    lo = rng.randint(1, 4)
    hi = rng.randint(lo, 16)
    sched = Scheduler(SchedulerConfig(
        token_capacity=600, max_running_requests=8, max_prefill_tokens=64,
        context_length=256, eos_token_ids=(0,),
        speculative=SpecConfig(num_draft_tokens=k, min_window=lo, max_window=hi)))
    runner = SpecFakeRunner(600, 8, 256)
    prompts = {}
    for i in range(30):
        unit = [rng.randrange(1, 5) for _ in range(rng.randint(1, 6))]
        prompt = (unit * rng.randint(1, 20))[: rng.randint(1, 120)]
        prompts[f"f{i}"] = (prompt, rng.randint(1, 140))
        sched.add_request(GenerateReq(f"f{i}", prompt, SamplingParams(
            max_new_tokens=prompts[f"f{i}"][1], ignore_eos=True)))
    res = _drive(sched, runner)
    for rid, (prompt, n) in prompts.items():
        got = res["tokens"][rid]
        assert got == solo(prompt, len(got)), rid
        assert len(got) == n or len(prompt) + len(got) >= 255
    assert sched.num_used_tokens == 0
    assert sched.allocator.available + sched.cache.total_size() == 600


def test_draft_length_follows_the_acceptance_estimate_and_shadows_teach_it() -> None:
    prog = SpecProgress(8)
    assert prog.draft_length(8) > 0  # the initial estimate drafts
    for _ in range(6):
        prog.verified(4, 0)  # rejected at once, again and again
    assert prog.draft_length(8) == 0  # speculation off for this request
    # a shadow draft (not run) judged against what the request then decodes
    prog.shadow, prog.shadow_at = [7, 8, 9], 10
    out = list(range(10))
    prog.judge_shadow(out + [7, 8])
    assert prog.shadow  # all matched so far: wait
    for _ in range(5):
        prog.shadow, prog.shadow_at = [7, 8, 9], 10
        prog.judge_shadow(out + [7, 8, 9])
        assert not prog.shadow
    assert prog.draft_length(8) >= 4  # repeating text: long drafts again
    prog.shadow, prog.shadow_at = [7, 8, 9], 10
    before = prog.rate
    prog.judge_shadow(out + [7, 5])
    assert not prog.shadow and prog.rate < before


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_mid_speculation_then_continue_changes_no_output(mode: str) -> None:
    """Pause (retract frees each request's KV, drafts hold none between steps) and continue:
    the outputs are the plain ones, nothing leaks, the flush after finds an idle pool."""
    rng = random.Random(5)
    sched = _sched(2000)
    sched.drafter = _PerfectDrafter()
    runner = SpecFakeRunner(2000, 16, 512)
    prompts = {f"p{i}": [rng.randrange(1, VOCAB) for _ in range(12)] for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add_request(GenerateReq(rid, prompt, SamplingParams(max_new_tokens=60,
                                                                  ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    for _ in range(4):  # a few steps in, with drafts verified
        batch = sched.schedule()
        assert batch is not None
        for o in sched.postprocess(batch, runner.run(batch)):
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
    assert sched.spec.accepted > 0
    sched.pause(mode)
    assert sched.schedule() is None
    _figures_add_up(sched)
    sched.resume()
    res = _drive(sched, runner)
    for rid, prompt in prompts.items():
        assert tokens.get(rid, []) + res["tokens"].get(rid, []) == solo(prompt, 60), rid
    assert sched.num_used_tokens == 0
    sched.flush()
    assert sched.num_free_tokens == 2000
