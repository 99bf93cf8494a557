"""Two workers behind the real SMG gateway (`smg` on PyPI), driven over its HTTP API.

The workers serve a copy of the default model that is moved away once they have loaded
it, so the gateway cannot read the tokenizer from the path the workers report and must
fetch it with GetTokenizer. The gateway runs its default cache_aware policy (it subscribes
to the workers' KV events) with --enable-trace (it sends traceparent to the workers).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("smg", reason="the SMG gateway (pip package `smg`) is not installed")

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ROOT, ServerProc, free_port, start_server, wait_serving

SERVED_NAME = "tiny-chat"  # the workers' --served-model-name: what clients call the model
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TRACE_ID = re.compile(r"trace_id=([0-9a-f]{32})")


# ---------------------------------------------------------------------- helpers


@dataclass
class Cluster:
    workers: list[ServerProc]
    router: subprocess.Popen
    router_log: Path
    base: str  # the gateway's HTTP address
    metrics: str  # its Prometheus address
    model: str  # the model id the gateway serves
    profile_dirs: list[Path]

    @property
    def urls(self) -> list[str]:
        return [f"grpc://127.0.0.1:{w.port}" for w in self.workers]

    def log(self) -> str:
        return ANSI.sub("", self.router_log.read_text(errors="replace"))


def http(
    method: str, url: str, body: dict | None = None, timeout: float = 60,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method,
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def healthy_workers(cluster: Cluster) -> set[str]:
    try:
        status, body = http("GET", f"{cluster.base}/workers", timeout=5)
    except OSError:
        return set()
    if status != 200 or not isinstance(body, dict):
        return set()
    return {w["url"] for w in body.get("workers", []) if w.get("is_healthy")}


def metric(cluster: Cluster, name: str) -> dict[str, float]:
    """Values of one Prometheus metric, by its `worker` label."""
    with urllib.request.urlopen(f"{cluster.metrics}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf'{name}\{{([^}}]*)\}} (\S+)$', line)
        if m:
            worker = re.search(r'worker="([^"]*)"', m.group(1))
            key = worker.group(1) if worker else m.group(1)
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def pushed_load_polls_skipped(cluster: Cluster) -> dict[str, float]:
    """The gateway's GetLoads polls skipped because the worker's pushed load was fresh, by
    worker."""
    with urllib.request.urlopen(f"{cluster.metrics}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'smg_engine_load_polls_total\{worker="([^"]*)",mode="skipped_fresh_push"'
                         r'\} (\S+)', text):
        out[m.group(1)] = float(m.group(2))
    return out


def trace_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.trace.json*"))


def generate(cluster: Cluster, ids: list[int], n: int) -> dict:
    status, body = http(
        "POST",
        f"{cluster.base}/generate",
        {
            "model": cluster.model,
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        },
    )
    assert status == 200, body
    return body[0] if isinstance(body, list) else body


def stop_router(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()  # its own shutdown waits up to 180 s for in-flight requests
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------------------- fixture


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from sglang_admin.model.default_model import ensure_default_model

    tmp = tmp_path_factory.mktemp("smg")
    model = tmp / "model"
    shutil.copytree(ensure_default_model(), model)
    profile_dirs = [tmp / "prof0", tmp / "prof1"]
    workers: list[ServerProc] = []
    router: subprocess.Popen | None = None
    try:
        for prof in profile_dirs:
            prof.mkdir()
            workers.append(start_server(
                tmp, "--log-requests", "--model-path", str(model), "--profile-dir", str(prof),
                "--served-model-name", SERVED_NAME, "--enable-metrics", wait=False,
            ))
        for w in workers:
            try:
                wait_serving(w.target, w.proc)
            except (RuntimeError, TimeoutError):
                raise RuntimeError(f"worker failed to start:\n{w.log()[-4000:]}") from None
        # Warm every worker's tokenizer bundle, then take the directory away: the gateway
        # can only get the tokenizer through GetTokenizer.
        digests = set()
        for w in workers:
            chunks = list(w.stub().GetTokenizer(pb.GetTokenizerRequest(), timeout=30))
            data = b"".join(c.data for c in chunks)
            assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
            assert all(c.sha256 == "" for c in chunks[:-1])
            names = zipfile.ZipFile(io.BytesIO(data)).namelist()
            assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)
            digests.add(chunks[-1].sha256)
        assert len(digests) == 1  # the same files give the same archive
        model.rename(tmp / "model-moved")

        port, metrics_port = free_port(), free_port()
        router_log = tmp / "router.log"
        cmd = [
            sys.executable, "-m", "smg.launch_router",
            "--worker-urls", *[f"grpc://127.0.0.1:{w.port}" for w in workers],
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", "1", "--health-check-interval-secs", "2",
            "--load-monitor-interval", "2",  # GetLoads every 2 s instead of 10
            "--log-level", "info",
            # No warm-up diversions: one cache hit in 8 would go to the "thin" worker.
            "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0",
            "--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{free_port()}",
        ]
        with open(router_log, "w") as log:
            router = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, "NO_COLOR": "1"},
            )
        c = Cluster(
            workers=workers, router=router, router_log=router_log,
            base=f"http://127.0.0.1:{port}", metrics=f"http://127.0.0.1:{metrics_port}",
            model=SERVED_NAME, profile_dirs=profile_dirs,
        )

        def both_healthy() -> bool:
            if router.poll() is not None:
                raise RuntimeError(f"router exited {router.returncode}:\n{c.log()[-4000:]}")
            return healthy_workers(c) == set(c.urls)

        wait_for(both_healthy, 60, "both workers healthy in GET /workers")
        yield c
    finally:
        if router is not None:
            stop_router(router)
        for w in workers:
            w.stop(signal.SIGTERM, timeout=30)


# ---------------------------------------------------------------------- tests


def test_workers_register_and_the_tokenizer_comes_from_a_worker(cluster: Cluster) -> None:
    status, body = http("GET", f"{cluster.base}/workers")
    assert status == 200
    by_url = {w["url"]: w for w in body["workers"]}
    assert set(by_url) == set(cluster.urls)
    info = cluster.workers[0].stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    for w in by_url.values():
        assert w["runtime_type"] == "sglang" and w["connection_mode"] == "grpc"
        assert w["model_id"] == cluster.model
        # What the gateway took from GetModelInfo / GetServerInfo.
        labels = w["labels"]
        assert labels["dp_size"] == "1" and labels["tp_size"] == "1"
        assert labels["is_embedding"] == "false" and labels["is_generation"] == "true"
        assert int(labels["context_length"]) == info.max_context_length
        assert int(labels["vocab_size"]) == info.vocab_size
        assert int(labels["max_total_tokens"]) > 0
    # The gateway takes each worker's load from the EngineLoad records on its KV event stream
    # (it skips the GetLoads poll while they are fresh); its health probes succeed.
    for url in cluster.urls:
        wait_for(lambda u=url: pushed_load_polls_skipped(cluster).get(u, 0) > 0, 15,
                 f"the gateway to take {url}'s load from its pushes")
    status, loads = http("GET", f"{cluster.base}/loads")
    assert status == 200 and {ld["worker"] for ld in loads["loads"]} == set(cluster.urls)
    assert all(ld["max_total_num_tokens"] > 0 for ld in loads["loads"])
    for worker in cluster.workers:
        log = worker.log()
        assert "SglangScheduler/HealthCheck status=OK" in log
        assert not re.search(r"SglangScheduler/(GetLoads|HealthCheck) status=(?!OK)", log)
    status, models = http("GET", f"{cluster.base}/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [cluster.model]
    wait_for(lambda: "Fetching tokenizer from worker" in cluster.log(), 15,
             "the gateway to fetch the tokenizer with GetTokenizer")
    assert "Successfully loaded tokenizer" in cluster.log()
    assert any("get_tokenizer" in w.log() for w in cluster.workers)


def test_generate_with_input_ids_matches_the_worker(cluster: Cluster) -> None:
    ids = [5, 17, 99, 3, 250, 64, 7, 42]
    out = generate(cluster, ids, 6)
    assert len(out["output_ids"]) == 6
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    direct = list(cluster.workers[0].stub().Generate(pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
    ), timeout=60))[-1].complete.output_ids
    assert out["output_ids"] == list(direct)


def test_completions_and_chat_completions_with_text(cluster: Cluster) -> None:
    from transformers import AutoTokenizer

    from sglang_admin.model.default_model import ensure_default_model

    prompt = "The router tokenizes this prompt."
    status, body = http("POST", f"{cluster.base}/v1/completions", {
        "model": cluster.model, "prompt": prompt, "max_tokens": 5, "temperature": 0,
    })
    assert status == 200, body
    # what the worker itself makes of the prompt (tokenized with the model's tokenizer, the
    # one the gateway fetched with GetTokenizer: the workers serve a copy of the default
    # model): the same greedy tokens, as text
    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    ids = tok(prompt)["input_ids"]
    direct = list(cluster.workers[0].stub().Generate(pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=5),
    ), timeout=60))[-1].complete
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == len(direct.output_ids)
    assert body["choices"][0]["text"] == tok.decode(direct.output_ids, skip_special_tokens=True)
    status, body = http("POST", f"{cluster.base}/v1/chat/completions", {
        "model": cluster.model, "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 5, "temperature": 0,
    })
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert 1 <= body["usage"]["completion_tokens"] <= 5


CHAT_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rating", "open"],
    "additionalProperties": False,
}


def test_chat_with_response_format_json_schema_returns_valid_json(cluster: Cluster) -> None:
    """The gateway turns response_format into the worker's json_schema constraint: even the
    random default model answers JSON that validates against the schema."""
    for temperature in (0, 1):
        status, body = http("POST", f"{cluster.base}/v1/chat/completions", {
            "model": cluster.model,
            "messages": [{"role": "user", "content": "Rate a city as JSON."}],
            "max_tokens": 200, "temperature": temperature,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "rating", "schema": CHAT_SCHEMA, "strict": True},
            },
        }, timeout=120)
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", body
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"city", "rating", "open"}
        assert re.fullmatch("[A-Za-z ]{1,12}", value["city"])
        assert type(value["rating"]) is int and 1 <= value["rating"] <= 5
        assert isinstance(value["open"], bool)


def test_repeated_prompts_hit_the_cache_of_the_worker_that_served_them(
    cluster: Cluster,
) -> None:
    for seed in range(3):
        ids = [(seed * 37 + i * 11) % 250 + 1 for i in range(64)]
        before = metric(cluster, "smg_kv_index_blocks")
        first = generate(cluster, ids, 2)
        assert first["meta_info"]["cached_tokens"] == 0
        # The rank sends its KV events after the step's outputs (as SGLang does), so the
        # gateway may answer before its index has the blocks: wait until it does. 64
        # prompt + 2 output tokens are 4 full blocks of 16.
        wait_for(
            lambda before=before: any(
                metric(cluster, "smg_kv_index_blocks").get(u, 0) >= before.get(u, 0) + 4
                for u in cluster.urls
            ),
            10, "the first request's blocks in the gateway's index",
        )
        second = generate(cluster, ids, 2)
        assert second["meta_info"]["cached_tokens"] >= 48, second["meta_info"]


def test_kv_events_feed_the_router_index_and_flush_clears_it(cluster: Cluster) -> None:
    generate(cluster, list(range(1, 41)), 4)
    wait_for(
        lambda: sum(metric(cluster, "smg_kv_index_blocks").get(u, 0) for u in cluster.urls) > 0,
        10, "blocks in the gateway's KV index",
    )
    assert "Learned block_size from KV event" in cluster.log()
    assert re.search(r"Learned block_size from KV event.*block_size=16", cluster.log())

    status, body = http("POST", f"{cluster.base}/flush_cache", {})
    assert status == 200, body
    assert body["status"] == "success"
    assert body["workers_flushed"] == 2 and body["total_grpc_workers"] == 2
    wait_for(
        lambda: all(metric(cluster, "smg_kv_index_blocks").get(u, 0) == 0 for u in cluster.urls),
        10, "the flush's KvCacheCleared to empty the gateway's index",
    )
    for name in ("smg_kv_event_gaps_total", "smg_kv_event_parentless_stores_total"):
        values = metric(cluster, name)
        assert all(values.get(u, 0) == 0 for u in cluster.urls), (name, values)


def test_profiles_through_the_router(cluster: Cluster) -> None:
    before = [len(trace_files(d)) for d in cluster.profile_dirs]
    status, body = http("POST", f"{cluster.base}/start_profile", {"activities": ["CPU"]})
    assert status == 200 and body["status"] == "success", body
    assert body["workers_profiled"] == 2
    generate(cluster, [1, 2, 3, 4, 5], 3)
    status, body = http("POST", f"{cluster.base}/stop_profile", {})
    assert status == 200 and body["status"] == "success", body
    after = [len(trace_files(d)) for d in cluster.profile_dirs]
    assert all(a > b for a, b in zip(after, before)), (before, after)

    target = cluster.urls[0]
    status, body = http(
        "POST", f"{cluster.base}/start_profile", {"activities": ["CPU"], "url": target}
    )
    assert status == 200 and body["status"] == "success", body
    assert body["workers_profiled"] == 1
    generate(cluster, [9, 8, 7, 6], 3)
    status, body = http("POST", f"{cluster.base}/stop_profile", {"url": target})
    assert status == 200 and body["status"] == "success", body
    assert body["workers_profiled"] == 1
    final = [len(trace_files(d)) for d in cluster.profile_dirs]
    assert final[0] > after[0] and final[1] == after[1], (after, final)


def test_router_admin_routes_reach_the_rpcs_once_beside_the_sidecars(cluster: Cluster) -> None:
    """Every worker runs its HTTP sidecar; the gateway's /flush_cache, /start_profile and
    /stop_profile still reach each worker's RPC exactly once (the workers' --log-requests
    logs one line per op, from either edge; the sidecar logs its own requests apart)."""
    for w in cluster.workers:
        status, _ = http("GET", f"{w.http_url}/health")
        assert status == 200

    def ops(op: str) -> list[int]:
        return [sum(f"servicer: {op} rid=" in line for line in w.log().splitlines())
                for w in cluster.workers]

    def sidecar_calls() -> list[int]:
        return [w.log().count("sglang_admin.server.sidecar: http ") for w in cluster.workers]

    flushes, profiles, stops, direct = ops("flush_cache"), ops("start_profile"), \
        ops("stop_profile"), sidecar_calls()
    status, body = http("POST", f"{cluster.base}/flush_cache", {})
    assert status == 200 and body["workers_flushed"] == 2, body
    assert ops("flush_cache") == [n + 1 for n in flushes]
    status, body = http("POST", f"{cluster.base}/start_profile", {"activities": ["CPU"]})
    assert status == 200 and body["workers_profiled"] == 2, body
    status, body = http("POST", f"{cluster.base}/stop_profile", {})
    assert status == 200, body
    assert ops("start_profile") == [n + 1 for n in profiles]
    assert ops("stop_profile") == [n + 1 for n in stops]
    assert sidecar_calls() == direct and min(direct) >= 1  # the /health above, no more
    # one worker's own sidecar flushes that worker only
    status, text = http("POST", f"{cluster.workers[0].http_url}/flush_cache")
    assert status == 200 and text.startswith("Cache flushed."), text
    assert ops("flush_cache") == [flushes[0] + 2, flushes[1] + 1]


def test_router_trace_ids_reach_the_worker_logs(cluster: Cluster) -> None:
    # A caller's trace continues through the gateway into the worker's request log.
    trace_id = os.urandom(16).hex()
    status, body = http(
        "POST", f"{cluster.base}/generate",
        {"model": cluster.model, "input_ids": [11, 12, 13, 14],
         "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
    )
    assert status == 200, body
    assert any(
        "servicer: generate rid=" in line and f"trace_id={trace_id}" in line
        for w in cluster.workers for line in w.log().splitlines()
    )
    # Every request the gateway sent carries its trace context (its ids start gnt-,
    # cmpl-, chatcmpl-; the test's own direct Generate call has neither).
    gateway_lines = [
        line for w in cluster.workers for line in w.log().splitlines()
        if re.search(r"servicer: generate rid=(gnt|cmpl|chatcmpl)-", line)
    ]
    assert gateway_lines
    assert all(TRACE_ID.search(line) for line in gateway_lines), gateway_lines
    # One FlushCache through the gateway is one trace: both workers log its trace id.
    status, body = http("POST", f"{cluster.base}/flush_cache", {})
    assert status == 200, body
    flush_ids = [
        {m.group(1) for line in w.log().splitlines()
         if "servicer: flush_cache" in line and (m := TRACE_ID.search(line))}
        for w in cluster.workers
    ]
    assert flush_ids[0] & flush_ids[1]


# ------------------------------------------------ issue 10: n > 1, echo, prompt logprobs


def sse(url: str, body: dict, timeout: float = 120) -> list[dict]:
    """The JSON events of a streamed (server-sent events) answer, up to [DONE]."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    events: list[dict] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            events.append(json.loads(data))
    return events


