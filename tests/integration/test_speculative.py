"""Speculative decoding served (issue 47): a ``--speculative-algorithm NGRAM --dp-size 2``
worker on the embedded model against the plain session worker (greedy outputs, stop
strings and streams equal; accept figures in GenerateComplete, GetLoads, GetServerInfo and
the metrics; the KV figures exact afterwards; admin ops), the refusals of bad settings,
STANDALONE with a draft model, and a tiny Llama at tp 2 with a LoRA adapter against peft
(one worker: base and adapter requests)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ROOT, ServerProc, start_server, wait_started

# prompts on which the embedded model's greedy output loops (drafts get accepted)
LOOPING = [[132] * 20, [220] * 20, [72] * 20, [116] * 20, [12] * 20]
PLAIN = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("spec"), "--speculative-algorithm", "NGRAM",
                       "--speculative-num-draft-tokens", "6", "--dp-size", "2",
                       "--enable-metrics")
    yield srv
    srv.stop()


def generate(stub, ids: list[int], stream: bool = False, **sampling
             ) -> tuple[list[int], list[pb.GenerateComplete], list[int]]:
    """Output ids (of sample 0; streamed: what the chunks carried), the completes, and the
    tokens the chunks carried."""
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
                             sampling_params=pb.SamplingParams(**sampling))
    completes: list[pb.GenerateComplete] = []
    streamed: list[int] = []
    for resp in stub.Generate(req, timeout=120):
        if resp.HasField("chunk"):
            streamed.extend(resp.chunk.token_ids)
        else:
            completes.append(resp.complete)
    completes.sort(key=lambda c: c.index)
    out = streamed if stream else list(completes[0].output_ids)
    return out, completes, streamed


def test_greedy_served_equals_the_plain_worker_with_drafts_accepted(
        spec_server: ServerProc, server: ServerProc) -> None:
    spec, plain = spec_server.stub(), server.stub()
    for ids in [*LOOPING, PLAIN]:
        want, _, _ = generate(plain, ids, max_new_tokens=48, ignore_eos=True)
        got, completes, streamed = generate(spec, ids, stream=True, max_new_tokens=48,
                                            ignore_eos=True)
        assert got == want and len(streamed) > 1, ids
        c = completes[0]
        assert c.spec_accepted_tokens <= c.spec_draft_tokens
        assert (c.spec_verify_ct > 0) == (c.spec_draft_tokens > 0)
        if ids in LOOPING:  # its output loops: its drafts are accepted
            assert c.spec_verify_ct > 0 and c.spec_accepted_tokens > 0, ids


def test_stop_strings_logprobs_and_n2_inside_accepted_runs(
        spec_server: ServerProc, server: ServerProc) -> None:
    spec, plain = spec_server.stub(), server.stub()
    ids = LOOPING[3]
    full, _, _ = generate(plain, ids, max_new_tokens=48, ignore_eos=True)
    # a stop string from the plain output's printable bytes, past its start
    at = next(i for i in range(6, len(full) - 2) if all(32 <= t < 127 for t in full[i:i + 2]))
    stop = bytes(full[at:at + 2]).decode()
    kw = dict(max_new_tokens=48, ignore_eos=True, stop=[stop], n=2)
    want, want_c, _ = generate(plain, ids, **kw)
    got, got_c, _ = generate(spec, ids, **kw)
    assert got == want and len(got_c) == 2
    assert [c.matched_stop_str for c in got_c] == [c.matched_stop_str for c in want_c] == \
        [stop, stop]
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=LOOPING[0]),
                             return_logprob=True, top_logprobs_num=2,
                             sampling_params=pb.SamplingParams(max_new_tokens=30,
                                                               ignore_eos=True))
    a = [r.complete for r in plain.Generate(req, timeout=60)][-1]
    b = [r.complete for r in spec.Generate(req, timeout=60)][-1]
    assert list(a.output_ids) == list(b.output_ids)
    assert b.spec_verify_ct > 0 and b.spec_accepted_tokens > 0
    assert len(b.output_logprobs.token_logprobs) == 30
    assert list(b.output_logprobs.token_logprobs) == pytest.approx(
        list(a.output_logprobs.token_logprobs), abs=1e-4)


def test_accept_figures_in_loads_server_info_and_metrics_and_kv_exact(
        spec_server: ServerProc) -> None:
    stub = spec_server.stub()
    for ids in LOOPING:  # both ranks verify drafts
        generate(stub, ids, max_new_tokens=40, ignore_eos=True, temperature=0.5)
        generate(stub, ids, max_new_tokens=40, ignore_eos=True)
    deadline = time.time() + 10
    while True:  # the state the ranks published after their last step
        loads = stub.GetLoads(pb.GetLoadsRequest(include=["core", "spec"]), timeout=10)
        if all(x.num_total_reqs == 0 for x in loads.loads) or time.time() > deadline:
            break
        time.sleep(0.05)
    specs = [load.speculative for load in loads.loads]
    assert len(specs) == 2 and all(load.HasField("speculative") for load in loads.loads)
    assert max(s.accept_length for s in specs) > 1.0
    assert all(0.0 <= s.accept_rate <= 1.0 for s in specs)
    for load in loads.loads:
        assert load.num_used_tokens == 0
        assert (load.num_used_tokens + load.num_evictable_tokens + load.num_free_tokens
                == load.max_total_num_tokens)
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.avg_spec_accept_length > 1.0
    assert any(r.spec_verify_steps > 0 for r in info.rank_states)
    text = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10).text
    assert "sglang:spec_accept_length{" in text and "sglang:spec_accept_rate{" in text
    # admin ops keep their meaning: a flush empties the cache, pause/continue mid-run
    assert stub.FlushCache(pb.FlushCacheRequest(), timeout=30).success
    loads = stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=10)
    assert all(load.num_free_tokens == load.max_total_num_tokens for load in loads.loads)


def test_pause_retract_mid_speculation_then_continue_gives_the_plain_output(
        spec_server: ServerProc, server: ServerProc) -> None:
    """Streams that verify drafts are retracted (their KV freed), then continued: their
    outputs are the plain worker's, and the pool is back to no used tokens."""
    import threading

    spec = spec_server.stub()
    prompts = LOOPING[:4]
    want = [generate(server.stub(), ids, max_new_tokens=300, ignore_eos=True)[0]
            for ids in prompts]
    got: list[list[int]] = [[] for _ in prompts]

    def stream(i: int) -> None:
        got[i] = generate(spec, prompts[i], stream=True, max_new_tokens=300,
                          ignore_eos=True)[0]

    # held while paused, the four start in one step after continue: all four are running
    # together however late a thread starts (their 300 tokens take well under a second)
    assert spec.PauseGeneration(pb.PauseGenerationRequest(mode="in_place"), timeout=30).success
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while sum(x.num_waiting_reqs for x in stub_loads(spec)) < len(prompts):
        assert time.time() < deadline
        time.sleep(0.01)
    assert spec.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
    while sum(x.num_running_reqs for x in stub_loads(spec)) < len(prompts):
        assert time.time() < deadline
        time.sleep(0.01)
    paused = spec.PauseGeneration(pb.PauseGenerationRequest(mode="retract"), timeout=30)
    assert paused.success, paused.message
    assert spec.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
    for t in threads:
        t.join(120)
    assert got == want
    while any(x.num_total_reqs for x in stub_loads(spec)):
        assert time.time() < deadline + 60
        time.sleep(0.05)
    assert all(x.num_used_tokens == 0 for x in stub_loads(spec))


