"""Constrained decoding on a rank: the grammar queue (compile off the step loop), its cache,
the batch bitmask, and the scheduler finishing a request when its grammar is complete.

The scheduler runs against a fake model whose logits prefer a hash of the sequence; the
real grammar mask (model/grammar_mask.py) is applied to those logits, so what comes out is
what the grammar allows, as in the served worker.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
import torch
import xgrammar as xgr
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.model.default_model import ensure_default_model
from sglang_admin.model.grammar_mask import allocate_bitmask, apply_bitmask, apply_grammar_masks
from sglang_admin.model.step_io import SeqOutput
from sglang_admin.scheduler.grammar import (
    GrammarError,
    GrammarQueue,
    GrammarState,
    XGrammarBackend,
)
from sglang_admin.scheduler.request import Batch
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig

VOCAB = 261  # the default model: 256 byte tokens and 5 specials
EOS = (257, 259)


@pytest.fixture(scope="module")
def backend() -> XGrammarBackend:
    return XGrammarBackend(f"{ensure_default_model()}/tokenizer.json", VOCAB, EOS)


def text_of(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


# ---------------------------------------------------------------- bitmask on the batch


class CountOps(TorchDispatchMode):
    """Counts the aten ops that write into a given tensor."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.target = target
        self.writes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if (isinstance(first, torch.Tensor) and func._schema.is_mutable
                and first.data_ptr() == self.target.data_ptr()):
            self.writes.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["torch", "xgrammar"])
def test_mask_mixed_rows_in_one_op_matches_xgrammar(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    grammar = XGrammarBackend(f"{ensure_default_model()}/tokenizer.json", VOCAB, EOS)
    digits = grammar.new_state(grammar.compile("regex", "[0-9]+"))
    ab = grammar.new_state(grammar.compile("regex", "ab"))
    matchers = [None, digits, None, ab]
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    kernel_calls: list[list[int] | None] = []
    kernel = xgr.apply_token_bitmask_inplace

    def counted(*args: Any, **kwargs: Any) -> None:
        kernel_calls.append(kwargs.get("indices"))
        kernel(*args, **kwargs)

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", counted)
    with CountOps(logits) as ops:
        assert apply_grammar_masks(logits, matchers, backend=backend) == {}
    monkeypatch.undo()
    if backend == "torch":  # one masked fill over the batch writes the logits
        assert len(ops.writes) == 1 and "masked_fill" in ops.writes[0], ops.writes
        assert kernel_calls == []
    else:  # xgrammar's CPU kernel (outside torch's dispatcher): one call, constrained rows
        assert kernel_calls == [[1, 3]]
    # unconstrained rows untouched
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = [(logits[i] > float("-inf")).nonzero().flatten().tolist() for i in (1, 3)]
    assert allowed[0] == list(range(ord("0"), ord("9") + 1))
    assert allowed[1] == [ord("a")]
    # the same as xgrammar's own kernel
    bitmask = allocate_bitmask(4, VOCAB)
    digits.fill_next_token_bitmask(bitmask, 1)
    ab.fill_next_token_bitmask(bitmask, 3)
    reference = before.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask, indices=[1, 3], backend="cpu")
    assert torch.equal(logits, reference)


def test_torch_mask_matches_xgrammar_on_random_bitmasks() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), generator=gen,
                            dtype=torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask, backend="cpu")
    apply_bitmask(logits, bitmask, backend="torch")
    assert torch.equal(logits, reference)


class Broken:
    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        raise RuntimeError("matcher is broken")


def test_a_failing_matcher_fails_its_row_only(backend: XGrammarBackend) -> None:
    digits = backend.new_state(backend.compile("regex", "[0-9]+"))
    logits = torch.zeros(2, VOCAB)
    failed = apply_grammar_masks(logits, [Broken(), digits])
    assert list(failed) == [0] and "matcher is broken" in failed[0]
    assert (logits[0] == 0).all()  # left alone: that request fails with the reason
    assert (logits[1] == 0).nonzero().flatten().tolist() == list(range(48, 58))


