"""Turn-taking on a full rank (scheduler/preemption.py, issue 33), against the fake model of
test_scheduler.py: its KV check makes any slot mistake of a preempted request's return
change the tokens it reads back, so every output is compared with the request run alone."""

from __future__ import annotations

import random

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.scheduler.preemption import is_decoding, plan_turns
from sglang_admin.scheduler.request import Req, SamplingState
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.unit.test_scheduler import EOS, FakeRunner, assert_no_leak, req, solo

STEP_S = 0.1  # what one step takes on the fake clock


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(wait_s: float, capacity: int = 4096, rows: int = 4, prefill: int = 512,
         ) -> tuple[Scheduler, FakeRunner, Clock]:
    sched = Scheduler(SchedulerConfig(
        token_capacity=capacity, max_running_requests=rows, max_prefill_tokens=prefill,
        context_length=2048, eos_token_ids=(EOS,), preempt_wait_s=wait_s))
    clock = Clock()
    sched.clock = clock
    return sched, FakeRunner(capacity, rows, 2048), clock


def run(sched: Scheduler, runner: FakeRunner, clock: Clock, steps: int = 100_000,
        arrivals: dict[int, list[GenerateReq]] | None = None,
        ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Step until idle, STEP_S of fake time a step, adding ``arrivals[step]`` on the way;
    each request's tokens and the step at which it finished."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, int] = {}
    arrivals = arrivals or {}
    for step in range(steps):
        for msg in arrivals.get(step, []):
            sched.add_request(msg)
        batch = sched.schedule()
        outs = sched.take_outputs()
        if batch is not None:
            outs += sched.postprocess(batch, runner.run(batch))
        clock.now += STEP_S
        for out in outs:
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.rid] = step
        if batch is None and sched.is_idle and step >= max(arrivals, default=0):
            break
    return tokens, finished


def long_streams(count: int, n: int) -> dict[str, list[int]]:
    return {f"long{i}": [i + 1, 2 * i + 3, 5] for i in range(count)}


def test_a_short_request_gets_a_place_in_a_batch_full_of_long_streams() -> None:
    """4 places, 4 streams of 600 tokens: a 5-token request arriving at step 20 is served
    about wait_s (10 steps) later, not after a long stream ends; every stream's tokens are
    what it makes alone, though each gave its place up and came back."""
    sched, runner, clock = make(wait_s=1.0)
    prompts = long_streams(4, 600)
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, 600))
    short = [7, 7, 9]
    tokens, finished = run(sched, runner, clock, arrivals={20: [req("short", short, 5)]})
    assert tokens["short"] == solo(short, 5)
    assert finished["short"] - 20 <= 1.0 / STEP_S + 8, finished
    assert min(finished[rid] for rid in prompts) > 500  # the long ones were still running
    for rid, prompt in prompts.items():
        assert tokens[rid] == solo(prompt, 600), rid
    assert sched.num_preempted >= 1
    assert_no_leak(sched)


def test_without_preemption_the_short_request_waits_for_a_long_stream_to_end() -> None:
    """The control (--preempt-wait 0, the old behaviour): the same short request is served
    only once a 600-token stream has ended."""
    sched, runner, clock = make(wait_s=0.0)
    for rid, prompt in long_streams(4, 600).items():
        sched.add_request(req(rid, prompt, 600))
    tokens, finished = run(sched, runner, clock, arrivals={20: [req("short", [7, 7, 9], 5)]})
    assert finished["short"] > 600
    assert sched.num_preempted == 0


def test_more_streams_than_places_take_turns() -> None:
    """10 streams, 4 places: the 6 left waiting do not wait for the first 4 to end; every
    stream makes progress early and ends with its own tokens."""
    sched, runner, clock = make(wait_s=0.5)
    prompts = long_streams(10, 300)
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, 300))
    seen: set[str] = set()
    early: dict[str, list[int]] = {}
    for _ in range(60):  # 6 s of fake time; each stream needs 300 steps
        batch = sched.schedule()
        assert batch is not None
        seen.update(span.req.rid for span in batch.spans)
        for out in sched.postprocess(batch, runner.run(batch)):
            early.setdefault(out.rid, []).extend(out.new_token_ids)
        clock.now += STEP_S
    assert seen == set(prompts)  # all 10 ran within the first 6 s
    tokens, _ = run(sched, runner, clock)
    for rid, prompt in prompts.items():
        assert early.get(rid, []) + tokens.get(rid, []) == solo(prompt, 300), rid
    assert_no_leak(sched)


