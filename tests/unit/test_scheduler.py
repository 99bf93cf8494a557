"""The batching policy against a fake model that reads its context from a fake KV pool.

The fake model writes each token into the KV slot the scheduler gave it and computes the
next token from what it reads back through the request's table row. Any slot mistake
(a freed slot reused while still cached, a prefix matched to the wrong slots, a leaked
or double-owned slot) changes the tokens read back and so the outputs.
"""

from __future__ import annotations

import random

import pytest

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.model.step_io import SeqOutput
from sglang_admin.scheduler import postprocess, step_plan
from sglang_admin.scheduler.request import Batch
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig

VOCAB = 97
EOS = 0


def next_token(seq: list[int]) -> int:
    """A deterministic 'model': depends on the whole sequence (order included)."""
    h = 7
    for i, t in enumerate(seq):
        h = (h * 31 + t * (i % 5 + 1)) % 1_000_003
    return 1 + h % (VOCAB - 1)  # never EOS


def solo(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
    return out


class FakeRunner:
    def __init__(self, capacity: int, rows: int, context: int) -> None:
        self.kv: list[tuple[int, int] | None] = [None] * (capacity + 1)
        self.table = [[0] * context for _ in range(rows)]
        self.steps = 0

    def run(self, batch: Batch) -> list[SeqOutput | None]:
        """One result per span: the next token of each span that samples."""
        self.steps += 1
        out: list[SeqOutput | None] = []
        for sp in batch.spans:
            req = sp.req
            row = self.table[req.req_idx]
            row[sp.table_start : sp.end] = req.slots[sp.table_start : sp.end]
            fill = req.fill_ids
            for pos in range(sp.start, sp.end):
                slot = row[pos]
                assert 1 <= slot < len(self.kv), f"bad slot {slot}"
                self.kv[slot] = (fill[pos], pos)
            seen = [self.kv[row[p]] for p in range(sp.end)]
            assert all(s is not None for s in seen), "read an empty KV slot"
            # The KV read back must be exactly this sequence's tokens at their positions.
            assert [s[0] for s in seen] == fill[: sp.end], f"corrupt KV for {req.rid}"
            assert [s[1] for s in seen] == list(range(sp.end))
            out.append(SeqOutput(next_token(fill[: sp.end])) if sp.sample else None)
        return out


def make(capacity: int = 4096, rows: int = 64, prefill: int = 512, context: int = 2048):
    sched = Scheduler(
        SchedulerConfig(
            token_capacity=capacity,
            max_running_requests=rows,
            max_prefill_tokens=prefill,
            context_length=context,
            eos_token_ids=(EOS,),
        )
    )
    return sched, FakeRunner(capacity, rows, context)


def drive(sched: Scheduler, runner: FakeRunner, max_steps: int = 100_000) -> dict[str, list]:
    """Run until idle; collect each request's tokens and final output."""
    tokens: dict[str, list[int]] = {}
    finals: dict[str, object] = {}
    for _ in range(max_steps):
        batch = sched.schedule()
        outs = sched.take_outputs()
        if batch is not None:
            outs += sched.postprocess(batch, runner.run(batch))
        for o in outs:
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finals[o.rid] = o
        if batch is None and sched.is_idle:
            break
    return {"tokens": tokens, "finals": finals}


def req(rid: str, prompt: list[int], n: int, **kw) -> GenerateReq:
    return GenerateReq(rid, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), **kw)


def assert_no_leak(sched: Scheduler) -> None:
    assert sched.is_idle
    assert sched.cache.protected_size == 0
    assert sched.allocator.available + sched.cache.total_size() == sched.allocator.capacity
    assert sched.num_used_tokens == 0  # an idle rank holds no KV for requests, warm or not
    assert sched.num_free_tokens + sched.cache.evictable_size == sched.allocator.capacity


def test_single_request_matches_solo() -> None:
    sched, runner = make()
    prompt = [5, 9, 13, 2, 44]
    sched.add_request(req("a", prompt, 20))
    res = drive(sched, runner)
    assert res["tokens"]["a"] == solo(prompt, 20)
    final = res["finals"]["a"]
    assert final.finish_reason == "length" and final.completion_tokens == 20
    assert_no_leak(sched)


