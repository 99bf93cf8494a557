"""Prefill/decode disaggregation: a prefill worker and a decode worker of ours behind the
real SMG router in PD mode (`smg launch --pd-disaggregation`), KV over the zmq backend.

The happy path goes through the router and is compared with the session's plain worker
(`server`, the same embedded model): greedy tokens and logprobs equal. The failure cases
drive one real leg with a test-side stand-in for the other (tests/integration/pd_peers.py)
so that leg can die, withhold, corrupt or shorten the pages: each failure ends its request
with a clear status within the (shortened) timeouts, frees the KV on both workers, and
leaves both serving.

Workers: the module's pair (dp 2 a leg, the router in front) serves every test that leaves
it serving, and loses its prefill worker in the module's last test; a pair of the embedded
model with a LoRA adapter on both legs, its KV over mooncake, serves the LoRA and the
mooncake tests (its decode worker killed at the end); SmolLM2's pair (its own router) and
the tp 2 pair live for one test each.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest

pytest.importorskip("smg", reason="the SMG gateway (pip package `smg`) is not installed")

from sglang_admin.pb import common_pb2 as pb  # noqa: E402
from tests.conftest import ROOT, ServerProc, free_port, greedy, start_server, wait_started  # noqa: E402
from tests.integration.pd_peers import FakePrefill, StalledReceiver  # noqa: E402
from tests.integration.test_smg_router import http, sse, stop_router, wait_for  # noqa: E402

# shortened so the failure cases end in seconds (SGLang's defaults are 300 s)
PD_ENV = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "12",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "12",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "4",
}
# prompts of the tests whose stand-in prefill sends random pages: a request that joins on
# them leaves that KV in decode's radix cache, so no other test may use these prompts
FAKE_KV_PROMPTS = [[251, 252, 253, 254, 255, 250, 249], [248, 247, 246, 245, 244],
                   [243, 242, 241, 240, 239, 238]]
PROMPTS = [[5, 17, 99, 3, 250, 64, 7, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
           [200, 13, 77], list(range(30, 130))]


@dataclass
class Pair:
    prefill: ServerProc
    decode: ServerProc
    plain: ServerProc
    bootstrap_port: int
    router: subprocess.Popen
    base: str
    model: str
    router_log: Path


def used_tokens(srv: ServerProc) -> int:
    loads = srv.stub().GetLoads(pb.GetLoadsRequest(), timeout=10)
    return sum(load.num_used_tokens for load in loads.loads)


def assert_freed(*servers: ServerProc, timeout: float = 10) -> None:
    for srv in servers:
        wait_for(lambda s=srv: used_tokens(s) == 0, timeout, f"num_used_tokens 0 on {srv.target}")


def assert_serving(pair: Pair) -> None:
    """Both legs still answer a request through the router."""
    out = router_generate(pair, PROMPTS[0], 3)
    assert len(out["output_ids"]) == 3


def router_generate(pair: Pair, ids: list[int], n: int, **extra: Any) -> dict:
    status, body = http("POST", f"{pair.base}/generate", {
        "model": pair.model, "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        **extra,
    }, timeout=120)
    assert status == 200, body
    return body[0] if isinstance(body, list) else body


def plain_generate(pair: Pair, ids: list[int], n: int, **kw: Any) -> pb.GenerateComplete:
    outs = list(pair.plain.stub().Generate(greedy(ids, n, **kw), timeout=60))
    return outs[-1].complete


def pd_request(ids: list[int], n: int, host: str, port: int, room: int,
               rid: str = "") -> pb.GenerateRequest:
    req = greedy(ids, n, request_id=rid or f"t{room}")
    req.disaggregated_params.bootstrap_host = host
    req.disaggregated_params.bootstrap_port = port
    req.disaggregated_params.bootstrap_room = room
    return req


def launch_pd_router(prefill: ServerProc, decode: ServerProc, bport: int, tmp: Path
                     ) -> tuple[subprocess.Popen, str, Path]:
    """The real SMG router in PD mode over one prefill and one decode worker, ready (both
    seen healthy): the process, its base URL and its log."""
    port = free_port()
    router_log = tmp / "router.log"
    with open(router_log, "w") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "smg.launch_router", "--pd-disaggregation",
             "--prefill", f"grpc://127.0.0.1:{prefill.port}", str(bport),
             "--decode", f"grpc://127.0.0.1:{decode.port}",
             "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-startup-check-interval", "1", "--health-check-interval-secs", "2",
             "--log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "NO_COLOR": "1"})
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if router.poll() is not None:
            raise RuntimeError(f"router exited:\n{router_log.read_text()[-4000:]}")
        try:
            status, body = http("GET", f"{base}/workers", timeout=5)
        except OSError:
            return False
        return status == 200 and sum(bool(w.get("is_healthy"))
                                     for w in body.get("workers", [])) == 2

    try:
        wait_for(ready, 90, "the router to see a healthy prefill and decode")
    except BaseException:
        stop_router(router)
        raise
    return router, base, router_log


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
         ) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("pd")
    bport = free_port()
    common = ["--disaggregation-transfer-backend", "zmq", "--log-requests", "--enable-metrics"]
    for leg in ("prefill", "decode"):
        (tmp / f"prof_{leg}").mkdir()
    # two data-parallel ranks on each side (a room's KV is on prefill rank room % 2), and
    # speculative decoding on decode (exact: the tokens stay a plain worker's)
    prefill = start_server(tmp, "--disaggregation-mode", "prefill", "--dp-size", "2",
                           "--disaggregation-bootstrap-port", str(bport), *common,
                           "--profile-dir", str(tmp / "prof_prefill"),
                           env=PD_ENV, wait=False)
    decode = start_server(tmp, "--disaggregation-mode", "decode", "--dp-size", "2",
                          "--speculative-algorithm", "NGRAM", *common,
                          "--profile-dir", str(tmp / "prof_decode"), env=PD_ENV, wait=False)
    router = None
    try:
        plain = request.getfixturevalue("server")
        for srv in (prefill, decode):
            wait_started(srv)
        router, base, router_log = launch_pd_router(prefill, decode, bport, tmp)
        status, models = http("GET", f"{base}/v1/models")
        assert status == 200
        yield Pair(prefill, decode, plain, bport, router, base, models["data"][0]["id"],
                   router_log)
    finally:
        if router is not None:
            stop_router(router)
        prefill.stop()
        decode.stop()


# ---------------------------------------------------------------------- the happy path


def test_server_info_carries_what_the_router_pairs_on(pair: Pair) -> None:
    for srv, mode in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        info = srv.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        args = dict(info.server_args)
        assert args["disaggregation_mode"] == mode
        assert args["disaggregation_transfer_backend"] == "zmq"
        assert args["page_size"] == 1 and args["kv_cache_dtype"] == "auto"
        assert {"disaggregation_bootstrap_port", "tp_size", "dp_size",
                "max_running_requests"} <= set(args)
    assert dict(pair.prefill.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
                .server_args)["disaggregation_bootstrap_port"] == pair.bootstrap_port
    status, body = http("GET", f"{pair.base}/workers")
    kinds = sorted(w["worker_type"] for w in body["workers"])
    assert kinds == ["decode", "prefill"]
    router_generate(pair, PROMPTS[0], 2)
    for srv, mode in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        def transferred(s: ServerProc = srv, mode: str = mode) -> Any:
            loads = s.stub().GetLoads(pb.GetLoadsRequest(include=["disagg"]), timeout=10)
            assert len(loads.loads) == 2
            assert all(ld.disaggregation.mode == mode for ld in loads.loads)
            done = [ld.disaggregation for ld in loads.loads
                    if ld.disaggregation.kv_transfer_latency_ms > 0]
            return done[0] if done else False
        d = wait_for(transferred, 10, f"{mode}'s DisaggregationMetrics")
        assert d.kv_transfer_speed_gb_s > 0


@pytest.mark.parametrize("ids", PROMPTS, ids=["p8", "p13", "p3", "p100"])
def test_generate_through_the_router_equals_a_plain_worker(pair: Pair, ids: list[int]) -> None:
    n = 12
    want = plain_generate(pair, ids, n, return_logprob=True)
    out = router_generate(pair, ids, n, return_logprob=True)
    assert out["output_ids"] == list(want.output_ids)
    got_lps = [lp[0] for lp in out["meta_info"]["output_token_logprobs"]]
    assert got_lps == pytest.approx(list(want.output_logprobs.token_logprobs), abs=1e-4)
    # (the first token's logprob came from prefill, the others from decode)
    # streamed: the same tokens
    events = sse(f"{pair.base}/generate", {
        "model": pair.model, "input_ids": ids, "stream": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    tokens = [t for e in events for t in e.get("output_ids", [])]
    # (the router's last event repeats the last token: the same with a plain worker)
    assert tokens[:n] == list(want.output_ids), events[-2:]
    assert events[-1]["text"] == out["text"]
    assert_freed(pair.prefill, pair.decode)


def test_prompt_logprobs_from_prefill_reach_the_client(pair: Pair) -> None:
    ids = PROMPTS[1]
    want = plain_generate(pair, ids, 4, return_logprob=True, logprob_start_len=0)
    out = router_generate(pair, ids, 4, return_logprob=True, logprob_start_len=0)
    got = [lp[0] for lp in out["meta_info"]["input_token_logprobs"]]
    expected = [v.value if v.HasField("value") else None
                for v in want.input_logprobs.token_logprobs]
    assert len(got) == len(expected)
    assert [g for g in got if g is not None] == pytest.approx(
        [e for e in expected if e is not None], abs=1e-4)
    assert out["output_ids"] == list(want.output_ids)


def test_chat_completions_stream_and_not_agree(pair: Pair) -> None:
    body = {"model": pair.model, "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": 10, "temperature": 0}
    status, answer = http("POST", f"{pair.base}/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] >= 1
    text = answer["choices"][0]["message"]["content"]
    events = sse(f"{pair.base}/v1/chat/completions", {**body, "stream": True})
    streamed = "".join(c.get("delta", {}).get("content") or ""
                       for e in events for c in e.get("choices", []))
    assert streamed == text
    # top logprobs: the first token's from prefill, the rest from decode; greedy picks top 1
    status, answer = http("POST", f"{pair.base}/v1/chat/completions",
                          {**body, "logprobs": True, "top_logprobs": 2})
    assert status == 200, answer
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"]
    for tok in content:
        assert len(tok["top_logprobs"]) == 2
        assert tok["logprob"] == pytest.approx(tok["top_logprobs"][0]["logprob"], abs=1e-5)
    assert_freed(pair.prefill, pair.decode)


def test_prefix_cache_on_prefill_reports_cached_tokens(pair: Pair) -> None:
    # the room picks the prefill rank (room % 2): of 12 requests sharing a prefix, those
    # after the first to land on a rank find it cached there (two misses at most)
    ids = list(range(140, 200))
    cached = [router_generate(pair, ids + [k], 2)["meta_info"]["cached_tokens"]
              for k in range(12)]
    assert cached[0] == 0
    assert sum(c >= len(ids) for c in cached) >= 10, cached


def test_stop_token_and_max_new_tokens_apply_to_the_first_token_on_decode(pair: Pair) -> None:
    ids = PROMPTS[0]
    first = plain_generate(pair, ids, 1).output_ids[0]
    status, body = http("POST", f"{pair.base}/generate", {
        "model": pair.model, "input_ids": ids,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first]}})
    assert status == 200, body
    out = body[0] if isinstance(body, list) else body
    assert out["output_ids"] in ([first], [])  # stop trimmed or kept, as a plain worker
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert router_generate(pair, ids, 1)["output_ids"] == [first]
    assert_freed(pair.prefill, pair.decode)


def test_stop_strings_and_constrained_decoding_on_decode(pair: Pair) -> None:
    ids = PROMPTS[1]
    text = router_generate(pair, ids, 12)["text"]
    stop = text[5:7]
    req = greedy(ids, 12)
    req.sampling_params.stop.append(stop)
    want = list(pair.plain.stub().Generate(req, timeout=60))[-1].complete
    # (both legs driven as the router drives them: smg 1.13's /generate does not pass
    # sampling_params.stop on to the workers)
    def with_stop() -> pb.GenerateRequest:
        r = greedy(ids, 12)
        r.sampling_params.stop.append(stop)
        return r

    _, d = _both_legs(pair.prefill, pair.decode, pair.bootstrap_port, 31337, with_stop)
    got = d[-1].complete
    assert list(got.output_ids) == list(want.output_ids) and len(want.output_ids) < 12
    assert got.finish_reason == "stop" and got.matched_stop_str == stop
    # a regex: prefill's first token and decode's rest both obey it
    regex = "(ab|cd)[0-9]{3}"
    req = greedy(ids, 10)
    req.sampling_params.regex = regex
    want = list(pair.plain.stub().Generate(req, timeout=60))[-1].complete
    status, body = http("POST", f"{pair.base}/generate", {
        "model": pair.model, "input_ids": ids,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0, "regex": regex}})
    assert status == 200, body
    out = body[0] if isinstance(body, list) else body
    assert out["output_ids"] == list(want.output_ids)
    import re

    assert re.fullmatch(regex, out["text"]), out["text"]
    assert_freed(pair.prefill, pair.decode)


def test_n2_gives_two_samples_through_the_router(pair: Pair) -> None:
    body = {"model": pair.model, "n": 2, "max_tokens": 8, "temperature": 1.0,
            "messages": [{"role": "user", "content": "Two answers"}]}
    status, answer = http("POST", f"{pair.base}/v1/chat/completions", body)
    assert status == 200, answer
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1]
    events = sse(f"{pair.base}/v1/chat/completions", {**body, "stream": True})
    assert {c["index"] for e in events for c in e.get("choices", [])} == {0, 1}
    # greedy: both samples are the plain worker's tokens (sample 1 decodes from sample 0's KV)
    ids = PROMPTS[1]
    want = list(plain_generate(pair, ids, 6).output_ids)
    def two() -> pb.GenerateRequest:
        r = greedy(ids, 6)
        r.sampling_params.n = 2
        return r

    _, d = _both_legs(pair.prefill, pair.decode, pair.bootstrap_port, 5150, two)
    finals = [r.complete for r in d if r.HasField("complete")]
    assert sorted(f.index for f in finals) == [0, 1]
    assert all(list(f.output_ids) == want for f in finals)
    assert_freed(pair.prefill, pair.decode)


def test_sampled_generation_completes(pair: Pair) -> None:
    status, body = http("POST", f"{pair.base}/generate", {
        "model": pair.model, "input_ids": PROMPTS[1],
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.8, "top_p": 0.9,
                            "ignore_eos": True}})
    assert status == 200, body
    out = body[0] if isinstance(body, list) else body
    assert len(out["output_ids"]) == 10 and all(0 <= t < 261 for t in out["output_ids"])


def test_200_concurrent_requests_all_complete(pair: Pair) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randrange(3, 40))] for _ in range(200)]

    def one(ids: list[int]) -> int:  # short: prefill's first token, then two decode steps
        return len(router_generate(pair, ids, 3)["output_ids"])

    with ThreadPoolExecutor(32) as pool:
        lengths = list(pool.map(one, prompts))
    assert lengths == [3] * 200
    assert_freed(pair.prefill, pair.decode, timeout=20)


def test_each_leg_profiles_through_its_sidecar(pair: Pair) -> None:
    """What `bench_serving --pd-separated --profile --profile-prefill-url P
    --profile-decode-url D` does: start each worker's profiler on its sidecar, run requests
    through the router, stop them: a trace from each worker (each of its two ranks)."""
    body = json.dumps({"activities": ["CPU"], "num_steps": None, "profile_by_stage": False,
                       "profile_stages": None, "profile_prefix": None}).encode()
    legs = (pair.prefill, pair.decode)
    for srv in legs:
        req = urllib.request.Request(f"{srv.http_url}/start_profile", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
    for ids in PROMPTS[:3]:
        router_generate(pair, ids, 4)
    for srv in legs:
        req = urllib.request.Request(f"{srv.http_url}/stop_profile", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200
    root = pair.router_log.parent
    for leg in ("prefill", "decode"):
        traces = sorted((root / f"prof_{leg}").glob("*.trace.json.gz"))  # (SGLang client runs: bench/)
        assert len(traces) == 2, (leg, traces)  # one per data-parallel rank


BENCH_PYTHONPATH = os.environ.get("SGLANG_BENCH_PYTHONPATH", "")


def forward_steps(path: Path) -> list[str]:
    """The forward-step names (``forward_extend`` / ``forward_decode``) in a gzipped
    Chrome trace, batch sizes cut off."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return [e["name"].split("_bs")[0] for e in data["traceEvents"]
            if e.get("name", "").startswith("forward_")]