def test_a_full_kv_pool_makes_room_too() -> None:
    """Places to spare but a pool the long streams fill: a new request with a 150-token
    prompt gets in after the wait (the stream that ran longest gives its place up, its KV
    becoming evictable), not when a stream ends; the preempted stream, its KV evicted for
    the newcomer, recomputes it and still ends with its own tokens."""
    sched, runner, clock = make(wait_s=0.5, capacity=1000, rows=16, prefill=128)
    prompts = long_streams(3, 400)
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, 400))
    short = [i * 7 % 90 + 1 for i in range(150)]
    tokens, finished = run(sched, runner, clock, arrivals={300: [req("short", short, 5)]})
    assert tokens["short"] == solo(short, 5)
    assert finished["short"] - 300 <= 0.5 / STEP_S + 10, finished
    assert finished["short"] < min(finished[rid] for rid in prompts)
    for rid, prompt in prompts.items():
        assert tokens[rid] == solo(prompt, 400), rid
    assert sched.num_preempted >= 1
    assert_no_leak(sched)


def test_constant_churn_never_corrupts_or_leaks() -> None:
    """A wait of one step: nearly every step preempts someone, in a small pool that also
    retracts; random arrivals and aborts. Every finished request's tokens equal its solo
    run and nothing leaks."""
    sched, runner, clock = make(wait_s=STEP_S, capacity=400, rows=6, prefill=64)
    rng = random.Random(3)
    prompts: dict[str, list[int]] = {}
    arrivals: dict[int, list[GenerateReq]] = {}
    for i in range(40):
        rid = f"q{i}"
        prompts[rid] = [rng.randrange(1, 20) for _ in range(rng.randrange(1, 40))]
        step = rng.randrange(0, 200)
        arrivals.setdefault(step, []).append(req(rid, prompts[rid], rng.randrange(1, 120)))
    tokens, finished = run(sched, runner, clock, arrivals=arrivals)
    assert set(finished) == set(prompts)
    for rid, prompt in prompts.items():
        assert tokens[rid] == solo(prompt, len(tokens[rid])), rid
    assert sched.num_preempted > 20
    assert_no_leak(sched)


def _running(rid: str, prompt: int, out: int, since: float) -> Req:
    r = Req(rid, list(range(1, prompt + 1)),
            SamplingState(SamplingParams(max_new_tokens=100, ignore_eos=True)))
    r.output_ids = list(range(out))
    r.kv_len = prompt + out - 1
    r.running_since = since
    return r


def test_the_victims_are_the_longest_running_decodes() -> None:
    """Victims: decoding requests that ran wait_s or longer, the longest first; a request
    still prefilling or admitted less than wait_s ago keeps its place."""
    old = _running("old", 4, 50, since=0.0)
    older = _running("older", 4, 5, since=-5.0)
    fresh = _running("fresh", 4, 50, since=9.5)
    prefilling = _running("prefilling", 400, 0, since=-10.0)
    prefilling.kv_len = 128
    assert [is_decoding(r) for r in (old, older, fresh, prefilling)] == [True] * 3 + [False]
    waiting = [_running(f"w{i}", 3, 0, since=0.0) for i in range(3)]
    for i, w in enumerate(waiting):
        w.kv_len, w.waiting_since = 0, 9.0 - i  # w2 waited longest, w0 is not overdue
    turns = plan_turns(waiting, [old, older, fresh, prefilling], now=10.0, wait_s=1.5,
                       rows_free=0, memory_free=1000, need=lambda r: 3)
    assert [r.rid for r in turns.first] == ["w2", "w1"]
    assert [r.rid for r in turns.victims] == ["older", "old"]
    # a waiting request that no victim could make room for takes none
    turns = plan_turns(waiting, [old], now=10.0, wait_s=1.5, rows_free=1, memory_free=0,
                       need=lambda r: 10_000)
    assert turns.victims == []
    # one stopped mid-stream takes a place only while its KV is cached (it needs little)
    resumed = _running("resumed", 3, 10, since=0.0)
    resumed.kv_len, resumed.waiting_since = 0, 5.0
    for needs, victims in ((200, []), (1, ["old"])):
        turns = plan_turns([resumed], [old], now=10.0, wait_s=1.5, rows_free=0,
                           memory_free=1000, need=lambda r, n=needs: n)
        assert [r.rid for r in turns.victims] == victims, needs
