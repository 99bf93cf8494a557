"""Slow and stalled readers cannot grow the server: what piles up for a reader is
coalesced, and past --stream-buffer-tokens its request is aborted (RESOURCE_EXHAUSTED,
its KV freed). Before, every step's output queued without bound (issue 17, finding 3)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import greedy, run_generate, start_server
from tools import slow_readers

BUFFER_TOKENS = 64
# The readers' HTTP/2 window is made small so that a stalled reader stalls the server's
# writes after a few messages (with the default window this takes minutes on a CPU).
CLIENT_WINDOW = 1024


def kv_in_use(stub: pb_grpc.SglangSchedulerStub) -> int:
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return sum(s.num_used_tokens for s in info.rank_states)


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