def test_concurrent_requests_equal_solo_and_prefix_is_reused() -> None:
    sched, runner = make(prefill=256)
    rng = random.Random(0)
    shared = [rng.randrange(1, VOCAB) for _ in range(300)]
    prompts = {}
    for i in range(16):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 50))]
        prompts[f"r{i}"] = (shared if i % 2 else []) + tail
        sched.add_request(req(f"r{i}", prompts[f"r{i}"], rng.randrange(1, 40)))
    res = drive(sched, runner)
    for rid, prompt in prompts.items():
        final = res["finals"][rid]
        assert res["tokens"][rid] == solo(prompt, final.completion_tokens), rid
    assert_no_leak(sched)
    # A later request with the shared prefix finds it cached.
    sched.add_request(req("again", shared + [3, 4], 3))
    res = drive(sched, runner)
    assert res["finals"]["again"].cached_tokens >= len(shared)
    assert res["tokens"]["again"] == solo(shared + [3, 4], 3)


def test_tiny_pool_evicts_and_retracts_without_wrong_tokens_or_leaks() -> None:
    sched, runner = make(capacity=512, rows=32, prefill=128)
    rng = random.Random(1)
    prefix = [rng.randrange(1, VOCAB) for _ in range(40)]
    prompts = {}
    for i in range(32):
        prompts[f"r{i}"] = prefix[: rng.randrange(0, 40)] + [
            rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 60))
        ]
        sched.add_request(req(f"r{i}", prompts[f"r{i}"], rng.randrange(10, 80)))
    res = drive(sched, runner)
    assert len(res["finals"]) == 32
    for rid, prompt in prompts.items():
        final = res["finals"][rid]
        assert final.finish_reason == "length", rid
        assert res["tokens"][rid] == solo(prompt, final.completion_tokens), rid
    assert sched.num_retracted > 0, "the pool was meant to be too small for all at once"
    assert_no_leak(sched)


def test_abort_and_expiry_free_everything() -> None:
    sched, runner = make()
    sched.add_request(req("keep", [1, 2, 3], 30))
    sched.add_request(req("abort", [4, 5, 6], 1000))
    sched.add_request(req("late", [7, 8], 10, deadline=0.0))  # already expired
    early = []
    for _ in range(3):
        batch = sched.schedule()
        early += sched.postprocess(batch, runner.run(batch))
    sched.abort("abort")
    res = drive(sched, runner)
    assert res["finals"]["abort"].finish_reason == "abort"
    late = [o for o in early if o.rid == "late"]
    assert late and late[0].error_code == "DEADLINE_EXCEEDED"
    keep = [t for o in early if o.rid == "keep" for t in o.new_token_ids]
    assert keep + res["tokens"]["keep"] == solo([1, 2, 3], 30)
    assert_no_leak(sched)


def test_stop_tokens_min_new_tokens_and_duplicates() -> None:
    sched, runner = make()
    prompt = [3, 1, 4, 1, 5]
    expected = solo(prompt, 10)
    stop = expected[4]
    sp = SamplingParams(max_new_tokens=10, stop_token_ids=[stop])
    sched.add_request(GenerateReq("s", prompt, sp))
    sched.add_request(GenerateReq("s", prompt, sp))  # duplicate id while in flight
    refused = sched.take_outputs()
    res = drive(sched, runner)
    # The duplicate is refused at once, alone; the first finishes at the stop token.
    assert [(o.rid, o.error_code, o.finish_reason) for o in refused] == [
        ("s", "ALREADY_EXISTS", "abort")]
    final = res["finals"]["s"]
    assert (final.finish_reason, final.error_code) == ("stop", None)
    first_stop = expected.index(stop) + 1
    assert res["tokens"]["s"] == expected[:first_stop]