@pytest.mark.parametrize("path, payload", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Two answers"}]}),
    ("/v1/completions", {"prompt": "Two completions of this"}),
], ids=["chat", "completions"])
def test_n2_returns_two_choices_with_distinct_indices(cluster: Cluster, path: str,
                                                      payload: dict) -> None:
    body = {"model": cluster.model, "n": 2, "max_tokens": 6, "temperature": 1.0, **payload}
    status, answer = http("POST", f"{cluster.base}{path}", body)
    assert status == 200, answer
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1]
    events = sse(f"{cluster.base}{path}", {**body, "stream": True})
    indices = {c["index"] for e in events for c in e.get("choices", [])}
    assert indices == {0, 1}, events[:4]


def test_completions_echo_with_max_tokens_zero_returns_the_prompt(cluster: Cluster) -> None:
    prompt = "Score this prompt only."
    status, body = http("POST", f"{cluster.base}/v1/completions", {
        "model": cluster.model, "prompt": prompt, "max_tokens": 0, "echo": True,
    })
    assert status == 200, body
    assert body["choices"][0]["text"] == prompt
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] > 5


def test_prompt_logprobs_come_back_through_generate(cluster: Cluster) -> None:
    # smg 1.13.0 renders no logprobs in /v1/completions (and sends logprob_start_len -1
    # for echo); its native /generate passes logprob_start_len through.
    status, body = http("POST", f"{cluster.base}/generate", {
        "model": cluster.model, "text": "Prompt logprobs please",
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
    })
    assert status == 200, body
    meta = (body[0] if isinstance(body, list) else body)["meta_info"]
    prompt = meta["input_token_logprobs"]
    assert len(prompt) == meta["prompt_tokens"] > 5
    assert prompt[0][0] is None  # the first prompt token has no logprob
    assert all(v <= 0 for v, _ in prompt[1:])
    assert len(meta["output_token_logprobs"]) == 2
    status, body = http("POST", f"{cluster.base}/v1/chat/completions", {
        "model": cluster.model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
    })
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert 1 <= len(content) <= 3 and all(len(t["top_logprobs"]) == 2 for t in content)


