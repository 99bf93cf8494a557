"""Slow and stalled readers cannot grow the server: what piles up for a reader is
coalesced, and past --stream-buffer-tokens its request is aborted (RESOURCE_EXHAUSTED,
its KV freed). Before, every step's output queued without bound (issue 17, finding 3)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ServerProc, greedy, run_generate, start_server
from tools import slow_readers

BUFFER_TOKENS = 64
# The readers' HTTP/2 window is made small so that a stalled reader stalls the server's
# writes after a few messages (with the default window this takes minutes on a CPU).
CLIENT_WINDOW = 1024
# A stream that holds its place for tens of seconds on a 2-core CPU.
LONG_TOKENS = 4000


def kv_in_use(stub: pb_grpc.SglangSchedulerStub) -> int:
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return sum(s.num_used_tokens for s in info.rank_states)


@pytest.mark.long
def test_slow_and_stalled_readers_keep_the_server_bounded(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--stream-buffer-tokens", str(BUFFER_TOKENS))
    try:
        report = slow_readers.run(
            srv.target, seconds=15, slow=8, stalled=8, max_new_tokens=4000,
            server_pid=srv.proc.pid, client_window=CLIENT_WINDOW,
        )
        # Every stalled reader's request was aborted for falling behind; the server is
        # still serving and grew by a few MiB at most (the unbounded queue grew ~9 MiB in
        # 20 s on a 2-core CPU, and without end on faster machines).
        assert report.statuses["stalled"] == {"RESOURCE_EXHAUSTED": 8}, report
        assert report.serving_after
        assert report.rss_growth_mib < 5.0, report
        assert report.rss_max_mib - report.rss_start_mib < 5.0, report
        assert "its reader fell" in srv.log()
        with srv.channel() as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            deadline = time.time() + 30
            while kv_in_use(stub) and time.time() < deadline:
                time.sleep(0.2)
            assert kv_in_use(stub) == 0  # the aborted requests' KV was freed
            # A normal reader streams as before.
            tokens, complete = run_generate(stub, greedy([5, 6, 7], 20, stream=True),
                                            timeout=60)
            assert len(tokens) == 20 and complete.finish_reason == "length"
    finally:
        srv.stop()


def test_overflow_message_names_the_limit(tmp_path: Path) -> None:
    """The status a stalled reader finally reads says why its request ended."""
    srv = start_server(tmp_path, "--stream-buffer-tokens", "8")
    try:
        with grpc.insecure_channel(
            srv.target,
            options=[("grpc.http2.lookahead_bytes", CLIENT_WINDOW), ("grpc.http2.bdp_probe", 0)],
        ) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            call = stub.Generate(greedy([1, 2, 3], 3000, stream=True), timeout=120)
            deadline = time.time() + 60
            while "its reader fell" not in srv.log() and time.time() < deadline:
                time.sleep(0.2)
            got = 0
            try:
                for resp in call:
                    got += len(resp.chunk.token_ids) + len(resp.complete.output_ids)
                raise AssertionError("the stream ended OK")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "read its stream too slowly" in exc.details()
                assert "more than 8 generated tokens were waiting" in exc.details()
                assert "--stream-buffer-tokens" in exc.details()
            assert 0 < got < 3000
    finally:
        srv.stop()


@pytest.mark.long
def test_logprob_heavy_stalled_streams_at_default_client_settings_stay_bounded(
        tmp_path: Path) -> None:
    """Issue 33: streams with 20 top logprobs a token, 8 read one message a second and 8
    never read, on a channel with grpc's default settings (its receive window grows, so a
    stalled reader does not stall the server's writes for a long time). The server kept
    every streamed token's logprobs as Python objects (~2.5 KB a token): it grew 98 MiB in
    30 s, and 43.6 MiB in this test's 12 s (the server of 3b67741^ against this test, load
    average 3); now what a call holds is bounded in bytes and sent tokens are let go."""
    srv = start_server(tmp_path, "--dp-size", "2")
    try:
        report = slow_readers.run(
            srv.target, seconds=12, slow=8, stalled=8, max_new_tokens=6000,
            server_pid=srv.proc.pid, top_logprobs=20, probe_interval=1.0,
            drain_s=0,  # how the stalled calls end is not what this test is about
        )
        assert report.serving_after
        assert report.rss_max_growth_mib < 10.0, report
        assert report.probes_failed == 0 and report.probes_ok > 0, report  # others served
        with srv.channel() as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            deadline = time.time() + 30
            while kv_in_use(stub) and time.time() < deadline:
                time.sleep(0.2)
            assert kv_in_use(stub) == 0  # every call ended, its KV freed
    finally:
        srv.stop()


def _heavy(ids: list[int], n: int) -> pb.GenerateRequest:
    return greedy(ids, n, stream=True, return_logprob=True, top_logprobs_num=20)


def test_the_byte_bound_ends_a_logprob_heavy_stalled_stream(tmp_path: Path) -> None:
    """A stalled reader of a logprob-heavy stream passes --stream-buffer-bytes long before
    --stream-buffer-tokens: RESOURCE_EXHAUSTED naming the byte limit, its KV freed."""
    srv = start_server(tmp_path, "--stream-buffer-bytes", "16384")
    try:
        with grpc.insecure_channel(
            srv.target,
            options=[("grpc.http2.lookahead_bytes", CLIENT_WINDOW), ("grpc.http2.bdp_probe", 0)],
        ) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            call = stub.Generate(_heavy([1, 2, 3], 3000), timeout=120)
            deadline = time.time() + 60
            while "its reader fell" not in srv.log() and time.time() < deadline:
                time.sleep(0.2)
            got = 0
            try:
                for resp in call:
                    got += len(resp.chunk.token_ids) + len(resp.complete.output_ids)
                    assert len(resp.chunk.output_logprobs.top_logprobs[0].values) == 20
                raise AssertionError("the stream ended OK")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert "more than 16384 bytes of generated output" in exc.details()
                assert "--stream-buffer-bytes" in exc.details()
            assert 0 < got < 200  # 16 KiB is ~100 tokens with 20 alternatives each
            deadline = time.time() + 30
            while kv_in_use(stub) and time.time() < deadline:
                time.sleep(0.2)
            assert kv_in_use(stub) == 0
    finally:
        srv.stop()


def test_new_streams_are_refused_while_the_server_wide_budget_is_spent(tmp_path: Path) -> None:
    """Stalled readers holding --stream-buffer-bytes-total between them: a new Generate is
    refused with RESOURCE_EXHAUSTED (saying why), a slow reader already in flight keeps
    getting its tokens, and new calls are served again once the stalled calls are gone."""
    srv = start_server(tmp_path, "--stream-buffer-bytes", "65536",
                       "--stream-buffer-bytes-total", "40000")
    small = [("grpc.http2.lookahead_bytes", CLIENT_WINDOW), ("grpc.http2.bdp_probe", 0)]
    try:
        with grpc.insecure_channel(srv.target, options=small) as stalled_ch, \
                grpc.insecure_channel(srv.target) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            slow = stub.Generate(_heavy([9, 8, 7], 400), timeout=120)
            first = next(slow)
            stalled = [pb_grpc.SglangSchedulerStub(stalled_ch).Generate(
                _heavy([i, 2, 3], 3000), timeout=120) for i in range(2)]
            refused = None
            deadline = time.time() + 60
            while refused is None and time.time() < deadline:
                try:
                    run_generate(stub, greedy([4, 5, 6], 2, stream=True), timeout=30)
                    time.sleep(0.2)
                except grpc.RpcError as exc:
                    refused = exc
            assert refused is not None, "no call was refused"
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--stream-buffer-bytes-total 40000" in refused.details()
            # the slow reader in flight is not refused anything: it reads to its end
            answers = [first, *slow]
            assert sum(len(r.chunk.token_ids) for r in answers) == 400
            assert answers[-1].complete.finish_reason == "length"
            for call in stalled:
                call.cancel()
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    tokens, _ = run_generate(stub, greedy([4, 5, 6], 5, stream=True), timeout=30)
                    break
                except grpc.RpcError:
                    time.sleep(0.5)
            assert len(tokens) == 5
    finally:
        srv.stop()


def test_a_short_request_gets_a_place_while_long_streams_hold_every_one(
        small_server: ServerProc) -> None:
    """Issue 33: a rank whose running batch is full of long streams (2 places, 3 streams of
    LONG_TOKENS) serves a new short request within seconds, and the stream left waiting
    starts long before either of the others could end: a request that waited
    --preempt-wait (1 s by default) takes the place of the one that has run longest, which
    goes on later from its cached KV. Before, both waited for a long stream to end. The
    three streams ask the same prompt, so whoever was preempted when, what each received
    is the same tokens. On the session's ``--max-running-requests 2`` worker, left idle."""
    srv = small_server
    streams: list[dict] = [{"tokens": []} for _ in range(3)]
    stop = threading.Event()

    def read(i: int, stub: pb_grpc.SglangSchedulerStub) -> None:
        got = streams[i]
        call = stub.Generate(greedy([5, 6, 7], LONG_TOKENS, stream=True), timeout=120)
        try:
            for resp in call:
                got.setdefault("first", time.monotonic())
                got["tokens"] += list(resp.chunk.token_ids)
                if stop.is_set():
                    call.cancel()
        except grpc.RpcError as exc:
            got["status"] = exc.code()

    try:
        with srv.channel() as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            threads = [threading.Thread(target=read, args=(i, stub)) for i in range(3)]
            started = time.monotonic()
            for t in threads:
                t.start()
            deadline = time.time() + 30
            while time.time() < deadline:
                state = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).rank_states[0]
                if state.num_running_reqs == 2 and state.num_waiting_reqs == 1:
                    break
                time.sleep(0.05)
            began = time.monotonic()
            tokens, _ = run_generate(stub, greedy([1, 2, 3], 8, stream=True), timeout=60)
            served = time.monotonic() - began
            time.sleep(3.0)  # the three take turns meanwhile
            stop.set()
            for t in threads:
                t.join(60)
            assert len(tokens) == 8
            assert served < 6.0, served  # about 1 s of waiting, then 8 steps
            # every stream was served early (a stream ends after LONG_TOKENS, tens of s)
            assert all("first" in s and s["first"] - started < 8.0 for s in streams), streams
            assert all(s.get("status") == grpc.StatusCode.CANCELLED for s in streams)
            shortest = min(len(s["tokens"]) for s in streams)
            assert 100 <= shortest < LONG_TOKENS
            assert streams[0]["tokens"][:shortest] == streams[1]["tokens"][:shortest] \
                == streams[2]["tokens"][:shortest]
            deadline = time.time() + 30
            while kv_in_use(stub) and time.time() < deadline:
                time.sleep(0.2)
            assert kv_in_use(stub) == 0
    finally:
        stop.set()  # a failed assertion above: the streams end, the shared worker idles