def test_chunked_prefill_of_a_long_prompt() -> None:
    sched, runner = make(prefill=64)
    prompt = [random.Random(3).randrange(1, VOCAB) for _ in range(500)]
    sched.add_request(req("long", prompt, 5))
    res = drive(sched, runner)
    assert res["tokens"]["long"] == solo(prompt, 5)
    assert runner.steps >= 500 // 64 + 4
    assert_no_leak(sched)


def test_flush_resets_to_startup_state() -> None:
    sched, runner = make()
    sched.add_request(req("a", list(range(1, 60)), 5))
    drive(sched, runner)
    assert sched.cache.total_size() > 0
    freed = sched.flush()
    assert freed > 0
    assert sched.allocator.available == sched.allocator.capacity
    assert sched.cache.total_size() == 0
    assert sched.cache_hit_rate == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mix_never_leaks(seed: int) -> None:
    sched, runner = make(capacity=700, rows=16, prefill=100)
    rng = random.Random(seed)
    pending = 0
    expected = {}
    for step in range(400):
        if rng.random() < 0.3 and pending < 40:
            rid = f"q{step}"
            prompt = [rng.randrange(1, 10) for _ in range(rng.randrange(1, 80))]
            expected[rid] = prompt
            sched.add_request(req(rid, prompt, rng.randrange(1, 30)))
            pending += 1
        if rng.random() < 0.05 and expected:
            sched.abort(rng.choice(list(expected)))
        batch = sched.schedule()
        if batch is not None:
            sched.postprocess(batch, runner.run(batch))
        sched.take_outputs()
    drive(sched, runner)
    assert_no_leak(sched)


@pytest.mark.parametrize("seed", range(3))
def test_the_all_decode_step_schedules_what_the_general_loop_does(
    seed: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """schedule() takes a step in which every running request decodes with one allocation
    (step_plan.decode_all); under a random mix with evictions and retractions, a scheduler
    without that shortcut must give every step the same spans and slots."""
    def run(shortcut: bool) -> list[list[tuple]]:
        sched, runner = make(capacity=300, rows=12, prefill=64)
        monkeypatch.setattr(step_plan, "decode_all",
                            real_decode_all if shortcut else lambda state: [])
        rng = random.Random(seed)
        steps = []
        for step in range(300):
            if rng.random() < 0.25:
                prompt = [rng.randrange(1, 10) for _ in range(rng.randrange(1, 60))]
                sched.add_request(req(f"q{step}", prompt, rng.randrange(0, 40)))
            batch = sched.schedule()
            if batch is not None:
                steps.append([(sp.req.rid, sp.start, sp.end, sp.table_start, sp.sample,
                               tuple(sp.req.slots)) for sp in batch.spans])
                sched.postprocess(batch, runner.run(batch))
            sched.take_outputs()
        drive(sched, runner)
        assert_no_leak(sched)
        return steps

    real_decode_all = step_plan.decode_all
    with_shortcut = run(True)
    assert with_shortcut == run(False)
    assert sum(all(e - s == 1 for _, s, e, *_ in step) for step in with_shortcut) > 50


def _steps(sched: Scheduler, runner: FakeRunner, n: int, tokens: dict[str, list[int]]) -> None:
    for _ in range(n):
        batch = sched.schedule()
        outs = sched.take_outputs()
        if batch is not None:
            outs += sched.postprocess(batch, runner.run(batch))
        for o in outs:
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_holds_every_request_and_continue_finishes_them_unchanged(mode: str) -> None:
    sched, runner = make()
    prompts = {f"r{i}": [i + 1] * (5 + i) for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, 12))
    tokens: dict[str, list[int]] = {}
    _steps(sched, runner, 4, tokens)
    assert sched.pause(mode) == 4
    if mode == "retract":
        assert not sched.running and len(sched.waiting) == 4
        assert sched.cache.protected_size == 0  # no request holds KV: a flush may run
    else:
        assert len(sched.running) == 4
    sched.add_request(req("late", [9, 9, 9], 5))  # arrives while paused: waits
    steps = runner.steps
    _steps(sched, runner, 5, tokens)
    assert runner.steps == steps and "late" not in tokens
    sched.resume()
    result = drive(sched, runner)
    for rid, prompt in prompts.items():
        assert tokens[rid] + result["tokens"].get(rid, []) == solo(prompt, 12)
    assert result["tokens"]["late"] == solo([9, 9, 9], 5)
    assert_no_leak(sched)


