"""One bad request must never take a rank down (issue 17, the rank side).

A dp 2 worker on the embedded default model: extreme sampling values while normal greedy
streams decode, an abandoned FlushCache, and a StopProfile while requests keep coming.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, greedy, run_generate

VOCAB = 261  # the embedded default model's vocabulary
NORMAL_STREAMS = 8
SWEEP_SIZE = 1200
SWEEP_CONCURRENCY = 48
INVALID = grpc.StatusCode.INVALID_ARGUMENT
# statuses that mean the worker, not the request, failed
WORKER_FAULTS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@pytest.fixture(scope="module")
def root(dp2_profiles: Path) -> Path:
    return dp2_profiles


@pytest.fixture(scope="module")
def dp2(dp2_server: ServerProc) -> ServerProc:
    """The session's --dp-size 2 worker: every test here leaves both ranks up and idle."""
    return dp2_server


def rank_pids(srv: ServerProc) -> dict[int, int]:
    info = srv.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return {s.dp_rank: s.pid for s in info.rank_states}


def serving(srv: ServerProc) -> bool:
    with srv.channel() as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_kv_idle(stub, timeout: float = 30) -> list[pb.RankState]:
    """Until no request runs or waits and no KV slot is held by a request (every used
    token is evictable cache, so none counts as used); returns the last states seen."""
    deadline = time.time() + timeout
    states: list[pb.RankState] = []
    while time.time() < deadline:
        states = list(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).rank_states)
        if all(
            s.num_running_reqs == 0 and s.num_waiting_reqs == 0
            and s.num_used_tokens == 0
            for s in states
        ):
            return states
        time.sleep(0.05)
    return states


def sampled(ids: list[int], n: int, **params) -> pb.GenerateRequest:
    bias = params.pop("logit_bias", {})
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(max_new_tokens=n, **params),
    )
    for tok, value in bias.items():
        req.sampling_params.logit_bias[str(tok)] = value
    return req


ALL_TOKENS = list(range(VOCAB))

# Each of these once killed the worker (or, greedy, returned garbage): (name, request,
# expected code or None for OK, a word of the expected message)
FINDING_1 = [
    ("temperature-1e-40", sampled([5, 6, 7], 2, temperature=1e-40), None, ""),
    ("temperature-1e-38", sampled([5, 6, 7], 2, temperature=1e-38), None, ""),
    ("temperature-1e-45-top-k-5", sampled([5, 6, 7], 2, temperature=1e-45, top_k=5), None, ""),
    ("logit-bias-plus-3e38", sampled([5, 6, 7], 2, temperature=1.0, logit_bias={9: 3e38}),
     INVALID, "logit_bias[9] must be in [-100, 100]"),
    ("logit-bias-minus-3e38-everywhere",
     sampled([5, 6, 7], 2, temperature=1.0, logit_bias={t: -3e38 for t in ALL_TOKENS}),
     INVALID, "must be in [-100, 100]"),
    ("repetition-penalty-1e-40", sampled([5, 6, 7], 2, temperature=1.0, repetition_penalty=1e-40),
     INVALID, "repetition_penalty must be in [0.01, 2]"),
    ("stop-everything-min-new-2-sampled",
     sampled([5, 6, 7], 3, temperature=1.0, min_new_tokens=2, stop_token_ids=ALL_TOKENS),
     INVALID, "leave no token"),
    ("stop-everything-min-new-2-greedy",
     sampled([5, 6, 7], 3, min_new_tokens=2, stop_token_ids=ALL_TOKENS),
     INVALID, "leave no token"),
]