def test_no_constrained_row_leaves_the_logits_alone() -> None:
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    with CountOps(logits) as ops:
        assert apply_grammar_masks(logits, [None, None, None]) == {}
    assert not ops.writes
    assert torch.equal(logits, before)


def test_padding_ids_past_the_tokenizer_are_masked() -> None:
    padded = XGrammarBackend(f"{ensure_default_model()}/tokenizer.json", VOCAB + 27, EOS)
    state = padded.new_state(padded.compile("json_schema", '{"type": "string"}'))
    logits = torch.zeros(2, VOCAB + 27)
    apply_grammar_masks(logits, [state, None])
    assert torch.isinf(logits[0, VOCAB:]).all()
    assert (logits[1] == 0).all()
    assert (logits[0] == 0).nonzero().flatten().tolist() == [ord('"')]


# ---------------------------------------------------------------- compiler and cache


@pytest.mark.parametrize(
    "kind, text, prefix, needle",
    [
        ("regex", "[0-9", "regex does not compile: ", "Unclosed '['"),
        ("json_schema", '{"type": "objec"}', "json_schema does not compile: ",
         'Unsupported type "objec"'),
        ("json_schema", "{not json", "json_schema does not compile: ", "Failed to parse JSON"),
        ("ebnf_grammar", "root ::= foo", "ebnf_grammar does not compile: ",
         'Rule "foo" is not defined'),
        ("structural_tag", "[1, 2", "structural_tag is not JSON: ", "Expecting ',' delimiter"),
    ],
)
def test_compile_error_carries_the_compilers_message(
    backend: XGrammarBackend, kind: str, text: str, prefix: str, needle: str
) -> None:
    with pytest.raises(GrammarError) as err:
        backend.compile(kind, text)
    message = str(err.value)
    assert message.startswith(prefix), message
    assert needle in message[len(prefix):], message  # the compiler's own words, after ours
    assert not re.match(r"^\[[0-9:]+\]", message)  # xgrammar's time stamp is gone


def test_structural_tag_legacy_format_compiles(backend: XGrammarBackend) -> None:
    tag = (
        '{"type": "structural_tag", "structures": [{"begin": "<f>", "schema": '
        '{"type": "object", "properties": {"a": {"type": "integer"}}}, "end": "</f>"}], '
        '"triggers": ["<f>"]}'
    )
    state = backend.new_state(backend.compile("structural_tag", tag))
    for ch in 'hi <f>{"a": 1}</f>':
        assert state.accept(ord(ch)), ch


def test_cache_hits_share_one_compile_and_evict_lru() -> None:
    calls: list[tuple[str, str]] = []

    def compile_(kind: str, text: str) -> str:
        calls.append((kind, text))
        if text == "bad":
            raise GrammarError("regex does not compile: bad")
        return f"compiled {text}"

    queue: GrammarQueue[str] = GrammarQueue(compile_, lambda c: c, cache_entries=2)
    try:
        for req, text in [("r1", "a"), ("r2", "a"), ("r3", "bad"), ("r4", "bad")]:
            queue.submit(req, "regex", text)
        done = _poll_all(queue, 4)
        assert calls == [("regex", "a"), ("regex", "bad")]
        assert (queue.cache_hits, queue.cache_misses) == (2, 2)
        assert [(d.req, d.state, d.error) for d in done] == [
            ("r1", "compiled a", None), ("r2", "compiled a", None),
            ("r3", None, "regex does not compile: bad"),
            ("r4", None, "regex does not compile: bad"),
        ]
        queue.submit("r5", "regex", "c")  # evicts "a", the least recently used
        queue.submit("r6", "regex", "a")
        _poll_all(queue, 2)
        assert calls[2:] == [("regex", "c"), ("regex", "a")]
        queue.submit("r7", "ebnf_grammar", "a")  # the kind is part of the key
        _poll_all(queue, 1)
        assert calls[-1] == ("ebnf_grammar", "a")
    finally:
        queue.shutdown()