def test_pause_abort_ends_every_request_and_new_ones_wait() -> None:
    sched, runner = make()
    for i in range(3):
        sched.add_request(req(f"r{i}", [i + 1] * 6, 20))
    _steps(sched, runner, 3, {})
    sched.add_request(req("queued", [5] * 4, 3))
    assert sched.pause("abort") == 4
    finals = {o.rid: o.finish_reason for o in sched.take_outputs() if o.finish_reason}
    assert finals == {"r0": "abort", "r1": "abort", "r2": "abort", "queued": "abort"}
    sched.add_request(req("new", [7] * 4, 3))
    assert sched.schedule() is None
    sched.resume()
    assert drive(sched, runner)["tokens"]["new"] == solo([7] * 4, 3)
    assert_no_leak(sched)
    with pytest.raises(ValueError, match="unknown pause mode 'later'"):
        sched.pause("later")


def test_paused_requests_still_expire() -> None:
    sched, runner = make()
    sched.add_request(req("r", [3] * 5, 10, deadline=1.0))  # long past
    sched.pause("in_place")
    assert sched.schedule() is None
    out = sched.take_outputs()
    assert [(o.rid, o.error_code) for o in out] == [("r", "DEADLINE_EXCEEDED")]
# ---------------------------------------------------------------- one request's fault (issue 17)


def _drive_with_faults(sched: Scheduler, runner: FakeRunner, errors_for: dict[str, int],
                       ) -> dict[str, list]:
    """Like drive(), but the request named in errors_for fails at that output position
    (as the sampler reports a row with no token left)."""
    tokens: dict[str, list[int]] = {}
    finals: dict[str, object] = {}
    for _ in range(100_000):
        batch = sched.schedule()
        outs = sched.take_outputs()
        if batch is not None:
            results = runner.run(batch)
            for sp, result in zip(batch.spans, results):
                if sp.sample and errors_for.get(sp.req.rid) == len(sp.req.output_ids):
                    assert result is not None
                    result.error, result.error_code = "no token left", "INVALID_ARGUMENT"
            outs += sched.postprocess(batch, results)
        for o in outs:
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finals[o.rid] = o
        if batch is None and sched.is_idle:
            break
    return {"tokens": tokens, "finals": finals}


def test_a_sampling_error_fails_that_request_alone_and_frees_its_kv() -> None:
    sched, runner = make()
    prompts = {f"r{i}": [5 + i, 6, 7, 8 + i] for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, 6))
    got = _drive_with_faults(sched, runner, {"r1": 0, "r2": 3})
    for rid in ("r0", "r3"):
        assert got["tokens"][rid] == solo(prompts[rid], 6)
        assert got["finals"][rid].finish_reason == "length"
    for rid, position in (("r1", 0), ("r2", 3)):
        final = got["finals"][rid]
        assert final.finish_reason == "abort"
        assert final.error == "no token left" and final.error_code == "INVALID_ARGUMENT"
        assert got["tokens"].get(rid, []) == solo(prompts[rid], 6)[:position]
    assert_no_leak(sched)


def test_an_exception_in_postprocessing_fails_that_request_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched, runner = make()
    prompts = {f"r{i}": [9, 8 + i, 7] for i in range(3)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, 4))
    real = postprocess.check_finished

    def check(state, r, token: int) -> None:
        if r.rid == "r1" and len(r.output_ids) == 2:
            raise RuntimeError("boom")
        real(state, r, token)

    monkeypatch.setattr(postprocess, "check_finished", check)
    got = drive(sched, runner)
    assert got["tokens"]["r0"] == solo(prompts["r0"], 4)
    assert got["tokens"]["r2"] == solo(prompts["r2"], 4)
    final = got["finals"]["r1"]
    assert final.finish_reason == "abort" and final.error_code == "INTERNAL"
    assert "RuntimeError: boom" in final.error
    assert_no_leak(sched)