@pytest.mark.skipif(not BENCH_PYTHONPATH, reason=(
    "SGLang's bench_serving needs sglang and much of its stack: set SGLANG_BENCH_PYTHONPATH "
    "to a PYTHONPATH where `import sglang.benchmark.serving` works (docs/pd.md)"))
def test_sglangs_own_bench_serving_profiles_each_leg(pair: Pair) -> None:
    """SGLang's own client, ``python -m sglang.benchmark.serving --backend sglang
    --pd-separated --profile``, requests through the router, once with
    ``--profile-prefill-url`` (the prefill worker's sidecar) and once with
    ``--profile-decode-url`` (SGLang refuses both in one run: argparse makes them mutually
    exclusive). Each run completes its requests and the named worker alone writes traces,
    one per rank, under its ``--profile-dir``: prefill steps on prefill, decode steps only
    on decode (decode never runs a prefill forward)."""
    root = pair.router_log.parent

    def traces_of(leg: str) -> set[Path]:
        return set((root / f"prof_{leg}").rglob("*.trace.json.gz"))

    for leg, srv in (("prefill", pair.prefill), ("decode", pair.decode)):
        out = root / f"prof_{leg}" / "bench"
        out.mkdir()
        other = "decode" if leg == "prefill" else "prefill"
        before = traces_of(other)
        done = subprocess.run(
            [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
             "--base-url", pair.base, "--model", pair.model, "--tokenizer", pair.model,
             "--extra-request-body", json.dumps({"model": pair.model}),  # the router needs it
             "--dataset-name", "random-ids", "--num-prompts", "8", "--random-input-len", "16",
             "--random-output-len", "4", "--profile", "--profile-activities", "CPU",
             "--pd-separated", f"--profile-{leg}-url", srv.http_url],
            capture_output=True, text=True, timeout=300, cwd=root,
            env={**os.environ, "PYTHONPATH": BENCH_PYTHONPATH, "HF_HUB_OFFLINE": "1",
                 # where bench_serving puts output_dir (<it>/<time>): inside --profile-dir
                 "SGLANG_TORCH_PROFILER_DIR": str(out)},
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        name = f"{leg.capitalize()}-0"
        assert f"Profiler started for {name} worker at {srv.http_url}" in done.stdout
        assert f"Profiler stopped for {name} worker at {srv.http_url}" in done.stdout
        assert "Successful requests:                     8" in done.stdout, done.stdout[-3000:]
        (run,) = out.iterdir()  # the <time> directory of this run's start_profile
        traces = sorted(run.glob("*.trace.json.gz"))
        assert len(traces) == 2, traces  # one per data-parallel rank
        steps = {s for t in traces for s in forward_steps(t)}
        if leg == "prefill":
            # its prompts' prefills only (bench_serving's warm-up prompt comes again in the
            # run: found in the prefix cache, its last token runs as a 1-token step, a
            # prefill still)
            assert steps == {"forward_extend"}, steps
        else:  # decode joins its requests without a prefill forward
            assert steps == {"forward_decode"}, steps
        assert traces_of(other) == before, f"the {other} worker was profiled too"
    assert_freed(pair.prefill, pair.decode)


def test_fake_bootstrap_host_runs_without_a_transfer(pair: Pair) -> None:
    req = pd_request(PROMPTS[0], 5, "2.2.2.2", 0, 0, rid="warmup")
    outs = list(pair.decode.stub().Generate(req, timeout=60))
    assert list(outs[-1].complete.output_ids) == list(plain_generate(pair, PROMPTS[0], 5).output_ids)
    assert_freed(pair.decode)


# ---------------------------------------------------------------------- refusals


def test_a_plain_request_at_a_decode_worker_is_refused(pair: Pair) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(pair.decode.stub().Generate(greedy(PROMPTS[0], 3), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "disaggregated_params" in err.value.details()


def test_bad_disaggregated_params_are_refused(pair: Pair) -> None:
    for host, port, room in (("", 8998, 1), ("127.0.0.1", 0, 1), ("127.0.0.1", 70000, 1),
                             ("127.0.0.1", 8998, -5), ("h" * 300, 8998, 1)):
        with pytest.raises(grpc.RpcError) as err:
            list(pair.decode.stub().Generate(pd_request(PROMPTS[0], 3, host, port, room),
                                             timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (host, port, room)
    assert_serving(pair)


def pd_series(srv: ServerProc) -> dict[str, float]:
    """SGLang's PD Prometheus series of a worker (GetMetrics), summed over its ranks."""
    from prometheus_client.parser import text_string_to_metric_families

    text = srv.stub().GetMetrics(pb.GetMetricsRequest(), timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "transfer" in sample.name or "bootstrap" in sample.name \
                    or "_queue_reqs" in sample.name:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


PD_SERIES = {"sglang:num_prefill_prealloc_queue_reqs", "sglang:num_prefill_inflight_queue_reqs",
             "sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs",
             "sglang:kv_transfer_speed_gb_s", "sglang:kv_transfer_latency_ms",
             "sglang:kv_transfer_total_mb", "sglang:kv_transfer_bootstrap_ms",
             "sglang:kv_transfer_alloc_ms", "sglang:num_bootstrap_failed_reqs_total",
             "sglang:num_transfer_failed_reqs_total"}


def test_sglang_pd_series_on_metrics(pair: Pair) -> None:
    """SGLang's PD series on both legs: the last transfer's speed, latency and size, the
    queue a waiting room is in, and a failed request counted by the phase it failed in."""
    # a prompt no earlier request began with (no cached prefix on either leg)
    router_generate(pair, list(range(129, 29, -1)), 2)
    # 100 prompt tokens x 4 layers x K,V x 2 KV heads x 32 dims x float32 (the sum over the
    # ranks of each one's last transfer holds at least this one's)
    size_mb = 100 * 8 * 2 * 32 * 4 / 1e6 - 1e-9
    for srv in (pair.prefill, pair.decode):
        def moved(s: ServerProc = srv) -> Any:
            got = pd_series(s)
            return got if got.get("sglang:kv_transfer_total_mb", 0) >= size_mb else False
        got = wait_for(moved, 10, f"the transfer in {srv.target}'s PD series")
        assert set(got) >= PD_SERIES, PD_SERIES - set(got)
        assert got["sglang:kv_transfer_speed_gb_s"] > 0
        assert got["sglang:kv_transfer_latency_ms"] > 0
    before = pd_series(pair.decode)
    # a room waiting for its KV is in decode's transfer queue; its failure is a transfer's
    fake = FakePrefill()
    try:
        result: dict[str, Any] = {}

        def run() -> None:
            result["err"], _ = _fail_after(pair.decode.stub().Generate(
                pd_request(PROMPTS[2], 3, "127.0.0.1", fake.port, 33001), timeout=60))

        t = threading.Thread(target=run)
        t.start()
        hs = fake.handshake()
        wait_for(lambda: pd_series(pair.decode)["sglang:num_decode_transfer_queue_reqs"] == 1,
                 10, "decode's transfer queue 1")
        fake.notify(hs["notify"], {"kind": "done", "room": 33001, "ok": False,
                                   "error": "kv transfer failed: disk on fire"})
        t.join(60)
        assert "disk on fire" in result["err"].details()
    finally:
        fake.close()
    # and an unreachable bootstrap server is a bootstrap failure
    _fail_after(pair.decode.stub().Generate(
        pd_request(PROMPTS[0], 3, "127.0.0.1", free_port(), 33002), timeout=60))

    def counted() -> Any:
        got = pd_series(pair.decode)
        return got if got["sglang:num_decode_transfer_queue_reqs"] == 0 and got[
            "sglang:num_bootstrap_failed_reqs_total"] > before[
            "sglang:num_bootstrap_failed_reqs_total"] else False
    after = wait_for(counted, 10, "the failures counted")
    for name in ("sglang:num_bootstrap_failed_reqs_total", "sglang:num_transfer_failed_reqs_total"):
        assert after[name] == before[name] + 1, name
    assert_freed(pair.decode)


# ---------------------------------------------------------------------- failures


def _fail_after(call: Any) -> tuple[grpc.RpcError, float]:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    return err.value, time.monotonic() - t0


@pytest.mark.parametrize("sent", ["no pages", "part of the pages"])
def test_prefill_dies_mid_transfer_decode_fails_on_its_own(pair: Pair, sent: str) -> None:
    """A prefill that dies after decode's handshake: before any page went, or with part of
    the room's pages sent (the first chunk of a chunked room: decode's receiver holds the
    room half-written). Decode fails the room on its own (its heartbeat finds the prefill's
    bootstrap server gone), frees the KV and keeps serving."""
    fake = FakePrefill()
    try:
        room = 4242 if sent == "no pages" else 4243
        result: dict[str, Any] = {}

        def run() -> None:
            result["err"], result["s"] = _fail_after(pair.decode.stub().Generate(
                pd_request(PROMPTS[2], 5, "127.0.0.1", fake.port, room), timeout=60))

        t = threading.Thread(target=run)
        t.start()
        hs = fake.handshake()
        assert hs["kind"] == "handshake" and hs["room"] == room
        assert len(hs["dst_slots"]) == len(PROMPTS[2])
        wait_for(lambda: used_tokens(pair.decode) >= len(PROMPTS[2]), 10, "decode's KV held")
        if sent != "no pages":
            fake.send_chunk(hs, room, 0, 3)  # 3 of the 8 layer buffers' rows
        fake.alive = False  # the prefill's bootstrap stops answering: it died
        t.join(60)
        err = result["err"]
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "kv transfer failed" in err.details() and "might be dead" in err.details()
        assert result["s"] < 10  # heartbeat every 1 s, 2 misses; not the 12 s timeout
    finally:
        fake.close()
    assert_freed(pair.decode)
    assert_serving(pair)


@pytest.mark.parametrize("how", ["corrupt", "short", "part of the chunks", "failed"])
def test_a_corrupt_short_or_failed_transfer_fails_the_request(pair: Pair, how: str) -> None:
    fake = FakePrefill()
    try:
        room = {"corrupt": 501, "short": 502, "failed": 503, "part of the chunks": 504}[how]
        result: dict[str, Any] = {}

        def run() -> None:
            result["err"], result["s"] = _fail_after(pair.decode.stub().Generate(
                pd_request(PROMPTS[1], 5, "127.0.0.1", fake.port, room), timeout=60))

        t = threading.Thread(target=run)
        t.start()
        hs = fake.handshake()
        sender = fake.pool_like(hs)
        from sglang_admin.disaggregation.transfer import PeerDescriptor

        peer = PeerDescriptor.from_wire(hs["peer"])
        dst = hs["dst_slots"]
        src = list(range(len(dst)))
        if how == "short":  # the pages of all but the last token
            res = sender.send(room, peer, src[:-1], dst[:-1], 5)
            assert not res.ok and "slots differ" in res.error  # refused at the receiver
            fake.notify(hs["notify"], {"kind": "done", "room": room, "ok": True, "weight_version": "default",
                                       "first_token": 7, "checksum": sender.checksum(src),
                                       "nbytes": 0, "seconds": 0.0})
        elif how == "part of the chunks":  # 2 of 8 buffers' rows, then "done" as if all
            fake.send_chunk(hs, room, 0, 2)
            time.sleep(0.3)
            fake.notify(hs["notify"], {"kind": "done", "room": room, "ok": True,
                                       "weight_version": "default", "first_token": 7,
                                       "checksum": sender.checksum(src), "nbytes": 0,
                                       "seconds": 0.0})
        elif how == "corrupt":  # sent, then claimed to be other bytes
            assert sender.send(room, peer, src, dst, 5).ok
            fake.notify(hs["notify"], {"kind": "done", "room": room, "ok": True, "weight_version": "default",
                                       "first_token": 7, "checksum": sender.checksum(src) ^ 1,
                                       "nbytes": 0, "seconds": 0.0})
        else:
            fake.notify(hs["notify"], {"kind": "done", "room": room, "ok": False,
                                       "error": "kv transfer failed: disk on fire"})
        t.join(60)
        err = result["err"]
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "kv transfer failed" in err.details()
        if how != "failed":
            assert "checksum mismatch" in err.details()
        else:
            assert "disk on fire" in err.details()
        assert result["s"] < 10
    finally:
        fake.close()
    assert_freed(pair.decode)
    assert_serving(pair)


def test_flush_and_pause_with_a_request_in_transfer_lose_nothing(pair: Pair) -> None:
    """A decode request waiting for its KV: FlushCache does not run under it (the rank is
    busy), PauseGeneration in_place holds it; the KV arrives, and after ContinueGeneration it
    completes from token 2 as if nothing happened."""
    fake = FakePrefill()
    stub = pair.decode.stub()
    try:
        room = 12321
        result: dict[str, Any] = {}

        def run() -> None:
            result["out"] = list(stub.Generate(
                pd_request(FAKE_KV_PROMPTS[0], 5, "127.0.0.1", fake.port, room), timeout=60))

        t = threading.Thread(target=run)
        t.start()
        hs = fake.handshake()
        flush = stub.FlushCache(pb.FlushCacheRequest(timeout_s=0), timeout=30)
        assert not flush.success  # busy: the room's KV is reserved
        assert stub.PauseGeneration(pb.PauseGenerationRequest(mode="in_place"),
                                    timeout=30).success
        sender = fake.pool_like(hs)
        from sglang_admin.disaggregation.transfer import PeerDescriptor

        src = list(range(len(hs["dst_slots"])))
        assert sender.send(room, PeerDescriptor.from_wire(hs["peer"]), src, hs["dst_slots"], 5).ok
        fake.notify(hs["notify"], {"kind": "done", "room": room, "ok": True, "first_token": 9,
                                   "weight_version": "default",
                                   "checksum": sender.checksum(src)})
        time.sleep(1.0)
        assert t.is_alive()  # paused: joined, not stepped
        assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
        t.join(60)
        complete = result["out"][-1].complete
        assert complete.output_ids[0] == 9 and len(complete.output_ids) == 5
        assert stub.FlushCache(pb.FlushCacheRequest(timeout_s=10), timeout=30).success
    finally:
        fake.close()
    assert_freed(pair.decode)


def test_kv_for_an_unknown_room_is_refused_and_harms_nothing(pair: Pair) -> None:
    fake = FakePrefill()
    try:
        room = 777
        result: dict[str, Any] = {}

        def run() -> None:
            result["out"] = list(pair.decode.stub().Generate(
                pd_request(FAKE_KV_PROMPTS[1], 4, "127.0.0.1", fake.port, room), timeout=60))

        t = threading.Thread(target=run)
        t.start()
        hs = fake.handshake()
        sender = fake.pool_like(hs)
        from sglang_admin.disaggregation.transfer import PeerDescriptor

        peer = PeerDescriptor.from_wire(hs["peer"])
        # pages and a completion for a room decode never asked for
        bad = sender.send(room + 1, peer, [0], [hs["dst_slots"][0]], 5)
        assert not bad.ok and "unknown room" in bad.error
        fake.notify(hs["notify"], {"kind": "done", "room": room + 1, "ok": True,
                                   "first_token": 1, "checksum": 0})
        fake.notify(hs["notify"], {"kind": "bogus", "room": room})
        # then the real room's pages: the request completes from token 2
        src = list(range(len(hs["dst_slots"])))
        assert sender.send(room, peer, src, hs["dst_slots"], 5).ok
        fake.notify(hs["notify"], {"kind": "done", "room": room, "ok": True, "weight_version": "default", "first_token": 9,
                                   "checksum": sender.checksum(src), "nbytes": 1,
                                   "seconds": 0.001})
        t.join(60)
        complete = result["out"][-1].complete
        assert complete.output_ids[0] == 9 and len(complete.output_ids) == 4
    finally:
        fake.close()
    assert_freed(pair.decode)


def test_kv_of_other_weights_is_never_decoded(pair: Pair) -> None:
    """A refit on one leg only: decode refuses the KV computed with the other weights."""
    stub = pair.decode.stub()
    assert stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(new_version="v2"),
                                    timeout=30).success
    try:
        status, body = http("POST", f"{pair.base}/generate", {
            "model": pair.model, "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}, timeout=120)
        assert status >= 500, body
        assert "weight version mismatch" in json.dumps(body), body
    finally:
        assert stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(new_version="default"),
                                        timeout=30).success
    assert_freed(pair.prefill, pair.decode)
    assert_serving(pair)


def test_a_room_never_arriving_and_a_handshake_never_coming_time_out(pair: Pair) -> None:
    """Decode handshakes with the real prefill, which never gets the request: decode's
    waiting timeout ends it ("kv transfer timed out"). Prefill gets a request whose decode
    never handshakes: its bootstrap timeout ends it ("bootstrap timed out"). Both 12 s
    clocks run at once (two rooms, one on each leg)."""
    results: dict[str, tuple[grpc.RpcError, float]] = {}

    def run(leg: str, srv: ServerProc, room: int) -> None:
        results[leg] = _fail_after(srv.stub().Generate(
            pd_request(PROMPTS[0], 4, "127.0.0.1", pair.bootstrap_port, room), timeout=60))

    threads = [threading.Thread(target=run, args=("decode", pair.decode, 99001)),
               threading.Thread(target=run, args=("prefill", pair.prefill, 88002))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    err, took = results["decode"]
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "kv transfer timed out" in err.details()
    assert 11 < took < 30
    err, took = results["prefill"]
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "bootstrap timed out" in err.details()
    assert 11 < took < 30
    assert_freed(pair.decode, pair.prefill)
    assert_serving(pair)


def test_unreachable_bootstrap_fails_with_bootstrap_in_the_message(pair: Pair) -> None:
    err, took = _fail_after(pair.decode.stub().Generate(
        pd_request(PROMPTS[0], 4, "127.0.0.1", free_port(), 99002), timeout=60))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "bootstrap failed" in err.details()
    assert took < 10
    assert_freed(pair.decode)


def _prefill_control(pair: Pair, room: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{pair.bootstrap_port}/route", timeout=5) as r:
        table = json.loads(r.read())
    assert table["dp_size"] == 2
    return table["ranks"][str(room % table["dp_size"])]


def _prefill_layout() -> Any:
    """A KV receiver's descriptor with the module prefill's pool layout (4 layers x K,V;
    2 KV heads x 32 dims float32 a token), at no address: for stand-in decode receivers."""
    from sglang_admin.disaggregation.transfer import BufferInfo, PeerDescriptor

    return PeerDescriptor("127.0.0.1:1", tuple(BufferInfo(4096, 200 * 256, 256)
                                               for _ in range(8)))


@pytest.mark.parametrize("when", ["before its pages", "with its pages in flight"])
def test_decode_dies_mid_transfer_prefill_fails_and_frees(pair: Pair, when: str) -> None:
    """A handshake from a decode that dies: before prefill sends (its receiver already
    gone), or once the room's pages reached its receiver and before it answered. Prefill's
    send gets no answer: the room fails within the transfer timeout with "kv transfer
    failed", decode's notify address is told, the KV is freed and prefill keeps serving."""
    import torch

    from sglang_admin.disaggregation.zmq_backend import ZmqBackend

    fake = FakePrefill()  # reused for its control socket and PUSH helper
    gone = ZmqBackend()
    stalled = StalledReceiver(_prefill_layout()) if when != "before its pages" else None
    try:
        room = 88001 if stalled is None else 88003
        result: dict[str, Any] = {}

        def run() -> None:
            result["err"], result["s"] = _fail_after(pair.prefill.stub().Generate(
                pd_request(PROMPTS[3], 4, "127.0.0.1", pair.bootstrap_port, room), timeout=60))

        t = threading.Thread(target=run)
        t.start()
        if stalled is None:
            # a pool of the prefill's layout (4 layers x K,V; 2 KV heads x 32 dims float32)
            gone.register_buffers([torch.zeros(200, 2 * 32 * 4, dtype=torch.uint8)
                                   for _ in range(8)])
            gone.start()
            desc = gone.descriptor().to_wire()
            gone.close()  # the decode died after its handshake
        else:
            desc = stalled.descriptor
        fake.notify(_prefill_control(pair, room), {
            "kind": "handshake", "room": room, "rid": "x", "peer": desc,
            "dst_slots": list(range(1, len(PROMPTS[3]) + 1)), "notify": fake.control})
        if stalled is not None:
            assert stalled.take(room) == len(PROMPTS[3]) * 256 * 8  # every page is there
            stalled.die()  # and the decode dies before it answers
            stalled = None
        t.join(60)
        err = result["err"]
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "kv transfer failed" in err.details()
        assert result["s"] < 10  # the 4 s transfer timeout
        told = fake.next_message(5)  # decode's notify address hears of the failure
        assert told is not None and told["ok"] is False
    finally:
        if stalled is not None:
            stalled.die()
        fake.close()
    assert_freed(pair.prefill)
    assert_serving(pair)


def test_a_client_that_disconnects_during_the_transfer_frees_both(pair: Pair) -> None:
    """The prefill leg cancelled (the router's abort on a dropped client) while its send
    is in flight: the room's pages reached decode's receiver, which has not answered. The
    send runs out (the receiver answers), decode is told the room failed ("aborted"), and
    prefill frees the KV at once. (The decode leg cancelled past its handshake:
    test_a_client_that_disconnects_while_waiting_frees_the_kv.)"""
    fake = FakePrefill()
    stalled = StalledReceiver(_prefill_layout())
    try:
        room = 88005
        call = pair.prefill.stub().Generate(
            pd_request(PROMPTS[3], 4, "127.0.0.1", pair.bootstrap_port, room), timeout=60)
        fake.notify(_prefill_control(pair, room), {
            "kind": "handshake", "room": room, "rid": "x", "peer": stalled.descriptor,
            "dst_slots": list(range(1, len(PROMPTS[3]) + 1)), "notify": fake.control})
        stalled.take(room)  # the pages are on their way
        wait_for(lambda: used_tokens(pair.prefill) >= len(PROMPTS[3]), 10, "prefill's KV held")
        t0 = time.monotonic()
        call.cancel()
        time.sleep(0.3)
        stalled.answer(room)  # the bytes are in: the send returns ok
        told = fake.next_message(5)
        assert told is not None and told["room"] == room and told["ok"] is False, told
        assert "aborted" in told["error"], told
        assert_freed(pair.prefill, timeout=5)
        assert time.monotonic() - t0 < 6
    finally:
        stalled.die()
        fake.close()
    assert_serving(pair)


def test_a_client_that_disconnects_while_decode_bootstraps_frees_the_kv(pair: Pair) -> None:
    """The decode leg cancelled while its bootstrap lookup is still out (the prefill's
    bootstrap server answers late): its reserved KV goes at once, no handshake is sent."""
    fake = FakePrefill()
    fake.stall_s = 8.0
    try:
        ids = PROMPTS[3]
        call = pair.decode.stub().Generate(pd_request(ids, 4, "127.0.0.1", fake.port, 66100),
                                           timeout=60)
        wait_for(lambda: used_tokens(pair.decode) >= len(ids), 10, "decode's KV reserved")
        assert decode_queue(pair.decode) == 0  # not past a handshake
        t0 = time.monotonic()
        call.cancel()
        assert_freed(pair.decode, timeout=5)
        assert time.monotonic() - t0 < 5
        assert fake.next_message(1) is None  # no handshake went
    finally:
        fake.close()
    assert_serving(pair)


@pytest.mark.parametrize("leg", ["decode", "prefill"])
def test_a_client_that_disconnects_while_waiting_frees_the_kv(pair: Pair, leg: str) -> None:
    """Decode waiting for its KV, or prefill holding KV for a handshake: the call is
    cancelled (the router's abort on a dropped client) and the KV goes at once."""
    srv = pair.decode if leg == "decode" else pair.prefill
    fake = FakePrefill()
    try:
        port = fake.port if leg == "decode" else pair.bootstrap_port
        call = srv.stub().Generate(pd_request(PROMPTS[3], 4, "127.0.0.1", port, 66000 + len(leg)),
                                   timeout=60)
        if leg == "decode":
            fake.handshake()
        wait_for(lambda: used_tokens(srv) >= len(PROMPTS[3]), 10, "the KV held")
        t0 = time.monotonic()
        call.cancel()
        assert_freed(srv, timeout=5)
        assert time.monotonic() - t0 < 5
        if leg == "decode":  # decode tells prefill it gave the room up
            msg = fake.next_message(5)
            assert msg is not None and msg["kind"] == "cancel"
    finally:
        fake.close()
    assert_serving(pair)


def test_a_streaming_client_that_drops_through_the_router_frees_both(pair: Pair) -> None:
    body = {"model": pair.model, "input_ids": PROMPTS[3], "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(f"{pair.base}/generate", data=json.dumps(body).encode(),
                                 method="POST", headers={"content-type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    for raw in resp:
        if raw.startswith(b"data:"):
            break
    resp.close()
    assert_freed(pair.prefill, pair.decode, timeout=40)  # the router drains decode <= 30 s
    assert_serving(pair)


def test_deadline_passing_while_decode_waits_frees_the_kv(pair: Pair) -> None:
    fake = FakePrefill()
    try:
        t0 = time.monotonic()
        call = pair.decode.stub().Generate(
            pd_request(PROMPTS[3], 4, "127.0.0.1", fake.port, 55001), timeout=3)
        fake.handshake()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 8
        msg = fake.next_message(5)  # prefill is told
        assert msg is not None and msg["kind"] == "cancel"
    finally:
        fake.close()
    assert_freed(pair.decode, timeout=5)


def test_fuzzed_control_messages_harm_no_leg(pair: Pair) -> None:
    """Garbage on both legs' control sockets: dropped (or the room they name fails); both
    keep serving, no KV held."""
    import zmq

    fake = FakePrefill()
    rng = random.Random(11)
    try:
        room = 44001
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["out"] = list(pair.decode.stub().Generate(
                    pd_request(FAKE_KV_PROMPTS[2], 4, "127.0.0.1", fake.port, room), timeout=60))
            except grpc.RpcError as exc:
                result["err"] = exc

        t = threading.Thread(target=run)
        t.start()
        hs = fake.handshake()
        targets = [hs["notify"], _prefill_control(pair, 0), _prefill_control(pair, 1)]
        values = [None, -1, 2**63 - 1, -2**63, "x", b"\xff", 3.5, [], {}, [[1, "a"]], {"a": 1}, True]
        ctx = zmq.Context.instance()
        for addr in targets:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"tcp://{addr}")
            for _ in range(200):
                kind = rng.choice(["handshake", "done", "cancel", "x", 5])
                msg = {"kind": kind, "room": rng.choice([room, 1, -3, 2**40, "r"])}
                for key in ("ok", "error", "first_token", "checksum", "peer", "dst_slots",
                            "notify", "top_logprobs", "logprob", "weight_version", "peers",
                            "tp_size", "checksums"):
                    if rng.random() < 0.5:
                        msg[key] = rng.choice(values)
                sock.send(msgpack.packb(msg) if rng.random() < 0.9 else rng.randbytes(20))
            sock.close()
        t.join(60)
        if "err" in result:  # the room got a malformed completion: failed with a clear status
            assert "kv transfer" in result["err"].details()
    finally:
        fake.close()
    assert_freed(pair.prefill, pair.decode, timeout=20)
    assert_serving(pair)


def _both_legs(prefill: ServerProc, decode: ServerProc, bport: int, room: int,
               make: Any) -> tuple[list[pb.GenerateResponse], list[pb.GenerateResponse]]:
    """Both legs at once with one room, as the router sends them."""
    out: dict[str, Any] = {}

    def leg(name: str, srv: ServerProc) -> None:
        req = make()
        req.request_id = f"pair{room}"
        req.disaggregated_params.bootstrap_host = "127.0.0.1"
        req.disaggregated_params.bootstrap_port = bport
        req.disaggregated_params.bootstrap_room = room
        out[name] = list(srv.stub().Generate(req, timeout=120))

    threads = [threading.Thread(target=leg, args=a) for a in (("p", prefill), ("d", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    return out["p"], out["d"]


def test_a_prefill_leg_pinned_to_another_rank_still_meets_decode(pair: Pair) -> None:
    """data_parallel_rank on the prefill leg does not move the room off rank room % 2."""
    ids = PROMPTS[0]
    want = list(plain_generate(pair, ids, 4).output_ids)
    room = 4001  # rank 1

    def pinned() -> pb.GenerateRequest:
        return greedy(ids, 4, data_parallel_rank=0)

    _, d = _both_legs(pair.prefill, pair.decode, pair.bootstrap_port, room, pinned)
    assert list(d[-1].complete.output_ids) == want
    assert_freed(pair.prefill, pair.decode)


# ------------------------------------------------ real processes killed (a pair's last act)
# The pairs below end with one of these: a real worker process SIGKILLed (its scheduler ranks
# die with it) while the other leg holds KV for a room. The mooncake pair and SmolLM2's lose
# their decode worker, the module's pair (in the module's last test) its prefill worker.


def decode_queue(decode: ServerProc) -> int:
    """Rooms at the decode worker past their handshake, waiting for their KV."""
    loads = decode.stub().GetLoads(pb.GetLoadsRequest(include=["disagg"]), timeout=10)
    return sum(ld.disaggregation.decode_transfer_queue_reqs for ld in loads.loads)


def _decode_leg_waiting(decode: ServerProc, bport: int, room: int, ids: list[int]
                        ) -> tuple[threading.Thread, dict[str, Any]]:
    """The decode leg of ``room`` alone, in a thread: its prealloc, bootstrap and handshake
    run against the real prefill, and it waits for a KV that nothing will send yet."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["out"] = list(decode.stub().Generate(
                pd_request(ids, 4, "127.0.0.1", bport, room), timeout=120))
        except grpc.RpcError as exc:
            result["err"], result["at"] = exc, time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: decode_queue(decode) == 1, 30, "decode's handshake (transfer queue 1)")
    wait_for(lambda: used_tokens(decode) >= len(ids), 10, "decode's KV reserved")
    return t, result


def kill_decode_after_its_handshake(prefill: ServerProc, decode: ServerProc, bport: int,
                                    room: int) -> None:
    """The decode worker SIGKILLed after its handshake for a room, before the KV went: the
    prefill leg's send finds no one, fails with "kv transfer failed" within the transfer
    timeout (4 s here, generous bound), frees the KV and keeps serving."""
    ids = list(range(100, 150))
    t, _ = _decode_leg_waiting(decode, bport, room, ids)
    time.sleep(0.5)  # the handshake, sent before decode's queue said so, reaches prefill
    assert decode.stop(signal.SIGKILL) == -signal.SIGKILL
    t.join(30)
    err, took = _fail_after(prefill.stub().Generate(
        pd_request(ids, 4, "127.0.0.1", bport, room), timeout=120))
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "kv transfer failed" in err.details(), err
    assert took < 30, took  # the transfer timeout (4 s) and the prefill forward
    assert_freed(prefill)
    want = list(prefill.stub().Generate(greedy(ids, 4), timeout=60))[-1].complete.output_ids
    assert len(want) == 4  # a plain request at the prefill worker: still serving


# ------------------------------------------------ LoRA and mooncake (a pair of their own)


@dataclass
class LoraPair:
    prefill: ServerProc
    decode: ServerProc
    bootstrap_port: int
    backend: str


def write_lora_adapter(model_dir: Path, path: Path, rank: int = 8, seed: int = 3) -> Path:
    """A random PEFT LoRA adapter (q_proj and v_proj of every layer) for the Llama
    checkpoint in ``model_dir``, written as PEFT's save_pretrained writes one
    (adapter_config.json, adapter_model.safetensors): no model is loaded to build it."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim,
            "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.15
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.15
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(outs), "bias": "none", "task_type": "CAUSAL_LM"}))
    return path


@pytest.fixture(scope="module")
def lora_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraPair]:
    """A pair of the embedded model with a LoRA adapter loaded on both legs, its KV over
    the mooncake transfer engine (TCP here; zmq where the pd extra is not installed, for
    the LoRA test alone). The mooncake test, which runs after the LoRA test, ends it."""
    import importlib.util

    from sglang_admin.model.default_model import ensure_default_model

    tmp = tmp_path_factory.mktemp("pd_lora")
    adapter = write_lora_adapter(Path(ensure_default_model()), tmp / "attn")
    backend = "mooncake" if importlib.util.find_spec("mooncake") else "zmq"
    bport = free_port()
    common = ["--enable-lora", "--max-lora-rank", "8", "--lora-paths", f"attn={adapter}",
              "--disaggregation-transfer-backend", backend]
    prefill = start_server(tmp, *common, "--disaggregation-mode", "prefill",
                           "--disaggregation-bootstrap-port", str(bport), env=PD_ENV, wait=False)
    decode = start_server(tmp, *common, "--disaggregation-mode", "decode", env=PD_ENV,
                          wait=False)
    try:
        for srv in (prefill, decode):
            wait_started(srv)
        yield LoraPair(prefill, decode, bport, backend)
    finally:
        prefill.stop()
        decode.stop()


def test_lora_requests_decode_with_the_adapter(lora_pair: LoraPair) -> None:
    prefill, decode, bport = lora_pair.prefill, lora_pair.decode, lora_pair.bootstrap_port
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    got: dict[str, list[int]] = {}
    for lora_id, room in (("attn", 11), ("", 12)):
        _, d = _both_legs(prefill, decode, bport, room,
                          lambda lid=lora_id: greedy(ids, 8, lora_id=lid))
        # the plain path on the same worker (SGLang's fake bootstrap host: no transfer)
        plain = greedy(ids, 8, lora_id=lora_id)
        plain.disaggregated_params.bootstrap_host = "2.2.2.2"
        want = list(decode.stub().Generate(plain, timeout=60))[-1].complete.output_ids
        got[lora_id] = list(d[-1].complete.output_ids)
        assert got[lora_id] == list(want), lora_id
    assert got["attn"] != got[""]  # the adapter changed the tokens on both legs
    assert_freed(prefill, decode)


def test_mooncake_pair_equals_a_plain_worker(lora_pair: LoraPair, server: ServerProc) -> None:
    """The same control plane over the mooncake transfer engine (TCP here): tokens and
    logprobs equal the plain worker's (the session's, the same embedded model: requests
    naming no adapter are the base model's), concurrent pairs complete, the KV is freed.
    Then the pair's last act: the decode worker is SIGKILLed after its handshake for a
    room, and the prefill leg's mooncake send fails, frees its KV and keeps serving."""
    if lora_pair.backend != "mooncake":
        pytest.skip("the pd extra (mooncake) is not installed")
    prefill, decode, bport = lora_pair.prefill, lora_pair.decode, lora_pair.bootstrap_port
    for room, ids in enumerate(PROMPTS, start=70):
        want = list(server.stub().Generate(greedy(ids, 10, return_logprob=True),
                                           timeout=60))[-1].complete
        _, d = _both_legs(prefill, decode, bport, room,
                          lambda i=ids: greedy(i, 10, return_logprob=True))
        got = d[-1].complete
        assert list(got.output_ids) == list(want.output_ids)
        assert list(got.output_logprobs.token_logprobs) == pytest.approx(
            list(want.output_logprobs.token_logprobs), abs=1e-4)
    rng = random.Random(9)
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(
            lambda r: _both_legs(prefill, decode, bport, r, lambda: greedy(
                [rng.randrange(0, 256) for _ in range(20)], 6))[1][-1].complete,
            range(100, 132)))
    assert all(len(o.output_ids) == 6 for o in outs)
    assert_freed(prefill, decode)
    kill_decode_after_its_handshake(prefill, decode, bport, room=140)
    prefill.stop()  # (the pair is done: not left idle until the module's end)


# ---------------------------------------------------------------------- SmolLM2 (a pair of its own)


def test_smollm2_pair_through_the_router_equals_a_plain_worker(tmp_path: Path) -> None:
    """The real SmolLM2-135M-Instruct GGUF behind the real router in PD mode: `/generate`
    and `/v1/chat/completions`, streaming and not, give a plain worker's greedy tokens,
    text and logprobs (the plain path: the prefill worker answers a request without
    disaggregated_params as a plain worker does). Then the decode worker is SIGKILLed after
    its handshake for a room: the prefill leg fails, frees its KV and keeps serving."""
    from transformers import AutoTokenizer

    from sglang_admin.cli import served_model_path

    try:
        path = served_model_path("smollm2")
    except ValueError as exc:
        pytest.skip(f"SmolLM2 is not installed (make smollm2): {exc}")
    bport = free_port()
    common = ["--model-path", str(path), "--disaggregation-transfer-backend", "zmq"]
    prefill = start_server(tmp_path, *common, "--disaggregation-mode", "prefill",
                           "--disaggregation-bootstrap-port", str(bport), env=PD_ENV, wait=False)
    decode = start_server(tmp_path, *common, "--disaggregation-mode", "decode", env=PD_ENV,
                          wait=False)
    tok = AutoTokenizer.from_pretrained(path)
    router = None
    try:
        for srv in (prefill, decode):
            wait_started(srv)
        router, base, _ = launch_pd_router(prefill, decode, bport, tmp_path)
        model = http("GET", f"{base}/v1/models")[1]["data"][0]["id"]

        def cold() -> None:
            """Both legs' prefix caches emptied: the plain path and the PD leg then prefill
            the whole prompt alike, and decode holds no earlier prompt's KV that it would
            adopt for a shared prefix (the chat prompt shares its first token with the
            first /generate prompt). In bfloat16 a prefix's KV from another forward moves
            the logprobs by ~1e-2 (up to 5e-2 seen at the dequantized load)."""
            for srv in (prefill, decode):
                assert srv.stub().FlushCache(pb.FlushCacheRequest(timeout_s=10),
                                             timeout=30).success

        def plain(ids: list[int], n: int, ignore_eos: bool = True) -> pb.GenerateComplete:
            req = greedy(ids, n, return_logprob=True)
            req.sampling_params.ignore_eos = ignore_eos
            cold()
            out = list(prefill.stub().Generate(req, timeout=120))[-1].complete
            cold()
            return out

        for ids in ([1, 504, 3458, 314, 260, 2389, 30], list(range(40, 140))):
            want = plain(ids, 16)
            body = {"model": model, "input_ids": ids, "sampling_params": {
                "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
            status, out = http("POST", f"{base}/generate", {**body, "return_logprob": True},
                               timeout=180)
            assert status == 200, out
            out = out[0] if isinstance(out, list) else out
            assert out["output_ids"] == list(want.output_ids)
            assert [lp[0] for lp in out["meta_info"]["output_token_logprobs"]] == \
                pytest.approx(list(want.output_logprobs.token_logprobs), abs=2e-3)
            assert out["text"] == tok.decode(want.output_ids, skip_special_tokens=True)
            if len(ids) < 50:  # streamed once: the same tokens
                cold()
                events = sse(f"{base}/generate", {**body, "stream": True}, timeout=180)
                streamed = [t for e in events for t in e.get("output_ids", [])]
                assert streamed[:16] == list(want.output_ids), events[-2:]

        # chat: the router renders the model's template; the same ids given to the plain
        # path give the same greedy answer (EOS honoured, as the router asks)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = list(rendered if isinstance(rendered, list) else rendered["input_ids"])
        want = plain(ids, 16, ignore_eos=False)
        text = tok.decode(want.output_ids, skip_special_tokens=True)
        chat = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
        status, answer = http("POST", f"{base}/v1/chat/completions",
                              {**chat, "logprobs": True}, timeout=180)
        assert status == 200, answer
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert answer["choices"][0]["message"]["content"] == text
        got = [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
        assert len(got) >= 1 and got == pytest.approx(list(want.output_logprobs.token_logprobs)[:len(got)],
                                    abs=2e-3)
        cold()
        events = sse(f"{base}/v1/chat/completions", {**chat, "stream": True}, timeout=180)
        assert "".join(c.get("delta", {}).get("content") or ""
                       for e in events for c in e.get("choices", [])) == text
        assert_freed(prefill, decode)
        stop_router(router)
        router = None
        kill_decode_after_its_handshake(prefill, decode, bport, room=31)
    finally:
        if router is not None:
            stop_router(router)
        prefill.stop()
        decode.stop()


# ---------------------------------------------------------------------- --tp-size 2 (a pair of its own)


def _legs(prefill: ServerProc, decode: ServerProc, bport: int, room: int, ids: list[int],
          n: int = 4) -> dict[str, Any]:
    """Both legs of ``room`` at once; each leg's last response, or its RpcError."""
    out: dict[str, Any] = {}

    def leg(name: str, srv: ServerProc) -> None:
        try:
            out[name] = list(srv.stub().Generate(
                pd_request(ids, n, "127.0.0.1", bport, room, rid=f"legs{room}"), timeout=60))[-1]
        except grpc.RpcError as exc:
            out[name] = exc

    threads = [threading.Thread(target=leg, args=a) for a in (("p", prefill), ("d", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return out


def test_tp2_pair_equals_a_plain_worker_and_refuses_another_tp_size(pair: Pair,
                                                                    tmp_path: Path) -> None:
    """A --tp-size 2 --dp-size 2 prefill and a --tp-size 2 decode, their KV over mooncake
    (zmq where the pd extra is not installed; zmq at tp 2: tests/unit/test_pd_tp_shards.py,
    real backends, the TP commands through an in-process group): each TP rank moves its own KV
    heads' shard from the prefill's data-parallel rank that holds the room (room % 2), so
    greedy tokens and logprobs equal the plain tp 1 worker's (one by one and 8 rooms at
    once) and the KV is freed on both; a leg of another TP size (this module's tp 1 pair,
    zmq: refused before any byte moves) is refused with "bootstrap" in the status, on
    either side, and frees its KV."""
    import importlib.util

    from sglang_admin.disaggregation.backends import make_backend

    backend = "mooncake" if importlib.util.find_spec("mooncake") else "zmq"
    bport = free_port()
    common = ["--disaggregation-transfer-backend", backend, "--tp-size", "2"]
    prefill = start_server(tmp_path, *common, "--disaggregation-mode", "prefill",
                           "--dp-size", "2", "--disaggregation-bootstrap-port", str(bport),
                           env=PD_ENV, wait=False)
    decode = start_server(tmp_path, *common, "--disaggregation-mode", "decode", env=PD_ENV,
                          wait=False)
    try:
        for srv in (prefill, decode):
            wait_started(srv)
        for room, ids in enumerate(PROMPTS, start=9100):
            want = plain_generate(pair, ids, 10, return_logprob=True)
            _, d = _both_legs(prefill, decode, bport, room,
                              lambda i=ids: greedy(i, 10, return_logprob=True))
            got = d[-1].complete
            assert list(got.output_ids) == list(want.output_ids), ids
            assert list(got.output_logprobs.token_logprobs) == pytest.approx(
                list(want.output_logprobs.token_logprobs), abs=1e-4)
        rng = random.Random(11)
        prompts = [[rng.randrange(0, 256) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda a: _legs(prefill, decode, bport, 9200 + a[0], a[1], 6),
                                 enumerate(prompts)))
        for ids, out in zip(prompts, outs):
            assert list(out["d"].complete.output_ids) == list(
                plain_generate(pair, ids, 6).output_ids), out
        assert_freed(prefill, decode)

        # another TP size on the other side: refused at bootstrap, before any handshake
        for room, (p_srv, d_srv, port, theirs) in enumerate(
                ((pair.prefill, decode, pair.bootstrap_port, 1),
                 (prefill, pair.decode, bport, 2)), start=9300):
            out = _legs(p_srv, d_srv, port, room, PROMPTS[1])
            err = out["d"]
            assert isinstance(err, grpc.RpcError), out
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert err.details().startswith("bootstrap failed") and (
                f"runs --tp-size {theirs}" in err.details()), err.details()
            err = out["p"]  # the prefill leg, told by decode, frees its held KV at once
            assert isinstance(err, grpc.RpcError) and "bootstrap failed" in err.details(), out

        # handshakes a tp 2 decode would not send, at the tp 2 prefill: one descriptor (a
        # tp 1 decode of an older kind), three, no list; and a TP rank 0 that expects the
        # room beside a TP rank 1 that refuses it (zmq) or is gone (mooncake: one-sided
        # writes are not refused by room), so that only the follower's send fails. Each
        # fails its room with a clear status, decode's notify address is told, and the KV
        # is freed.
        import torch

        fake = FakePrefill()  # for its control socket and PUSH helper
        live, refusing, gone = (make_backend(backend, "127.0.0.1") for _ in range(3))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{bport}/route", timeout=5) as r:
                table = json.loads(r.read())
            assert table["tp_size"] == 2 and table["dp_size"] == 2
            # a shard of the embedded model's pool: 4 layers x K,V; 1 of 2 KV heads x 32 fp32
            for backend in (live, refusing, gone):
                backend.register_buffers([torch.zeros(200, 32 * 4, dtype=torch.uint8)
                                          for _ in range(8)])
                backend.start()
            dead = gone.descriptor().to_wire()
            gone.close()
            dst = list(range(1, len(PROMPTS[0]) + 1))
            cases = [([dead], "bootstrap failed: the handshake for room", "--tp-size 1"),
                     ([dead] * 3, "bootstrap failed: the handshake for room", "--tp-size 3"),
                     ("x", "kv transfer failed: bad handshake", "descriptor"),
                     ([live.descriptor().to_wire(),
                       refusing.descriptor().to_wire() if backend == "zmq" else dead],
                      "kv transfer failed", "(TP rank 1)")]
            for room, (peers, head, words) in enumerate(cases, start=9400):
                live.expect(room, dst)
                result: dict[str, Any] = {}

                def run(room: int = room, result: dict[str, Any] = result) -> None:
                    result["err"], result["s"] = _fail_after(prefill.stub().Generate(
                        pd_request(PROMPTS[0], 4, "127.0.0.1", bport, room), timeout=60))

                t = threading.Thread(target=run)
                t.start()
                fake.notify(table["ranks"][str(room % 2)], {
                    "kind": "handshake", "room": room, "rid": "x", "peer": dead, "peers": peers,
                    "tp_size": 2, "dst_slots": dst, "notify": fake.control})
                t.join(60)
                err = result["err"]
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                assert err.details().startswith(head) and words in err.details(), err.details()
                assert result["s"] < 30  # at once (a forward, the refusal): no hang
                told = fake.next_message(5)
                assert told is not None and told["ok"] is False and words in told["error"], told
            assert_freed(prefill)
            assert list(plain_generate(pair, PROMPTS[2], 5).output_ids) == list(_both_legs(
                prefill, decode, bport, 9500, lambda: greedy(PROMPTS[2], 5))[1][-1]
                .complete.output_ids)  # the pair still serves
        finally:
            live.close()
            refusing.close()
            fake.close()
        assert_freed(prefill, decode, pair.prefill, pair.decode)
    finally:
        prefill.stop()
        decode.stop()


# ------------------------------------------------ the module's pair: its last act, last


def test_prefill_killed_mid_transfer_decode_fails_alone(pair: Pair) -> None:
    """The module pair's prefill worker (two ranks) SIGKILLed with a room's send in flight,
    after decode's handshake: decode fails the room on its own within the heartbeat's bound,
    frees its KV and keeps serving. The last test of the module: the pair is not used after
    it.

    To hold the send in flight, the room's handshake that the prefill rank takes names a
    stand-in receiver that takes the pages and never answers: the test's handshake, sent
    after decode's while the prefill rank has no request of the room yet (a later one
    replaces an earlier one then), so the prefill rank sends there and decode's real
    handshake is the one left unserved."""
    ids = list(range(60, 100))
    room = 13
    fake = FakePrefill()  # for its control socket
    stalled = StalledReceiver(_prefill_layout())
    prefill_leg: dict[str, Any] = {}
    try:
        t, result = _decode_leg_waiting(pair.decode, pair.bootstrap_port, room, ids)
        time.sleep(0.5)  # decode's handshake, sent before its queue said so, reaches prefill
        # sent twice: where the prefill rank had not read decode's handshake yet, its socket
        # takes one message from each connection in turn, so the second one is read after it
        # (a loaded machine once read them in the other order: the stand-in got nothing)
        for _ in range(2):
            fake.notify(_prefill_control(pair, room), {
                "kind": "handshake", "room": room, "rid": "x", "peer": stalled.descriptor,
                "dst_slots": list(range(1, len(ids) + 1)), "notify": fake.control})
            time.sleep(0.5)  # it reaches the prefill rank before the request does

        def run() -> None:
            try:
                prefill_leg["out"] = list(pair.prefill.stub().Generate(
                    pd_request(ids, 4, "127.0.0.1", pair.bootstrap_port, room), timeout=60))
            except grpc.RpcError as exc:
                prefill_leg["err"] = exc

        threading.Thread(target=run, daemon=True).start()
        assert stalled.take(room) == len(ids) * 256 * 8  # the pages are out, unanswered
        killed_at = time.monotonic()
        assert pair.prefill.stop(signal.SIGKILL) == -signal.SIGKILL
        t.join(60)
        assert not t.is_alive() and "err" in result, result
        err, took = result["err"], result["at"] - killed_at
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "kv transfer failed" in err.details() and "might be dead" in err.details(), err
        assert took < 11, took  # before the waiting timeout (12 s) could have ended it
        assert "out" not in prefill_leg  # the prefill leg never answered: its worker died
    finally:
        stalled.die()
        fake.close()
    assert_freed(pair.decode)
    plain = greedy(ids, 4)
    plain.disaggregated_params.bootstrap_host = "2.2.2.2"  # SGLang's fake host: no transfer
    assert len(list(pair.decode.stub().Generate(plain, timeout=60))[-1].complete.output_ids) == 4