def test_workers_stayed_healthy_without_flapping(cluster: Cluster) -> None:
    assert healthy_workers(cluster) == set(cluster.urls)
    log = cluster.log()
    for url in cluster.urls:
        lines = [line for line in log.splitlines() if url in line]
        assert not [line for line in lines if "Health probe failed" in line or "veto" in line]
        assert not [line for line in lines if "Failed to subscribe to KV events" in line]
        connected = [line for line in lines if "KV event stream connected" in line]
        assert len(connected) == 1, connected  # subscribed once, never reconnected
    assert "does not implement SubscribeKvEvents" not in log


def test_the_served_model_name_is_the_one_name_everywhere(cluster: Cluster) -> None:
    """--served-model-name (SGLang's flag) names the model in GetModelInfo, GetServerInfo,
    the metrics' model_name label and, through them, the router's /v1/models and requests;
    the model path stays the directory the worker loaded. (Runs last: it scrapes the
    sidecars, which the admin-routes test above counts.)"""
    status, models = http("GET", f"{cluster.base}/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [SERVED_NAME]
    for w in cluster.workers:
        stub = w.stub()
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.served_model_name == SERVED_NAME
        assert info.model_path.endswith("/model")  # the path given, not the name
        args = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args
        assert args["served_model_name"] == SERVED_NAME
        with urllib.request.urlopen(f"{w.http_url}/metrics", timeout=10) as resp:
            labels = set(re.findall(r'model_name="([^"]*)"', resp.read().decode()))
        assert labels == {SERVED_NAME}
    status, body = http("POST", f"{cluster.base}/v1/completions", {
        "model": SERVED_NAME, "prompt": "Named", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["model"] == SERVED_NAME, body
    # the directory is not a name of the model
    status, body = http("POST", f"{cluster.base}/v1/completions", {
        "model": info.model_path, "prompt": "x", "max_tokens": 1})
    assert status == 404 and body["error"]["code"] == "model_not_found", body