def test_req_tokens_slices_the_sequence_like_fill_ids() -> None:
    """Req.tokens (what a step feeds the model) equals fill_ids[start:end] everywhere: in
    the prompt, across its end, in the output, empty and past the end."""
    from sglang_admin.scheduler.request import Req, SamplingState

    req = Req("r", [1, 2, 3, 4], SamplingState(SamplingParams()))
    req.output_ids.extend([7, 8, 9])
    for start in range(0, 9):
        for end in range(start, 9):
            assert req.tokens(start, end) == req.fill_ids[start:end], (start, end)


def test_plain_requests_and_ones_that_keep_more_share_steps_unchanged() -> None:
    """Most requests of a decode step only take a token (postprocess's short path); one that
    keeps logprobs, or prefills only, goes the whole way in the same steps."""
    sched, runner = make()
    prompts = {"plain": [5, 6, 7], "logprobs": [5, 6, 8], "prefill-only": [5, 6, 9]}
    sched.add_request(req("plain", prompts["plain"], 5))
    sched.add_request(req("logprobs", prompts["logprobs"], 5, return_logprob=True))
    sched.add_request(req("prefill-only", prompts["prefill-only"], 0))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    finals: dict[str, object] = {}
    for _ in range(20):  # a few steps do it all (a request that never finishes fails below)
        batch = sched.schedule()
        if batch is None:
            break
        results = runner.run(batch)
        for sp, result in zip(batch.spans, results):
            if result is not None:
                result.logprob = -float(len(sp.req.output_ids) + 1)
        for o in sched.postprocess(batch, results):
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
            logprobs.setdefault(o.rid, []).extend(o.logprobs)
            if o.finish_reason is not None:
                finals[o.rid] = o
    assert tokens["plain"] == solo(prompts["plain"], 5) and logprobs["plain"] == []
    assert tokens["logprobs"] == solo(prompts["logprobs"], 5)
    assert logprobs["logprobs"] == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert tokens["prefill-only"] == [] and finals["prefill-only"].finish_reason == "length"
    assert {rid: f.finish_reason for rid, f in finals.items()} == {
        "plain": "length", "logprobs": "length", "prefill-only": "length"}
    assert_no_leak(sched)


def test_kv_figures_mean_what_sglang_means_and_retract_frees_the_kv() -> None:
    """used = capacity - (free + evictable): the tokens requests hold; a warm idle rank
    uses none, and a retract frees what the retracted requests held (SGLang's
    release_kv_cache(is_insert=False): their own slots go back to the pool, their prompt's
    cached prefix becomes evictable)."""
    sched, runner = make()
    cap = sched.allocator.capacity

    def figures() -> tuple[int, int, int]:
        used, evictable, free = (sched.num_used_tokens, sched.cache.evictable_size,
                                 sched.num_free_tokens)
        assert used + evictable + free == cap
        return used, evictable, free

    prompts = {f"r{i}": [i + 1] * (5 + i) for i in range(4)}  # no shared prefix
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, 12))
    tokens: dict[str, list[int]] = {}
    _steps(sched, runner, 4, tokens)  # the prefill and three decode steps
    used, evictable, free = figures()
    held = sum(len(r.slots) for r in sched.running)
    own = sum(len(r.slots) - r.cached_len for r in sched.running)  # not in the tree
    assert used == held > 0 and own > 0

    assert sched.pause("retract") == 4
    after = figures()
    assert after == (0, evictable + held - own, free + own), (used, evictable, free)

    sched.resume()
    result = drive(sched, runner)
    for rid, prompt in prompts.items():
        assert tokens[rid] + result["tokens"].get(rid, []) == solo(prompt, 12)
    used, evictable, free = figures()
    assert used == 0 and evictable > 0  # idle, cache warm: nothing used
    assert_no_leak(sched)