def _poll_all(queue: GrammarQueue, n: int, timeout: float = 30) -> list:
    done: list = []
    deadline = time.monotonic() + timeout
    while len(done) < n:
        assert time.monotonic() < deadline, "compiles did not finish"
        done += queue.poll()
        time.sleep(0.001)
    return done


def test_fork_gives_each_sample_its_own_matcher(backend: XGrammarBackend) -> None:
    first = backend.new_state(backend.compile("regex", "(ab|cd)"))
    second = first.fork()
    assert first.accept(ord("a")) and second.accept(ord("c"))
    assert first.accept(ord("b")) and not second.accept(ord("b"))


# ---------------------------------------------------------------- the scheduler


def preferred(seq: list[int]) -> int:
    h = 7
    for i, t in enumerate(seq):
        h = (h * 31 + t * (i % 5 + 1)) % 1_000_003
    return h % 256  # a byte, never EOS


class MaskedFakeRunner:
    """Logits that prefer a hash of the sequence, masked by the grammar, then argmax."""

    def __init__(self) -> None:
        self.steps = 0

    def run(self, batch: Batch) -> list[SeqOutput | None]:
        self.steps += 1
        sampled = [sp for sp in batch.spans if sp.sample]
        logits = torch.zeros(len(sampled), VOCAB)
        for i, sp in enumerate(sampled):
            logits[i] = torch.arange(VOCAB, dtype=torch.float32) / VOCAB
            logits[i, preferred(sp.req.fill_ids[: sp.end])] = 10.0
        apply_grammar_masks(logits, [sp.req.sampling.grammar for sp in sampled])
        picks = iter(logits.argmax(dim=1).tolist())
        return [SeqOutput(next(picks)) if sp.sample else None for sp in batch.spans]


def make_scheduler(queue: GrammarQueue) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            token_capacity=4096, max_running_requests=16, max_prefill_tokens=512,
            context_length=2048, eos_token_ids=EOS,
        ),
        grammar_queue=queue,
    )


def gen(rid: str, prompt: list[int], max_new: int = 24, **sampling: Any) -> GenerateReq:
    """A request; a regex= or json_schema= keyword constrains it."""
    for kind in ("regex", "json_schema"):
        if kind in sampling:
            sampling["grammar_kind"], sampling["grammar"] = kind, sampling.pop(kind)
    return GenerateReq(rid, prompt, SamplingParams(max_new_tokens=max_new, **sampling))


def run_until_done(sched: Scheduler, runner: MaskedFakeRunner, max_steps: int = 200) -> dict:
    finished: dict = {}
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        batch = sched.schedule()
        outs = sched.postprocess(batch, runner.run(batch)) if batch else sched.take_outputs()
        for out in outs:
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.rid] = (out, outputs[out.rid])
        if sched.is_idle and not sched.num_grammar_queue_reqs:
            return finished
        if batch is None:
            time.sleep(0.002)
    raise AssertionError("requests did not finish")


def test_constrained_output_matches_and_stops_at_the_grammars_end(
    backend: XGrammarBackend,
) -> None:
    queue = GrammarQueue.for_backend(backend)
    sched = make_scheduler(queue)
    try:
        sched.add_request(gen("digits", [5, 6, 7], regex="[0-9]{4}-(x|yz)"))
        sched.add_request(gen("free", [5, 6, 7], max_new=6))
        done = run_until_done(sched, MaskedFakeRunner())
        out, ids = done["digits"]
        assert out.finish_reason == "stop" and out.error is None
        assert ids[-1] in EOS  # the grammar left only a stop token
        assert re.fullmatch("[0-9]{4}-(x|yz)", text_of(ids[:-1]))
        free_out, free_ids = done["free"]
        assert free_out.finish_reason == "length" and len(free_ids) == 6
    finally:
        queue.shutdown()


