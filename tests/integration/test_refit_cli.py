"""The RL refit surface as a user drives it: through the ``sglang-admin`` CLI against two
workers at once, through the typed client (blocking and async) and through grpcurl with
JSON; and the admin key guarding every one of those RPCs.

Two workers start once for the module, side by side, on the embedded default model, each
with ``--admin-api-key``. Every test leaves them unpaused, with their memory resumed and
their weights those of the default model's checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file

from sglang_admin.client import AsyncClient, Client
from tests.conftest import ROOT, ServerProc, start_server, wait_serving
from tests.integration.test_grpcurl import GRPCURL, parse_json_stream

KEY = "refit-admin-key"
SERVICE = "sglang.grpc.scheduler.SglangScheduler"
PROMPT = [7, 31, 64, 2, 99, 14]
PARAM = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, ServerProc]]:
    """Two workers with an admin key, started side by side."""
    tmp = tmp_path_factory.mktemp("refit-cli")
    procs = [
        start_server(tmp, "--admin-api-key", KEY, "--device", "cpu", wait=False)
        for _ in range(2)
    ]
    try:
        for srv in procs:
            try:
                wait_serving(srv.target, srv.proc)
            except Exception:
                raise RuntimeError(f"server failed to start:\n{srv.log()[-4000:]}") from None
        yield procs[0], procs[1]
    finally:
        for srv in procs:
            srv.stop()


def cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run ``python -m sglang_admin ARGS`` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "sglang_admin", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


def on_both(workers: tuple[ServerProc, ServerProc], *args: str) -> subprocess.CompletedProcess[str]:
    """A CLI subcommand fanned out over both workers with the admin key."""
    a, b = workers
    return cli(*args, "--target", a.target, "--target", b.target, "--api-key", KEY)


def line_of(stdout: str, target: str) -> str:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(target + " ")]
    assert len(lines) == 1, stdout
    return lines[0]


def json_lines(stdout: str) -> dict[str, dict[str, Any]]:
    """``--json`` output: each target's object, by target."""
    objs = [json.loads(ln) for ln in stdout.splitlines() if ln.strip()]
    return {o["target"]: o for o in objs}


def assert_ok_on_both(res: subprocess.CompletedProcess[str], workers: tuple[ServerProc, ...],
                      words: str = "") -> None:
    assert res.returncode == 0, res.stdout + res.stderr
    for srv in workers:
        line = line_of(res.stdout, srv.target)
        assert "  OK  " in line, res.stdout
        assert words in line, res.stdout


def greedy_tokens(client: Client, n: int = 8) -> list[int]:
    return client.generate_tokens(PROMPT, n, ignore_eos=True).tokens


def checkpoint_of(srv: ServerProc) -> Path:
    with Client(srv.target, api_key=KEY, timeout=30) as client:
        return Path(client.model_info().model_path)


# ---------------------------------------------------------------------- CLI, two targets


def test_cli_pause_retract_then_flush_then_continue(workers: tuple[ServerProc, ServerProc]) -> None:
    res = on_both(workers, "pause", "--mode", "retract")
    assert_ok_on_both(res, workers, "paused (retract)")
    assert "num_paused_requests=0" in res.stdout
    assert "rank 0: OK" in res.stdout
    for srv in workers:
        with Client(srv.target, timeout=30) as client:
            assert client.server_info().is_paused
    assert_ok_on_both(on_both(workers, "flush-cache"), workers, "flushed")
    res = on_both(workers, "continue")
    assert_ok_on_both(res, workers, "continued")
    for srv in workers:
        with Client(srv.target, timeout=60) as client:
            assert not client.server_info().is_paused
            assert len(greedy_tokens(client, 4)) == 4


def test_cli_weight_version_is_reported_by_model_info(
    workers: tuple[ServerProc, ServerProc],
) -> None:
    res = on_both(workers, "weight-version", "cli-step-3")
    assert_ok_on_both(res, workers, "'cli-step-3'")
    for srv in workers:
        with Client(srv.target, timeout=30) as client:
            assert client.model_info().weight_version == "cli-step-3"