def sweep(count: int, seed: int = 17) -> list[pb.GenerateRequest]:
    """Extreme but in-range sampling values (plus some just out of range)."""
    rng = random.Random(seed)
    temps = [0.0, 1e-45, 1e-40, 1e-38, 1e-7, 1e-6, 1e-3, 0.5, 1.0, 2.0, 100.0, 1e6, 1e30, 3e38]
    out = []
    for _ in range(count):
        n = rng.randint(1, 3)
        params: dict = {
            "temperature": rng.choice(temps),
            "top_k": rng.choice([0, 1, 2, 5, VOCAB - 1, VOCAB, 1 << 30, -1]),
            "top_p": rng.choice([0.0, 1e-9, 1e-3, 0.5, 1.0]),
            "min_p": rng.choice([0.0, 1e-9, 0.5, 1.0]),
            "frequency_penalty": rng.choice([-2.0, 0.0, 2.0]),
            "presence_penalty": rng.choice([-2.0, 0.0, 2.0]),
            "repetition_penalty": rng.choice([0.0, 0.01, 0.5, 1.0, 2.0]),
            "ignore_eos": rng.random() < 0.5,
        }
        shape = rng.random()
        if shape < 0.15:
            params["logit_bias"] = {t: -100.0 for t in ALL_TOKENS}
        elif shape < 0.3:
            params["logit_bias"] = {rng.randrange(VOCAB): rng.choice([100.0, -100.0])}
        elif shape < 0.4:
            params["logit_bias"] = {t: rng.uniform(-100, 100) for t in rng.sample(ALL_TOKENS, 40)}
        stops = rng.random()
        if stops < 0.15:
            params["stop_token_ids"] = ALL_TOKENS
            params["min_new_tokens"] = rng.randint(0, n)
        elif stops < 0.4:
            params["stop_token_ids"] = rng.sample(ALL_TOKENS, rng.randint(1, 200))
            params["min_new_tokens"] = rng.randint(0, n)
        if rng.random() < 0.05:  # just out of range: refused at the edge
            params[rng.choice(["repetition_penalty", "top_p", "min_p"])] = 2.5
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
        out.append(sampled(prompt, n, **params))
    return out


def outcome(stub, req: pb.GenerateRequest) -> tuple[grpc.StatusCode, str, list[int]]:
    try:
        tokens, _ = run_generate(stub, req, timeout=120)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", []
    return grpc.StatusCode.OK, "", tokens


def test_extreme_sampling_values_never_take_a_rank_down(dp2: ServerProc) -> None:
    stub = dp2.stub()
    pids = rank_pids(dp2)
    normal = [[(7 * i + j) % (VOCAB - 3) + 3 for j in range(6)] for i in range(NORMAL_STREAMS)]
    solo = [run_generate(stub, greedy(p, 60), timeout=120)[0] for p in normal]

    # Each normal stream decodes again and again until the sweep is over, so that 8
    # streams decode during the whole sweep; every run must equal its solo run.
    runs: dict[int, list[list[int]]] = {i: [] for i in range(NORMAL_STREAMS)}
    sweep_over = threading.Event()

    def stream(i: int) -> None:
        req = greedy(normal[i], 60, stream=True, data_parallel_rank=i % 2)
        while not sweep_over.is_set():
            runs[i].append(run_generate(stub, req, timeout=300)[0])

    with cf.ThreadPoolExecutor(NORMAL_STREAMS + SWEEP_CONCURRENCY) as pool:
        running = [pool.submit(stream, i) for i in range(NORMAL_STREAMS)]
        cases = [(name, req) for name, req, _, _ in FINDING_1]
        cases += [(f"sweep-{i}", req) for i, req in enumerate(sweep(SWEEP_SIZE))]
        results: dict[str, tuple[grpc.StatusCode, str, list[int]]] = {}
        for start in range(0, len(cases), SWEEP_CONCURRENCY):
            chunk = cases[start : start + SWEEP_CONCURRENCY]
            futures = {name: pool.submit(outcome, stub, req) for name, req in chunk}
            results.update({name: fut.result() for name, fut in futures.items()})
        sweep_over.set()
        for fut in running:
            fut.result()

    for name, _, code, needle in FINDING_1:
        got_code, details, tokens = results[name]
        if code is None:
            assert got_code == grpc.StatusCode.OK, (name, got_code, details)
            assert tokens and all(0 <= t < VOCAB for t in tokens), (name, tokens)
        else:
            assert got_code == code, (name, got_code, details)
            assert needle in details, (name, details)
    codes: dict[str, int] = {}
    for name, (code, details, tokens) in results.items():
        codes[code.name] = codes.get(code.name, 0) + 1
        assert code not in WORKER_FAULTS, (name, code, details)
        if code == grpc.StatusCode.OK:
            assert 1 <= len(tokens) <= 3 and all(0 <= t < VOCAB for t in tokens), (name, tokens)
        else:
            assert details, (name, code)
    assert codes.get("OK", 0) > SWEEP_SIZE // 2 and codes.get("INVALID_ARGUMENT", 0) > 0, codes

    for i, got in runs.items():
        assert got and all(tokens == solo[i] for tokens in got), (i, len(got))
    assert serving(dp2)
    assert rank_pids(dp2) == pids
    for state in wait_kv_idle(stub):
        assert state.num_running_reqs == 0 and state.num_waiting_reqs == 0
        assert state.num_used_tokens == 0, state


