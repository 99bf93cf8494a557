"""Connection hygiene: idle HTTP/2 connections are closed, long streams are not, and a
SIGKILLed server's IPC directory is removed by the next server that starts."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ServerProc, greedy, start_server

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
IDLE_S = 1


def _closed_by_server(port: int, wait_s: float) -> bool:
    """Open a raw HTTP/2 connection (preface, SETTINGS, ACK of the server's SETTINGS), then
    idle: True when the server closes it within wait_s."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(PREFACE + EMPTY_SETTINGS)
        acked = False
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                data = s.recv(65536)
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
            if not data:
                return True
            if not acked:
                s.sendall(SETTINGS_ACK)
                acked = True
    return False


def test_idle_connection_closed_but_a_long_stream_is_not(tmp_path: Path) -> None:
    srv = start_server(
        tmp_path, "--max-connection-idle", str(IDLE_S), "--keepalive-time", "0",
    )
    try:
        assert _closed_by_server(srv.port, wait_s=30)
        # A stream read slowly for several idle periods ends normally: a call in flight is
        # not idleness.
        with srv.channel() as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            req = greedy([1, 2, 3], 6)
            req.stream = True
            chunks = 0
            for resp in stub.Generate(req, timeout=60):
                chunks += resp.HasField("chunk")
                time.sleep(IDLE_S)
            assert chunks >= 1
            # and the channel still works after the idle close of its connection
            time.sleep(IDLE_S * 3)
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=20).healthy
    finally:
        srv.stop()


def test_default_server_keeps_an_idle_connection(server: ServerProc) -> None:
    """The control: without a small limit the same connection stays open (the shared worker
    has the default idle limit, and its first keepalive ping is a minute away)."""
    assert not _closed_by_server(server.port, wait_s=IDLE_S * 4)


def test_sigkilled_servers_ipc_dir_removed_at_next_start(tmp_path: Path) -> None:
    # a short TMPDIR: the IPC sockets' paths under it must fit a unix socket's 107 bytes
    # (pytest's tmp_path under an xdist process is too long for them)
    tmpdir = Path(tempfile.mkdtemp(prefix="ipc-"))
    try:
        check_stale_ipc_dir_removed(tmp_path, tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def check_stale_ipc_dir_removed(tmp_path: Path, tmpdir: Path) -> None:
    env = {"TMPDIR": str(tmpdir)}
    first = start_server(tmp_path, env=env)
    try:
        dirs = glob.glob(str(tmpdir / "sglang-admin-*"))
        assert len(dirs) == 1
        ranks = first.children()
        first.stop(signal.SIGKILL)
        for pid in ranks:  # the ranks follow their parent; wait so no socket is in use
            for _ in range(200):
                if not os.path.exists(f"/proc/{pid}") or _zombie(pid):
                    break
                time.sleep(0.1)
        assert glob.glob(str(tmpdir / "sglang-admin-*")) == dirs  # left behind
    finally:
        first.stop(signal.SIGKILL)
    second = start_server(tmp_path, env=env)
    try:
        now = glob.glob(str(tmpdir / "sglang-admin-*"))
        assert len(now) == 1 and now != dirs
        assert "removed 1 stale IPC directory" in second.log()
    finally:
        second.stop()
    assert glob.glob(str(tmpdir / "sglang-admin-*")) == []


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

