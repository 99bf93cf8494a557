"""Scheduler side of issue 10: the n > 1 fork through the radix cache, prefill-only
requests (max_new_tokens = 0), stop strings matched at the rank, prompt logprobs' prefix
limit. Driven by the fake model of test_scheduler (it checks every KV slot it reads)."""

from __future__ import annotations

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.model.step_io import SeqOutput
from sglang_admin.scheduler.parallel_sampling import sample_key
from sglang_admin.scheduler.request import Batch
from sglang_admin.scheduler.scheduler import Scheduler
from sglang_admin.scheduler.stop_strings import find_stop
from tests.unit.test_scheduler import FakeRunner, assert_no_leak, make, solo


class CountingRunner(FakeRunner):
    """The fake model, counting the tokens it computes (prefill work)."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.computed = 0

    def run(self, batch: Batch) -> list[SeqOutput | None]:
        self.computed += batch.num_tokens
        return super().run(batch)


def counting(**kw) -> tuple[Scheduler, CountingRunner]:
    sched, _ = make(**kw)
    cfg = sched.config
    return sched, CountingRunner(cfg.token_capacity, cfg.max_running_requests,
                                 cfg.context_length)


def run_all(sched: Scheduler, runner: FakeRunner) -> list:
    outs: list = []
    for _ in range(10_000):
        batch = sched.schedule()
        outs += sched.take_outputs()
        if batch is not None:
            outs += sched.postprocess(batch, runner.run(batch))
        if batch is None and sched.is_idle:
            break
    return outs


def gen(rid: str, prompt: list[int], max_new: int, **kw) -> GenerateReq:
    return GenerateReq(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), **kw)


def by_index(outs: list) -> tuple[dict[int, list[int]], dict[int, object]]:
    tokens: dict[int, list[int]] = {}
    finals: dict[int, object] = {}
    for o in outs:
        tokens.setdefault(o.index, []).extend(o.new_token_ids)
        if o.finish_reason is not None:
            assert o.index not in finals, "a sample finished twice"
            finals[o.index] = o
    return tokens, finals


def test_n_samples_prefill_the_prompt_once_and_each_decodes_on_its_own() -> None:
    sched, runner = counting(prefill=256)
    prompt = [(i * 7) % 90 + 1 for i in range(600)]  # three prefill chunks
    sched.add_request(gen("r", prompt, 5, n=4))
    tokens, finals = by_index(run_all(sched, runner))
    assert sorted(finals) == [0, 1, 2, 3]
    for i in range(4):
        assert tokens[i] == solo(prompt, 5)
        assert finals[i].rid == "r" and finals[i].finish_reason == "length"
    # one prefill of 600 tokens; each forked sample recomputes only the last prompt token;
    # then 4 decode tokens per sample
    assert runner.computed == 600 + 3 * 1 + 4 * 4
    assert [o.cached_tokens for o in finals.values()].count(599) == 3
    assert_no_leak(sched)


def test_without_radix_cache_the_samples_prefill_on_their_own() -> None:
    sched2, runner = counting(prefill=4096)
    sched2.cache.disable = True
    prompt = list(range(1, 101))
    sched2.add_request(gen("r", prompt, 2, n=3))
    tokens, finals = by_index(run_all(sched2, runner))
    assert sorted(finals) == [0, 1, 2] and all(t == solo(prompt, 2) for t in tokens.values())
    assert runner.computed == 3 * 100 + 3 * 1


def test_abort_ends_all_n_samples_and_frees_their_kv() -> None:
    sched, runner = make()
    prompt = list(range(1, 50))
    sched.add_request(gen("r", prompt, 1000, n=3))
    outs: list = []
    for _ in range(4):  # parent prefilled, the forks admitted and decoding
        batch = sched.schedule()
        outs += sched.postprocess(batch, runner.run(batch))
    assert len(sched.running) == 3
    sched.abort("r")
    outs += run_all(sched, runner)
    _, finals = by_index(outs)
    assert sorted(finals) == [0, 1, 2]
    assert all(f.finish_reason == "abort" for f in finals.values())
    assert not sched.groups
    assert_no_leak(sched)


def test_a_forked_sample_waits_for_its_parent_but_others_are_admitted() -> None:
    sched, runner = make(prefill=64)
    sched.add_request(gen("r", list(range(1, 101)), 2, n=2))
    sched.add_request(gen("other", [5, 6, 7], 2))
    first = sched.schedule()
    assert first is not None and [s.req.key for s in first.spans] == ["r"]
    sched.postprocess(first, runner.run(first))
    second = sched.schedule()
    # the fork still waits (prompt not in yet); the request behind it was not blocked
    assert {s.req.key for s in second.spans} == {"r", "other"}
    sched.postprocess(second, runner.run(second))
    run_all(sched, runner)
    assert_no_leak(sched)


def test_duplicate_rid_of_a_live_group_is_refused() -> None:
    sched, runner = make()
    sched.add_request(gen("r", [1, 2, 3], 50, n=2))
    batch = sched.schedule()
    sched.postprocess(batch, runner.run(batch))
    sched.add_request(gen("r", [1, 2, 3], 5))
    refused = [o for o in sched.take_outputs() if o.error_code == "ALREADY_EXISTS"]
    assert len(refused) == 1
    sched.abort("r")
    run_all(sched, runner)
    assert_no_leak(sched)


def test_max_new_tokens_zero_prefills_and_ends_with_length_and_no_token() -> None:
    sched, runner = counting(prefill=16)
    sched.add_request(gen("p", list(range(1, 41)), 0))
    outs = run_all(sched, runner)
    assert [o.finish_reason for o in outs] == ["length"]
    assert outs[0].new_token_ids == [] and outs[0].completion_tokens == 0
    assert outs[0].prompt_tokens == 40
    assert runner.computed == 40
    assert_no_leak(sched)
    # the prompt went into the cache: the same prompt again computes one token
    sched.add_request(gen("q", list(range(1, 41)), 0))
    outs = run_all(sched, runner)
    assert outs[-1].cached_tokens == 39 and runner.computed == 41


def test_prompt_logprobs_limit_the_reused_prefix() -> None:
    sched, runner = counting()
    prompt = list(range(1, 31))
    sched.add_request(gen("a", prompt, 1))
    run_all(sched, runner)
    before = runner.computed
    sched.add_request(gen("b", prompt, 1, logprob_start_len=10))
    run_all(sched, runner)
    # positions 9.. recomputed (logprob of prompt[10] needs the logits at position 9)
    assert runner.computed - before == 30 - 9
    assert_no_leak(sched)


class CharDetok:
    """A toy tokenizer: token t is the character chr(ord('a') + t % 26); 26.. are 'xy'."""

    def __call__(self, ids: list[int]) -> str:
        return "".join("xy" if t >= 26 else chr(ord("a") + t) for t in ids)


def test_find_stop_matches_across_tokens_and_counts_the_tokens_to_trim() -> None:
    detok = CharDetok()
    assert find_stop([0, 1, 2], ["zz"], detok) is None
    m = find_stop([7, 0, 1], ["ab"], detok)  # "hab": "ab" spans the last two tokens
    assert m is not None and m.stop == "ab" and m.trim == 2
    m = find_stop([2, 26], ["y"], detok)  # "cxy": the match sits inside the last token
    assert m is not None and m.trim == 1
    m = find_stop([2, 3, 4], ["de", "cd"], detok)  # the earliest start wins
    assert m is not None and m.stop == "cd" and m.trim == 3  # all from the match on


def test_stop_string_ends_the_request_at_the_rank_in_the_matching_step() -> None:
    sched, runner = make()
    sched.detokenize = lambda ids: "".join(f"<{t}>" for t in ids)
    prompt = [3, 1, 4, 1, 5]
    expected = solo(prompt, 30)
    # a stop string spanning the 3rd and 4th output tokens
    stop = f"{expected[2]}><{expected[3]}"
    sched.add_request(gen("s", prompt, 30, stop=[stop, "never"]))
    outs = run_all(sched, runner)
    final = outs[-1]
    assert final.finish_reason == "stop" and final.matched_stop_str == stop
    assert sum(len(o.new_token_ids) for o in outs) == 4  # no token decoded past the match
    assert final.stop_trim == 2
    assert_no_leak(sched)
    sched.add_request(gen("t", prompt, 30, stop=[stop], no_stop_trim=True))
    final = run_all(sched, runner)[-1]
    assert final.matched_stop_str == stop and final.stop_trim == 0


def test_stop_strings_without_a_tokenizer_are_refused_at_the_rank() -> None:
    sched, _ = make()
    sched.add_request(gen("s", [1, 2], 3, stop=["x"]))
    (out,) = sched.take_outputs()
    assert out.error_code == "FAILED_PRECONDITION" and "tokenizer" in out.error
    assert sched.is_idle


def test_sample_keys() -> None:
    assert sample_key("r", 0) == "r" and sample_key("r", 3) == "r#3"


def test_waiting_forks_count_one_uncached_token_each() -> None:
    sched, _ = make()
    sched.add_request(gen("r", list(range(1, 101)), 3, n=4))
    assert sched.waiting_uncached_tokens() == 100 + 3