def _decode_streams(stub, n: int, tokens: int, rids: list[str], results: dict) -> list:
    def run(i: int) -> None:
        req = greedy([i + 3] * 8, tokens, stream=True, data_parallel_rank=i % 2,
                     request_id=rids[i])
        try:
            results[rids[i]] = run_generate(stub, req, timeout=300)[1].finish_reason
        except grpc.RpcError as err:
            results[rids[i]] = err.code().name

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _wait_running(stub, total: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        if sum(s.num_running_reqs for s in info.rank_states) >= total:
            return
        time.sleep(0.05)
    raise TimeoutError("the streams did not start")


def _first_token(stub, rid: str) -> str:
    """The first streamed chunk of a new request, then abort it: 'token' or the status."""
    call = stub.Generate(greedy([11, 12, 13], 50, stream=True, request_id=rid), timeout=120)
    try:
        for resp in call:
            if resp.HasField("chunk") and resp.chunk.token_ids:
                return "token"
    finally:
        call.cancel()
    return "no token"


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_an_abandoned_flush_does_not_block_admission(dp2: ServerProc, how: str) -> None:
    """With 8 streams decoding, a FlushCache(timeout_s=120) whose caller leaves (its 1 s
    deadline passes, or it cancels) no longer holds admission: a new request gets its
    first token while the 8 streams still decode (it used to wait for them all to end)."""
    stub = dp2.stub()
    rids = [f"flush-{how}-{i}" for i in range(NORMAL_STREAMS)]
    results: dict[str, str] = {}
    threads = _decode_streams(stub, NORMAL_STREAMS, 4000, rids, results)
    try:
        _wait_running(stub, NORMAL_STREAMS)
        if how == "deadline":
            with pytest.raises(grpc.RpcError) as err:
                stub.FlushCache(pb.FlushCacheRequest(timeout_s=120), timeout=1)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            pending = stub.FlushCache.future(pb.FlushCacheRequest(timeout_s=120), timeout=120)
            deadline = time.time() + 30
            while time.time() < deadline:  # the ranks hold the flush
                info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
                if all(s.flush_pending for s in info.rank_states):
                    break
                time.sleep(0.05)
            assert all(s.flush_pending for s in info.rank_states)
            pending.cancel()
        assert _first_token(stub, f"after-flush-{how}") == "token"
        assert not results, results  # every long stream still decoding
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert not any(s.flush_pending for s in info.rank_states)
    finally:
        for rid in rids:
            stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
        for t in threads:
            t.join(120)
    wait_kv_idle(stub)


def test_stop_profile_under_load_keeps_serving(dp2: ServerProc, root: Path) -> None:
    """While the ranks write a profile's traces, requests with a 5 s deadline keep
    succeeding and the worker stays healthy; StopProfile answers with the files."""
    stub = dp2.stub()
    start = stub.StartProfile(
        pb.StartProfileRequest(activities=["CPU"], with_stack=True, record_shapes=True),
        timeout=60,
    )
    assert start.success, start.message
    rids = [f"profiled-{i}" for i in range(NORMAL_STREAMS)]
    results: dict[str, str] = {}
    threads = _decode_streams(stub, NORMAL_STREAMS, 48, rids, results)
    for t in threads:
        t.join(300)
    assert set(results.values()) == {"length"}, results

    stop = stub.StopProfile.future(pb.StopProfileRequest(), timeout=300)
    served: list[str] = []
    while not stop.done() or not served:
        tokens, _ = run_generate(stub, greedy([4, 5, 6], 2), timeout=5)
        assert len(tokens) == 2
        health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
        assert health.healthy, health.message
        served.append("ok")
    resp = stop.result()
    assert resp.success, resp.message
    assert len(resp.files) == 2 and all(Path(f).stat().st_size > 0 for f in resp.files)
    assert all(str(root) in f for f in resp.files)