def test_grammar_finishes_even_with_ignore_eos(backend: XGrammarBackend) -> None:
    queue = GrammarQueue.for_backend(backend)
    sched = make_scheduler(queue)
    try:
        sched.add_request(gen("r", [1], regex="ok", ignore_eos=True))
        out, ids = run_until_done(sched, MaskedFakeRunner())["r"]
        assert out.finish_reason == "stop" and text_of(ids) == "ok" and ids[-1] in EOS
    finally:
        queue.shutdown()


def test_slow_compile_does_not_stall_other_requests(backend: XGrammarBackend) -> None:
    release = threading.Event()

    def slow_compile(kind: str, text: str) -> Any:
        if text == "slow":
            assert release.wait(30)
            text = "[a-z]{3}"
        return backend.compile(kind, text)

    queue = GrammarQueue(slow_compile, backend.new_state)
    sched = make_scheduler(queue)
    runner = MaskedFakeRunner()
    try:
        sched.add_request(gen("slow", [1, 2], regex="slow"))
        sched.add_request(gen("fast", [3, 4], regex="[0-9]{2}"))
        sched.add_request(gen("free", [3, 4], max_new=5))
        finished: dict = {}
        while len(finished) < 2:  # the other two finish while "slow" still compiles
            assert runner.steps < 50
            batch = sched.schedule()
            if batch is None:
                time.sleep(0.002)
                continue
            for out in sched.postprocess(batch, runner.run(batch)):
                if out.finish_reason:
                    finished[out.rid] = out
            assert sched.num_grammar_queue_reqs >= 1  # "slow" waits in the grammar queue
        assert set(finished) == {"fast", "free"}
        assert sched.num_grammar_queue_reqs == 1 and not sched.running
        assert sched.by_rid["slow"].kv_len == 0  # never admitted: holds no KV
        release.set()
        out, ids = run_until_done(sched, runner)["slow"]
        assert out.finish_reason == "stop" and re.fullmatch("[a-z]{3}", text_of(ids[:-1]))
        assert sched.num_grammar_queue_reqs == 0
    finally:
        release.set()
        queue.shutdown()


def test_compile_failure_fails_that_request_only(backend: XGrammarBackend) -> None:
    queue = GrammarQueue.for_backend(backend)
    sched = make_scheduler(queue)
    try:
        sched.add_request(gen("bad", [1], json_schema='{"type": "objec"}'))
        sched.add_request(gen("good", [1], max_new=3))
        done = run_until_done(sched, MaskedFakeRunner())
        bad, _ = done["bad"]
        assert bad.error_code == "INVALID_ARGUMENT" and 'Unsupported type "objec"' in bad.error
        assert done["good"][0].finish_reason == "length"
    finally:
        queue.shutdown()


def test_abort_and_expiry_take_requests_out_of_the_grammar_queue(
    backend: XGrammarBackend,
) -> None:
    release = threading.Event()

    def blocked(kind: str, text: str) -> Any:
        assert release.wait(30)
        return backend.compile(kind, text)

    queue = GrammarQueue(blocked, backend.new_state)
    sched = make_scheduler(queue)
    try:
        sched.add_request(gen("a", [1], regex="x+"))
        expired = gen("b", [1], regex="y+")
        expired.deadline = time.time() - 1
        sched.add_request(expired)
        sched.add_request(gen("c", [1], regex="z+"))
        assert sched.num_grammar_queue_reqs == 3
        sched.abort("a")
        assert sched.schedule() is None
        outs = {o.rid: o for o in sched.take_outputs()}
        assert outs["a"].finish_reason == "abort"
        assert outs["b"].error_code == "DEADLINE_EXCEEDED"
        assert sched.num_grammar_queue_reqs == 1
        assert sched.abort_all() == 1 and sched.num_grammar_queue_reqs == 0
        assert not sched.by_rid
        release.set()
    finally:
        release.set()
        queue.shutdown()