def test_cli_check_weights_digests_agree_across_workers(
    workers: tuple[ServerProc, ServerProc],
) -> None:
    res = on_both(workers, "check-weights")
    assert_ok_on_both(res, workers, "digest=")
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("all 2 target(s), 2 rank(s) in all, agree: "), res.stdout
    digest = last.rsplit(" ", 1)[1]
    assert len(digest) >= 16
    for srv in workers:
        assert f"digest={digest}" in line_of(res.stdout, srv.target)

    res = on_both(workers, "check-weights", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    objs = json_lines(res.stdout)
    assert len(objs) == 2
    for obj in objs.values():
        assert obj["ok"] is True and obj["all_agree"] is True
        assert obj["digest"] == digest
        assert [r["digest"] for r in obj["rank_results"]] == [digest]


def test_cli_get_weights_returns_the_checkpoint_values(
    workers: tuple[ServerProc, ServerProc],
) -> None:
    expected = load_file(str(checkpoint_of(workers[0]) / "model.safetensors"))[PARAM]
    res = on_both(workers, "get-weights", "--name", PARAM, "--truncate-size", "5", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    for obj in json_lines(res.stdout).values():
        assert obj["ok"] is True
        assert [int(x) for x in obj["shape"]] == list(expected.shape)
        np.testing.assert_allclose(obj["values"], expected.reshape(-1)[:5], rtol=1e-6)
    res = on_both(workers, "get-weights", "--name", PARAM)
    assert_ok_on_both(res, workers, f"shape={list(expected.shape)} values (100)")


def test_cli_release_and_resume_memory_serve_the_same_greedy_output(
    workers: tuple[ServerProc, ServerProc],
) -> None:
    before = {}
    for srv in workers:
        with Client(srv.target, timeout=60) as client:
            before[srv.target] = greedy_tokens(client)

    res = on_both(workers, "release-memory", "--tags", "kv_cache", "weights", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    for obj in json_lines(res.stdout).values():
        assert obj["ok"] is True
        assert int(obj["rank_results"][0]["bytes_released"]) > 0
    # while released, the weights cannot be read: a clear per-target failure
    res = on_both(workers, "check-weights")
    assert res.returncode == 1
    assert "the weights are released" in res.stdout
    assert "cannot tell whether the weights agree" in res.stdout

    res = on_both(workers, "resume-memory", "--tags", "kv_cache", "weights")
    assert_ok_on_both(res, workers, "resumed kv_cache, weights")
    assert "weights reloaded from" in res.stdout
    for srv in workers:
        with Client(srv.target, timeout=60) as client:
            assert greedy_tokens(client) == before[srv.target]


def test_cli_update_weights(workers: tuple[ServerProc, ServerProc], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    res = on_both(workers, "update-weights", "--model-path", str(missing),
                  "--weight-version", "never")
    assert res.returncode == 1, res.stdout + res.stderr
    for srv in workers:
        line = line_of(res.stdout, srv.target)
        assert "  FAILED  " in line and str(missing) in line, res.stdout
    for srv in workers:
        with Client(srv.target, api_key=KEY, timeout=60) as client:
            assert client.model_info().weight_version != "never"
            resp = client.update_weights_from_disk(str(missing))
            assert not resp.success and str(missing) in resp.message

    # the worker's own checkpoint loads, and the version follows
    ckpt = checkpoint_of(workers[0])
    res = on_both(workers, "update-weights", "--model-path", str(ckpt),
                  "--weight-version", "cli-reload-1")
    assert_ok_on_both(res, workers, "weight_version='cli-reload-1'")
    for srv in workers:
        with Client(srv.target, timeout=30) as client:
            info = client.model_info()
            assert info.weight_version == "cli-reload-1"
            assert info.model_path == str(ckpt)


def test_cli_abort_all_ends_a_running_request(workers: tuple[ServerProc, ServerProc]) -> None:
    a, _ = workers
    finished: list[str] = []
    started = threading.Event()

    def long_request() -> None:
        with Client(a.target, timeout=120) as client:
            for resp in client.generate(PROMPT, 4000, stream=True, ignore_eos=True):
                started.set()
                if resp.HasField("complete"):
                    finished.append(resp.complete.finish_reason)

    thread = threading.Thread(target=long_request)
    thread.start()
    assert started.wait(60)
    res = on_both(workers, "abort", "--all", "--reason", "refit")
    thread.join(60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 request(s) aborted" in line_of(res.stdout, a.target)
    assert finished == ["abort"]
    # abort by id through the CLI: not in flight is a clear failure
    res = cli("abort", "--request-id", "nobody", "--target", a.target)
    assert res.returncode == 1 and "'nobody' is not in flight" in res.stdout


# ---------------------------------------------------------------------- typed client


def test_sync_client_refit_loop(workers: tuple[ServerProc, ServerProc]) -> None:
    a, _ = workers
    ckpt = checkpoint_of(a)
    with Client(a.target, api_key=KEY, timeout=60) as client:
        before = greedy_tokens(client)
        paused = client.pause_generation("in_place")
        assert paused.success and paused.num_paused_requests == 0
        assert client.server_info().is_paused
        assert client.flush_cache().success
        update = client.update_weights_from_disk(str(ckpt), weight_version="sync-1")
        assert update.success, update.message
        assert update.weight_version == "sync-1" and update.model_path == str(ckpt)
        assert client.continue_generation().success
        assert not client.server_info().is_paused
        assert client.update_weight_version("sync-2", abort_all_requests=False).success
        assert client.model_info().weight_version == "sync-2"
        check = client.check_weights()
        assert check.success and check.digest == check.rank_results[0].digest
        assert client.release_memory_occupation(["kv_cache"]).success
        assert client.resume_memory_occupation(["kv_cache"]).success
        assert client.abort(abort_all=True).success
        assert greedy_tokens(client) == before


def test_async_client_refit_loop(workers: tuple[ServerProc, ServerProc]) -> None:
    _, b = workers

    async def run() -> None:
        async with AsyncClient(b.target, api_key=KEY, timeout=60) as client:
            paused = await client.pause_generation(mode="retract")
            assert paused.success
            assert (await client.flush_cache()).success
            assert (await client.continue_generation(torch_empty_cache=False)).success
            resp = await client.update_weight_version("async-1")
            assert resp.success and resp.rank_results[0].success
            assert (await client.model_info()).weight_version == "async-1"
            check = await client.check_weights("checksum")
            assert check.success and check.digest
            released = await client.release_memory_occupation()
            assert released.success and released.rank_results[0].bytes_released > 0
            assert (await client.resume_memory_occupation()).success
            assert (await client.check_weights()).digest == check.digest
            with pytest.raises(grpc.RpcError) as err:
                await client.check_weights("md5")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "md5" in (err.value.details() or "")

    asyncio.run(run())


# ---------------------------------------------------------------------- grpcurl


def grpcurl(srv: ServerProc, method: str, data: Any = None,
            key: str | None = KEY) -> subprocess.CompletedProcess[str]:
    assert GRPCURL is not None
    cmd = [GRPCURL, "-plaintext", "-max-time", "60"]
    if key:
        cmd += ["-H", f"authorization: Bearer {key}"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [srv.target, f"{SERVICE}/{method}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def grpcurl_one(srv: ServerProc, method: str, data: Any = None) -> dict[str, Any]:
    out = grpcurl(srv, method, data)
    assert out.returncode == 0, f"{method}: {out.stderr}"
    (msg,) = parse_json_stream(out.stdout)
    return msg


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not found")
def test_grpcurl_json_drives_every_refit_rpc(workers: tuple[ServerProc, ServerProc]) -> None:
    a, _ = workers
    ckpt = checkpoint_of(a)
    resp = grpcurl_one(a, "PauseGeneration", {"mode": "retract"})
    assert resp["success"] is True and resp["rank_results"][0]["success"] is True
    assert grpcurl_one(a, "FlushCache", {})["success"] is True
    assert grpcurl_one(a, "ContinueGeneration", {"torch_empty_cache": True})["success"] is True
    resp = grpcurl_one(a, "UpdateWeightsFromDisk",
                       {"model_path": str(ckpt), "weight_version": "curl-1"})
    assert resp["success"] is True and resp["weight_version"] == "curl-1"
    resp = grpcurl_one(a, "UpdateWeightVersion",
                       {"new_version": "curl-2", "abort_all_requests": False})
    assert resp["success"] is True
    assert grpcurl_one(a, "GetModelInfo")["weight_version"] == "curl-2"
    resp = grpcurl_one(a, "CheckWeights", {"action": "checksum"})
    assert resp["success"] is True and resp["digest"] == resp["rank_results"][0]["digest"]
    resp = grpcurl_one(a, "ReleaseMemoryOccupation", {"tags": ["kv_cache"]})
    assert resp["success"] is True and int(resp["rank_results"][0]["bytes_released"]) > 0
    assert grpcurl_one(a, "ResumeMemoryOccupation", {"tags": ["kv_cache"]})["success"] is True
    assert grpcurl_one(a, "Abort", {"abort_all": True})["success"] is True
    # a bad request: INVALID_ARGUMENT naming what was wrong, and the worker serves on
    out = grpcurl(a, "PauseGeneration", {"mode": "sideways"})
    assert out.returncode != 0
    assert "Code: InvalidArgument" in out.stderr and "sideways" in out.stderr
    assert grpcurl_one(a, "HealthCheck")["healthy"] is True


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not found")
def test_grpcurl_get_weights_by_name(workers: tuple[ServerProc, ServerProc]) -> None:
    a, _ = workers
    expected = load_file(str(checkpoint_of(a) / "model.safetensors"))[PARAM]
    resp = grpcurl_one(a, "GetWeightsByName", {"name": PARAM, "truncate_size": 3})
    assert resp["success"] is True
    np.testing.assert_allclose(resp["values"], expected.reshape(-1)[:3], rtol=1e-6)


# ---------------------------------------------------------------------- admin auth

REFIT_CALLS: dict[str, Any] = {
    "pause_generation": lambda c: c.pause_generation("retract"),
    "continue_generation": lambda c: c.continue_generation(),
    "update_weights_from_disk": lambda c: c.update_weights_from_disk("/tmp"),
    "update_weight_version": lambda c: c.update_weight_version("stolen"),
    "get_weights_by_name": lambda c: c.get_weights_by_name(PARAM),
    "check_weights": lambda c: c.check_weights(),
    "release_memory_occupation": lambda c: c.release_memory_occupation(),
    "resume_memory_occupation": lambda c: c.resume_memory_occupation(),
    "abort_all": lambda c: c.abort(abort_all=True),
}


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_every_refit_rpc_needs_the_admin_key(
    workers: tuple[ServerProc, ServerProc], key: str | None,
) -> None:
    a, _ = workers
    with Client(a.target, api_key=key, timeout=30) as client:
        for name, call in REFIT_CALLS.items():
            with pytest.raises(grpc.RpcError) as err:
                call(client)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        # nothing changed, and what is not admin stays open
        assert not client.server_info().is_paused
        assert client.model_info().weight_version != "stolen"
        assert not client.abort("nobody").success
        assert len(greedy_tokens(client, 2)) == 2


def test_cli_without_the_admin_key_is_unauthenticated(
    workers: tuple[ServerProc, ServerProc],
) -> None:
    a, b = workers
    for args in (["pause"], ["check-weights"], ["abort", "--all"],
                 ["release-memory"], ["weight-version", "x"]):
        res = cli(*args, "--target", a.target, "--target", b.target)
        assert res.returncode == 1, res.stdout + res.stderr
        for srv in workers:
            assert "FAILED  UNAUTHENTICATED" in line_of(res.stdout, srv.target), res.stdout