def stub_loads(stub) -> list[pb.SchedulerLoad]:
    return list(stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=10).loads)


# `python -m sglang_admin serve ARGS` for each ARGS (a JSON list) in one interpreter (one
# start instead of four): its exit status and stderr, one JSON line each
_SERVE_EACH = """
import contextlib, io, json, sys
from sglang_admin.cli import main

for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["serve", *args])
        except SystemExit as exc:  # argparse's refusals
            code = exc.code
    print(json.dumps([code, err.getvalue()]), flush=True)
"""


def test_bad_settings_are_refused_at_start() -> None:
    cases = [
        (["--speculative-algorithm", "EAGLE"], "is not one of"),
        (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "0"],
         "out of range"),
        (["--speculative-algorithm", "STANDALONE"], "needs --speculative-draft-model-path"),
        (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "/x"],
         "/x: no such file or directory"),
    ]
    proc = subprocess.run([sys.executable, "-c", _SERVE_EACH,
                           json.dumps([args for args, _ in cases])],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(answers) == len(cases), (proc.stdout, proc.stderr)
    for (args, why), (code, stderr) in zip(cases, answers):
        assert code == 2 and why in stderr, (args, stderr)


def test_standalone_draft_model_served(tmp_path_factory) -> None:
    """STANDALONE on a tiny target with a perturbed copy as the draft model (one worker):
    greedy outputs are transformers' (drafts accepted, not all), sampled requests finish
    with their lengths, a retract pause mid-run then continue and a flush change no
    output, memory release is refused; a draft of another vocabulary is refused at start."""
    pytest.importorskip("transformers")
    import threading

    from tests.draft_models import build_other_vocab, build_pair, hf_greedy

    root = tmp_path_factory.mktemp("standalone")
    target, draft = build_pair(root)
    prompts = [[(5 * i + 3 * j) % 300 + 2 for j in range(6)] * 3 for i in range(4)]
    want = hf_greedy(target, prompts, 120)
    srv = start_server(root, "--model-path", str(target), "--dtype", "float32",
                       "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                       str(draft), "--speculative-num-draft-tokens", "4")
    try:
        stub = srv.stub()
        got: list[list[int]] = [[] for _ in prompts]
        completes: list[pb.GenerateComplete] = []

        def stream(i: int) -> None:
            out, done, _ = generate(stub, prompts[i], stream=True, max_new_tokens=120,
                                    min_new_tokens=120, ignore_eos=True)
            got[i] = out
            completes.extend(done)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while sum(x.num_running_reqs for x in stub_loads(stub)) < len(prompts):
            assert time.time() < deadline
            time.sleep(0.01)
        paused = stub.PauseGeneration(pb.PauseGenerationRequest(mode="retract"), timeout=30)
        assert paused.success, paused.message
        assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
        for t in threads:
            t.join(120)
        assert got == want
        accepted = sum(c.spec_accepted_tokens for c in completes)
        assert 0 < accepted < sum(c.spec_draft_tokens for c in completes)
        assert stub.FlushCache(pb.FlushCacheRequest(timeout_s=30), timeout=40).success
        assert generate(stub, prompts[0], max_new_tokens=120, min_new_tokens=120,
                        ignore_eos=True)[0] == want[0]
        sampled = [generate(stub, ids, max_new_tokens=30, ignore_eos=True, temperature=0.8,
                            n=2)[1] for ids in prompts]
        assert all(len(c.output_ids) == 30 for done in sampled for c in done)
        released = stub.ReleaseMemoryOccupation(pb.ReleaseMemoryOccupationRequest(),
                                                timeout=30)
        assert not released.success and "STANDALONE" in released.message
        # a refit reaches the target alone, and says so (the draft cannot take its weights)
        refit = stub.UpdateWeightsFromDisk(pb.UpdateWeightsFromDiskRequest(
            model_path=str(target), weight_version="v2"), timeout=60)
        assert refit.success, refit.message
        assert "STANDALONE draft model was not refit" in refit.rank_results[0].message
        assert generate(stub, prompts[1], max_new_tokens=120, min_new_tokens=120,
                        ignore_eos=True)[0] == want[1]
    finally:
        srv.stop()
    other = build_other_vocab(root)
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_admin", "serve", "--model-path", str(target),
         "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(other)],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "the draft model's vocabulary (256 tokens) differs from the target's (320)" in \
        proc.stderr


@pytest.fixture(scope="module")
def tp2_lora(tmp_path_factory) -> Iterator[tuple[ServerProc, object]]:
    """The tiny random Llama at --tp-size 2 (gloo on CPU) with a LoRA adapter loaded, NGRAM
    on, and peft's model of it (the adapter and, disabled, the base): one worker for the
    LoRA and the TP checks (each boot of a tp 2 worker costs three processes' start)."""
    pytest.importorskip("peft")
    from tests.lora_models import build_adapter, build_base, peft_model

    root = tmp_path_factory.mktemp("spec-tp2-lora")
    base = build_base("llama", root / "base")
    adapter = build_adapter(base, "attn", root / "attn", seed=1)
    srv = start_server(root, "--model-path", str(base), "--dtype", "float32", "--tp-size", "2",
                       "--max-total-tokens", "2048", "--enable-lora", "--max-loaded-loras",
                       "2", "--max-lora-rank", "8", "--lora-paths", f"attn={adapter}",
                       "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                       "4", wait=False)
    try:
        model = peft_model(base, {"attn": adapter})  # while the worker boots
        wait_started(srv)
        yield srv, model
    finally:
        srv.stop()


def test_lora_requests_verify_with_their_adapter(tp2_lora) -> None:
    """A tiny random Llama with a LoRA adapter, NGRAM on: base and adapter requests in one
    batch give peft's greedy tokens, drafts accepted."""
    import concurrent.futures as cf

    from tests.lora_models import reference

    srv, model = tp2_lora
    stub = srv.stub()
    cases = [(lora, [(5 * i + 3 * j) % 300 + 2 for j in range(6)] * 4)
             for i in range(6) for lora in (None, "attn")]

    def served(case: tuple[str | None, list[int]]) -> pb.GenerateComplete:
        lora, ids = case
        req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids),
                                 lora_id=lora or "",
                                 sampling_params=pb.SamplingParams(
                                     max_new_tokens=24, min_new_tokens=24,
                                     ignore_eos=True))  # EOS masked, as peft's reference
        return [r.complete for r in stub.Generate(req, timeout=120)][-1]

    with cf.ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(served, cases))
    for (lora, ids), complete in zip(cases, got):
        want, _ = reference(model, lora, ids, 24)
        assert list(complete.output_ids) == want, (lora, ids)
    assert sum(c.spec_accepted_tokens for c in got) > 0


def test_ngram_at_tp2_equals_transformers(tp2_lora) -> None:
    """NGRAM with --tp-size 2 (the tiny random Llama, gloo on CPU): greedy outputs of a
    batch of repeating prompts (no adapter) are transformers', drafts accepted."""
    import concurrent.futures as cf

    from tests.lora_models import reference

    srv, model = tp2_lora
    prompts = [[(5 * i + 3 * j) % 300 + 2 for j in range(6)] * 4 for i in range(4)]
    want = [reference(model, None, ids, 40)[0] for ids in prompts]  # the base, adapter off
    stub = srv.stub()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ids: generate(stub, ids, max_new_tokens=40,
                                                 min_new_tokens=40, ignore_eos=True),
                            prompts))
    assert [out for out, _, _ in got] == want
    assert sum(done[0].spec_accepted_tokens for _, done, _ in got) > 0
