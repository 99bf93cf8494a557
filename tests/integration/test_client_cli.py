"""The client library and the `sglang-admin` client subcommands against real workers.

Two workers start once for the module: A requires an API key, B runs two data-parallel
ranks. A third target is a free port nobody listens on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sglang_admin.client import SKIPPED, AsyncClient, Client, DownloadError, FanOut, fan_out
from sglang_admin.client.download import ProfileWriter
from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ROOT, ServerProc, free_port, start_server, wait_started

KEY = "client-test-key"
PROMPT = [5, 17, 42, 9, 3]


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[ServerProc, ServerProc]]:
    """Worker A (--api-key) and worker B (--dp-size 2: the session's, left as found; it
    boots beside A when no earlier module started it)."""
    a = start_server(tmp_path_factory.mktemp("client"), "--api-key", KEY, "--device", "cpu",
                     wait=False)
    try:
        b = request.getfixturevalue("dp2_server")
        wait_started(a)
        yield a, b
    finally:
        a.stop()


@pytest.fixture(scope="module")
def dead() -> str:
    return f"127.0.0.1:{free_port()}"


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `python -m sglang_admin ARGS` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "sglang_admin", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


def targets(*servers: ServerProc | str) -> list[str]:
    out: list[str] = []
    for s in servers:
        out += ["--target", s if isinstance(s, str) else s.target]
    return out


def line_of(stdout: str, target: str) -> str:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(target + " ")]
    assert len(lines) == 1, stdout
    return lines[0]


# ---------------------------------------------------------------------- CLI


@pytest.mark.parametrize("command", ["flush-cache", "server-info", "health"])
def test_cli_fans_out_over_two_targets(servers: tuple[ServerProc, ServerProc], command: str) -> None:
    a, b = servers
    res = cli(command, *targets(a, b), "--api-key", KEY)
    assert res.returncode == 0, res.stdout + res.stderr
    for srv in (a, b):
        assert "  OK  " in line_of(res.stdout, srv.target)
    if command == "flush-cache":
        assert "Cache flushed successfully" in line_of(res.stdout, b.target)


def test_cli_dead_target_fails_only_its_line(servers: tuple[ServerProc, ServerProc], dead: str) -> None:
    a, b = servers
    res = cli("flush-cache", *targets(a, dead, b), "--api-key", KEY)
    assert res.returncode != 0
    assert "  FAILED  UNAVAILABLE" in line_of(res.stdout, dead)
    assert "  OK  Cache flushed successfully" in line_of(res.stdout, a.target)
    assert "  OK  " in line_of(res.stdout, b.target)


def test_cli_missing_api_key_is_unauthenticated(servers: tuple[ServerProc, ServerProc]) -> None:
    a, b = servers
    res = cli("server-info", *targets(a, b))
    assert res.returncode != 0
    assert "FAILED  UNAUTHENTICATED" in line_of(res.stdout, a.target)
    assert "  OK  " in line_of(res.stdout, b.target)


def test_cli_services_lists_methods(servers: tuple[ServerProc, ServerProc]) -> None:
    a, _ = servers
    res = cli("services", *targets(a))
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "sglang.grpc.scheduler.SglangScheduler:" in out
    for method in ("Generate", "FlushCache", "StartProfile", "DownloadProfile"):
        assert f" {method}" in out
    assert "grpc.health.v1.Health: Check" in out


def test_cli_json_lines(servers: tuple[ServerProc, ServerProc], dead: str) -> None:
    a, b = servers
    res = cli("server-info", "--json", *targets(a, b, dead), "--api-key", KEY)
    assert res.returncode != 0
    objs = {o["target"]: o for o in map(json.loads, res.stdout.splitlines())}
    assert set(objs) == {a.target, b.target, dead}
    assert objs[a.target]["ok"] is True and len(objs[a.target]["rank_states"]) == 1
    assert objs[b.target]["ok"] is True and len(objs[b.target]["rank_states"]) == 2
    assert objs[dead]["ok"] is False and objs[dead]["code"] == "UNAVAILABLE"

    res = cli("flush-cache", "--json", *targets(b))
    obj = json.loads(res.stdout)
    assert res.returncode == 0 and obj["ok"] and obj["success"]
    assert [r["dp_rank"] for r in obj["rank_results"]] == [0, 1]

    res = cli("services", "--json", *targets(b))
    assert "Check" in json.loads(res.stdout)["services"]["grpc.health.v1.Health"]


def test_cli_generate_and_loads(servers: tuple[ServerProc, ServerProc]) -> None:
    a, b = servers
    ids = ",".join(map(str, PROMPT))
    res = cli("generate", "--input-ids", ids, "--max-new-tokens", "4", "--ignore-eos",
              "--json", *targets(a, b), "--api-key", KEY)
    assert res.returncode == 0, res.stdout + res.stderr
    objs = [json.loads(line) for line in res.stdout.splitlines()]
    assert [len(o["tokens"]) for o in objs] == [4, 4]
    assert objs[0]["tokens"] == objs[1]["tokens"]  # same default model, greedy

    res = cli("loads", "--include", "core", "memory", *targets(b))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ranks=2" in line_of(res.stdout, b.target)

    res = cli("loads", "--include", "bogus", *targets(b))
    assert res.returncode != 0 and "FAILED  INVALID_ARGUMENT" in res.stdout


def test_cli_generate_n_samples_with_a_stop_string(servers: tuple[ServerProc, ServerProc]) -> None:
    a, _ = servers
    ids = ",".join(map(str, PROMPT))
    res = cli("generate", "--input-ids", ids, "--max-new-tokens", "5", "--ignore-eos",
              "--n", "3", "--stop", "never-seen-\u2603", "--json", *targets(a), "--api-key", KEY)
    assert res.returncode == 0, res.stdout + res.stderr
    (obj,) = [json.loads(line) for line in res.stdout.splitlines()]
    samples = obj["samples"]
    assert [s["complete"].get("index", 0) for s in samples] == [0, 1, 2]
    assert all(len(s["tokens"]) == 5 for s in samples)
    assert len({tuple(s["tokens"]) for s in samples}) == 1  # greedy: the same three
    res = cli("generate", "--input-ids", ids, "--n", "0", *targets(a))
    assert res.returncode == 2 and "sample count" in res.stderr
    with Client(a.target, api_key=KEY, timeout=30) as client:
        results = client.generate_samples(PROMPT, 2, 4, stream=True, ignore_eos=True)
        assert [len(r.tokens) for r in results] == [4, 4]
        assert [r.complete.index for r in results] == [0, 1]


def test_cli_generate_with_a_regex(servers: tuple[ServerProc, ServerProc]) -> None:
    a, _ = servers
    res = cli("generate", "--input-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "32",
              "--temperature", "1", "--regex", "[0-9]{3}-[a-z]{2}", "--json", *targets(a),
              "--api-key", KEY)
    assert res.returncode == 0, res.stdout + res.stderr
    (obj,) = [json.loads(line) for line in res.stdout.splitlines()]
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", bytes(t for t in obj["tokens"] if t < 256).decode())
    res = cli("generate", "--input-ids", "1", "--regex", "[0-9", *targets(a), "--api-key", KEY)
    assert res.returncode != 0 and "INVALID_ARGUMENT" in res.stdout and "Unclosed" in res.stdout


# ---------------------------------------------------------------------- library


def test_sync_client(servers: tuple[ServerProc, ServerProc]) -> None:
    a, _ = servers
    with Client(a.target, api_key=KEY, timeout=30) as client:
        assert client.health().healthy
        assert client.health_v1() == "SERVING"
        info = client.model_info()
        assert info.vocab_size > max(PROMPT)
        plain = client.generate_tokens(PROMPT, 6, ignore_eos=True)
        streamed = client.generate_tokens(PROMPT, 6, stream=True, ignore_eos=True)
        assert len(plain.tokens) == 6 and plain.complete.finish_reason == "length"
        assert streamed.tokens == plain.tokens
        assert not client.abort("no-such-request").success
        assert client.offers("SglangScheduler/Generate")
        assert not client.offers("SglangScheduler/NoSuchRpc")
    with Client(a.target, timeout=30) as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            anonymous.server_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_async_client(servers: tuple[ServerProc, ServerProc]) -> None:
    _, b = servers

    async def run() -> None:
        async with AsyncClient(b.target, timeout=30) as client:
            result = await client.generate_tokens(PROMPT, 5, ignore_eos=True)
            assert len(result.tokens) == 5
            chunks = [r async for r in client.generate(PROMPT, 5, stream=True, ignore_eos=True)]
            assert chunks[-1].HasField("complete")
            assert [t for r in chunks if r.HasField("chunk") for t in r.chunk.token_ids] == result.tokens
            pinned = await client.generate_tokens(PROMPT, 5, ignore_eos=True, data_parallel_rank=1)
            assert pinned.tokens == result.tokens
            loads = await client.loads(include=["all"], dp_rank=1)
            assert [x.dp_rank for x in loads.loads] == [1]
            assert "grpc.health.v1.Health" in await client.services()

    asyncio.run(run())


def test_fan_out_skips_a_missing_rpc_and_caches_reflection(
    servers: tuple[ServerProc, ServerProc], dead: str
) -> None:
    a, b = servers
    called: list[str] = []

    async def never(client: AsyncClient) -> None:
        called.append(client.target)

    async def run() -> None:
        async with FanOut([a.target, b.target, dead], api_key=KEY, timeout=30) as fan:
            results = await fan.call(never, rpc="SglangScheduler/NoSuchRpc")
            assert not called
            assert [r.code for r in results[:2]] == [SKIPPED, SKIPPED]
            assert all(r.skipped and not r.ok for r in results[:2])
            assert results[0].error == (
                f"skipped: {a.target} does not offer sglang.grpc.scheduler.SglangScheduler/NoSuchRpc"
            )
            assert results[2].code == "UNAVAILABLE"  # its reflection could not be asked

            # The listing is cached per target: a second call does not ask reflection again.
            async def no_reflection() -> dict[str, list[str]]:
                raise AssertionError("reflection asked twice")

            for target in (a.target, b.target):
                fan.client(target).services = no_reflection  # type: ignore[method-assign]
            flushed = await fan.call(lambda c: c.flush_cache(), rpc="SglangScheduler/FlushCache")
            assert [r.value is not None and r.value.success for r in flushed[:2]] == [True, True]

    asyncio.run(run())


def test_fan_out_reports_a_refusal_per_target(servers: tuple[ServerProc, ServerProc]) -> None:
    a, b = servers

    async def embed(client: AsyncClient) -> pb.EmbedResponse:
        return await client.stub.Embed(pb.EmbedRequest(), metadata=client.metadata)

    results = asyncio.run(
        fan_out([a.target, b.target], embed, "SglangScheduler/Embed", api_key=KEY, timeout=30)
    )
    # Embed on a generation model: refused by each target
    assert [r.code for r in results] == ["FAILED_PRECONDITION", "FAILED_PRECONDITION"]
    assert all(r.error for r in results)


# ---------------------------------------------------------------------- download verification


def _chunks(name: str, data: bytes, size: int, digest: str | None = None) -> list[pb.ProfileFileChunk]:
    pieces = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
    out, offset = [], 0
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(pb.ProfileFileChunk(
            file_name=name, data=piece, offset=offset, last=last,
            sha256=(digest or hashlib.sha256(data).hexdigest()) if last else "",
        ))
        offset += len(piece)
    return out


def test_profile_writer_verifies_sha256(tmp_path: Path) -> None:
    writer = ProfileWriter(tmp_path)
    for chunk in _chunks("rank0/trace.json", b"x" * 1000, 300) + _chunks("b.txt", b"", 10):
        writer.add(chunk)
    files = writer.close()
    assert files == [tmp_path / "rank0" / "trace.json", tmp_path / "b.txt"]
    assert files[0].read_bytes() == b"x" * 1000

    bad = ProfileWriter(tmp_path / "bad")
    with pytest.raises(DownloadError, match="sha256"):
        for chunk in _chunks("t.json", b"abc", 2, digest="0" * 64):
            bad.add(chunk)
    assert not (tmp_path / "bad" / "t.json").exists()

    with pytest.raises(DownloadError, match="unsafe"):
        ProfileWriter(tmp_path).add(_chunks("../escape", b"a", 1)[0])
