"""Faults and shutdown: a dying scheduler rank, clients that vanish, deadlines, SIGTERM
under load, and a short soak (tools/soak.py) as part of the suite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ROOT, ServerProc, greedy, run_generate, start_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def rank_pids(server: ServerProc) -> list[int]:
    """The scheduler ranks: children of the server but the multiprocessing resource tracker."""
    pids = []
    for pid in server.children():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_gone(pids: list[int], timeout: float = 10) -> None:
    deadline = time.time() + timeout
    alive = list(pids)
    while alive and time.time() < deadline:
        alive = [p for p in alive if running(p)]
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"


def held_kv(stub: pb_grpc.SglangSchedulerStub) -> tuple[int, int, int]:
    """(KV tokens held by requests, running, waiting), summed over ranks."""
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return (
        sum(s.num_used_tokens for s in info.rank_states),
        sum(s.num_running_reqs for s in info.rank_states),
        sum(s.num_waiting_reqs for s in info.rank_states),
    )


def wait_for(cond, timeout: float, what: str) -> float:
    """Poll until cond() is true; returns the seconds it took."""
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)
    return time.time() - t0


class Stream(threading.Thread):
    """A Generate call consumed in a thread; records its outcome and when it ended."""

    def __init__(self, stub: pb_grpc.SglangSchedulerStub, req: pb.GenerateRequest,
                 timeout: float = 120) -> None:
        super().__init__(daemon=True)
        self.stub, self.req, self.timeout = stub, req, timeout
        self.first = threading.Event()
        self.tokens: list[int] = []
        self.complete: pb.GenerateComplete | None = None
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended = 0.0
        self.call = None

    def run(self) -> None:
        try:
            self.call = self.stub.Generate(self.req, timeout=self.timeout)
            for resp in self.call:
                if resp.HasField("chunk"):
                    self.tokens.extend(resp.chunk.token_ids)
                else:
                    self.complete = resp.complete
                self.first.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details()
        finally:
            self.ended = time.time()
            self.first.set()


# ---------------------------------------------------------------------- clients and deadlines


@pytest.fixture(scope="module")
def small(small_server: ServerProc) -> ServerProc:
    """Two running requests at most, so a third one queues (the session's small_server)."""
    return small_server


@pytest.fixture(scope="module")
def stub(small: ServerProc) -> Iterator[pb_grpc.SglangSchedulerStub]:
    with small.channel() as ch:
        yield pb_grpc.SglangSchedulerStub(ch)


CLIENT = textwrap.dedent("""
    import sys, grpc
    from sglang_admin.pb import common_pb2 as pb, common_pb2_grpc as pb_grpc
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(sys.argv[1]))
    req = pb.GenerateRequest(
        request_id=sys.argv[2], tokenized=pb.TokenizedInput(input_ids=list(range(1, 200))),
        sampling_params=pb.SamplingParams(max_new_tokens=7000, ignore_eos=True), stream=True)
    for resp in stub.Generate(req, timeout=120):
        print("chunk", len(resp.chunk.token_ids), flush=True)
""")


def test_killed_client_frees_its_kv_at_the_next_step(small: ServerProc, stub) -> None:
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, small.target, "vanishing-client"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        for _ in range(3):
            assert client.stdout.readline().startswith("chunk")
        assert held_kv(stub)[0] > 0
    finally:
        client.kill()  # no goodbye: the connection just drops
        client.wait(10)
    wait_for(lambda: held_kv(stub) == (0, 0, 0), 5, "KV freed after the client died")
    assert not stub.Abort(pb.AbortRequest(request_id="vanishing-client"), timeout=5).success


def test_closed_channel_frees_its_kv(small: ServerProc, stub) -> None:
    ch = small.channel()
    prompt = [i % 250 + 1 for i in range(300)]
    s = Stream(pb_grpc.SglangSchedulerStub(ch), greedy(prompt, 7000, stream=True))
    s.start()
    assert s.first.wait(30)
    ch.close()
    s.join(10)
    assert s.code == grpc.StatusCode.CANCELLED
    wait_for(lambda: held_kv(stub) == (0, 0, 0), 5, "KV freed after the channel closed")


def test_deadline_expires_queued_work(stub) -> None:
    busy = [Stream(stub, greedy([i + 1] * 50, 7000, stream=True)) for i in range(2)]
    for s in busy:
        s.start()
    try:
        for s in busy:
            assert s.first.wait(30)
        assert held_kv(stub)[1:] == (2, 0)  # both slots taken
        t0 = time.time()
        with pytest.raises(grpc.RpcError) as err:
            run_generate(stub, greedy([7, 7, 7], 5), timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.time() - t0 < 3
        # The queued request is gone from the rank, the running ones go on.
        wait_for(lambda: held_kv(stub)[1:] == (2, 0), 5, "expired request left the queue")
        assert all(s.is_alive() for s in busy)
    finally:
        for s in busy:
            if s.call is not None:
                s.call.cancel()
        for s in busy:
            s.join(10)
    wait_for(lambda: held_kv(stub) == (0, 0, 0), 5, "KV freed after cancelling")
    assert len(run_generate(stub, greedy([7, 7, 7], 5), timeout=30)[0]) == 5


# ---------------------------------------------------------------------- a rank dies


def test_dead_rank_fails_every_call_and_the_server_exits_nonzero(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--dp-size", "2")
    try:
        children = srv.children()
        ranks = rank_pids(srv)
        assert len(ranks) == 2, children
        stub = srv.stub()
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        pid_of_rank = {s.dp_rank: s.pid for s in info.rank_states}
        assert sorted(pid_of_rank.values()) == sorted(ranks)

        # A health watcher, streams on both ranks, and an admin call waiting on the ranks.
        statuses: list[tuple[float, int]] = []
        health_ch = srv.channel()
        watch = health_pb2_grpc.HealthStub(health_ch).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60
        )

        def watcher() -> None:
            try:
                for resp in watch:
                    statuses.append((time.time(), resp.status))
            except grpc.RpcError as exc:
                statuses.append((time.time(), exc.code()))

        threading.Thread(target=watcher, daemon=True).start()
        streams = [
            Stream(stub, greedy([i + 1, 2, 3], 8000, stream=i % 3 != 2, data_parallel_rank=i % 2))
            for i in range(6)
        ]
        for s in streams:
            s.start()
        wait_for(lambda: held_kv(stub)[1] == len(streams), 30, "all streams running")
        flush: dict = {}

        def flush_waits() -> None:  # waits for idle, which never comes
            try:
                flush["resp"] = stub.FlushCache(pb.FlushCacheRequest(timeout_s=60), timeout=90)
            except grpc.RpcError as exc:
                flush["code"], flush["details"] = exc.code(), exc.details()
            flush["ended"] = time.time()

        flusher = threading.Thread(target=flush_waits, daemon=True)
        flusher.start()
        wait_for(lambda: any(s.flush_pending for s in stub.GetServerInfo(
            pb.GetServerInfoRequest(), timeout=10).rank_states), 10, "flush pending")
        assert statuses and statuses[-1][1] == SERVING

        killed = time.time()
        os.kill(pid_of_rank[0], signal.SIGKILL)

        for s in streams:
            s.join(max(0.0, killed + 5 - time.time()))
        flusher.join(max(0.0, killed + 5 - time.time()))
        for s in streams:
            assert not s.is_alive(), "a call still hangs 5 s after the rank died"
            assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details)
            assert s.ended - killed < 5
            assert "scheduler rank 0" in s.details
        assert flush.get("code") == grpc.StatusCode.UNAVAILABLE, flush
        assert flush["ended"] - killed < 5
        # The health watcher hears NOT_SERVING within 2 s of the death.
        try:
            wait_for(lambda: any(st == NOT_SERVING for _, st in statuses),
                     max(0.0, killed + 2 - time.time()), "NOT_SERVING")
        except AssertionError:
            raise AssertionError(f"no NOT_SERVING within 2 s: {statuses}") from None
        assert min(t for t, st in statuses if st == NOT_SERVING) - killed < 2

        code = srv.proc.wait(30)
        assert code != 0
        assert_gone(children)  # the other rank and the resource tracker too
        health_ch.close()
        log = srv.log()
        assert "rank 0 failed: exited with code -9" in log
    finally:
        srv.stop(signal.SIGKILL)


# ---------------------------------------------------------------------- SIGTERM under load


def test_sigterm_under_load_drains_streams_and_exits_zero(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--grace-period", "60")
    try:
        children = srv.children()
        stub = srv.stub()
        n = 600
        prompts = [[i + 1, 17, 42, i + 9] for i in range(8)]
        solo = [run_generate(stub, greedy(p, n), timeout=60)[0] for p in prompts[:2]]
        streams = [Stream(stub, greedy(p, n, stream=i % 2 == 0)) for i, p in enumerate(prompts)]
        for s in streams:
            s.start()
        wait_for(lambda: sum(held_kv(stub)[1:]) == len(streams), 30, "all streams in")
        # As a supervisor that signals the whole group (systemd's default): the server and
        # its ranks get SIGTERM at once; the ranks leave the stopping to the server.
        for pid in [srv.proc.pid, *rank_pids(srv)]:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.3)
        # Nothing new is accepted, on a fresh channel or on the one already open.
        for fresh in (True, False):
            st = srv.stub() if fresh else stub
            with pytest.raises(grpc.RpcError) as err:
                run_generate(st, greedy([1, 2], 2), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for s in streams:
            s.join(60)
        for i, s in enumerate(streams):
            assert s.code == grpc.StatusCode.OK, (s.code, s.details)
            tokens = s.tokens if s.req.stream else list(s.complete.output_ids)
            assert len(tokens) == n and s.complete.finish_reason == "length"
            if i < 2:
                assert tokens == solo[i]
        assert srv.proc.wait(30) == 0, srv.log()[-3000:]
        assert_gone(children)
    finally:
        srv.stop(signal.SIGKILL)


def test_sigterm_past_the_grace_period_cuts_streams_and_exits_zero(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--grace-period", "1")
    try:
        children = srv.children()
        streams = [Stream(srv.stub(), greedy([i + 1] * 10, 8000, stream=True)) for i in range(3)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(30)
        t0 = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(10)
            assert s.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), s.code
            assert s.ended - t0 < 5
        assert srv.proc.wait(30) == 0, srv.log()[-3000:]
        assert_gone(children)
    finally:
        srv.stop(signal.SIGKILL)


# ---------------------------------------------------------------------- short soak


@pytest.mark.long
def test_short_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "tools/soak.py", "--streams", "8", "--duration", "10",
         "--admin-interval", "0.5", "--json", str(out), "--quiet"],
        capture_output=True, text=True, check=False, timeout=240, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    r = report["requests"]
    assert r["completed"] > 50 and r["cancelled"] > 0
    assert r["wrong"] == r["lost"] == r["failed"] == 0
    assert report["kv"]["idle"] and report["kv"]["used_tokens_after_flush"] == 0
    assert report["admin"]["flush_cache"]["ok"] + report["admin"]["flush_cache"]["refused"] > 0
    assert report["admin"]["get_server_info"]["ok"] > 0
    assert report["rss"]["available"] and report["rss"]["processes"] == 2
    assert report["server_exit_code"] == 0


def test_soak_refuses_a_non_loopback_target() -> None:
    proc = subprocess.run(
        [sys.executable, "tools/soak.py", "--target", "192.0.2.1:30000", "--duration", "1"],
        capture_output=True, text=True, check=False, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "not a loopback address" in proc.stderr