def test_grammar_state_reports_finished_only_when_terminated(backend: XGrammarBackend) -> None:
    state: GrammarState = backend.new_state(backend.compile("regex", "a"))
    assert state.accept(ord("a")) and not state.finished  # EOS still to come
    assert state.accept(EOS[0]) and state.finished


def test_get_loads_queues_grammar_counts_the_rank_grammar_queue() -> None:
    from sglang_admin.messages import RankState
    from sglang_admin.server.info_service import _load_proto

    load = _load_proto(RankState(dp_rank=0, num_grammar_queue_reqs=3), {"queues"}, 0.0)
    assert load.queues.grammar == 3


def test_a_model_without_tokenizer_refuses_constraints_with_failed_precondition(
    tmp_path,
) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not a tokenizer")
    for path, needle in ((None, "has none"), (str(broken), "does not load")):
        backend = XGrammarBackend(path, VOCAB, EOS)
        queue = GrammarQueue.for_backend(backend)
        try:
            queue.submit("r1", "regex", "a")
            (done,) = _poll_all(queue, 1)
            assert (done.state, done.code) == (None, "FAILED_PRECONDITION")
            assert needle in done.error
            queue.submit("r2", "regex", "a")  # not cached: the rank's fault, not the grammar's
            _poll_all(queue, 1)
            assert queue.cache_misses == 2
        finally:
            queue.shutdown()


def test_requests_sharing_a_grammar_share_the_compile_not_the_matcher(
    backend: XGrammarBackend,
) -> None:
    """As the n samples of one request: one compile, each its own matcher and output."""
    queue = GrammarQueue.for_backend(backend)
    sched = make_scheduler(queue)
    try:
        pattern = "[a-z]{3,5}(,[a-z]{3,5}){2}"
        for i in range(3):
            sched.add_request(gen(f"s{i}", [9, 8, 7 + i], regex=pattern))
        states = []
        finished = {}
        tokens: dict[str, list[int]] = {}
        runner = MaskedFakeRunner()
        while len(finished) < 3:
            assert runner.steps < 100
            batch = sched.schedule()
            if batch is None:
                time.sleep(0.002)
                continue
            states += [sp.req.sampling.grammar for sp in batch.spans
                       if sp.req.sampling.grammar not in states]
            for out in sched.postprocess(batch, runner.run(batch)):
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
                if out.finish_reason:
                    finished[out.rid] = out
        assert (queue.cache_misses, queue.cache_hits) == (1, 2)
        assert len({id(s) for s in states}) == 3 and len({id(s.matcher) for s in states}) == 3
        texts = {text_of(ids[:-1]) for ids in tokens.values()}
        assert all(o.finish_reason == "stop" for o in finished.values())
        assert all(re.fullmatch(pattern, t) for t in texts), texts
        assert len(texts) >= 2  # different prompts, different paths through the grammar
    finally:
        queue.shutdown()


def test_a_model_vocabulary_smaller_than_the_tokenizer_masks_at_the_model_width() -> None:
    """Tokenizer ids past the model's vocabulary (here the specials 256..260) are dropped:
    the bitmask has the logits' width and the grammar still works."""
    narrow = XGrammarBackend(f"{ensure_default_model()}/tokenizer.json", 256, ())
    state = narrow.new_state(narrow.compile("regex", "[0-9]{2}"))
    logits = torch.zeros(1, 256)
    assert apply_grammar_masks(logits, [state]) == {}
    assert (logits[0] == 0).nonzero().flatten().tolist() == list(range(48, 58))
    assert state.accept(ord("4")) and state.accept(ord("2"))
    assert state.finished  # no stop token in this vocabulary: complete is finished
