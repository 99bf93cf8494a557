"""tools/fuzz.py: a brief run against a dp 2 test server finds no death and no
UNKNOWN/INTERNAL status; a non-loopback target is refused; a death is reported."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, start_server
from tools import fuzz

KINDS = ",".join(fuzz.KINDS)


@pytest.fixture(scope="module")
def srv(dp2_server: ServerProc) -> Iterator[ServerProc]:
    """The session's dp 2 worker (--profile-dir: the fuzzer profiles into ``fuzz`` under
    it), left as the run found it: no profile running or armed, nothing in flight."""
    yield dp2_server
    if dp2_server.proc.poll() is not None:
        return
    stub = dp2_server.stub()
    stub.StopProfile(pb.StopProfileRequest(), timeout=120)  # "not in progress" is fine too
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).rank_states
        if all(s.profiler_state == "idle" and not s.num_running_reqs and not s.num_waiting_reqs
               for s in states):
            return
        time.sleep(0.1)
    raise AssertionError(f"the fuzz run left the shared worker busy: {states}")


@pytest.mark.long
def test_brief_fuzz_run_finds_no_death(srv: ServerProc, capsys: pytest.CaptureFixture[str]) -> None:
    code = fuzz.main(["--target", srv.target, "--requests", "300", "--seconds", "30",
                      "--concurrency", "8", "--seed", "7", "--kinds", KINDS])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| case kind |" in out and "| malformed |" in out and "| admin |" in out
    assert "| generate-constrained |" in out and "| constraint-garbage |" in out
    assert "server SERVING after the run: yes; rank pids unchanged: yes" in out
    assert "FAIL status" not in out and "DEATH" not in out
    assert "unexpected:" not in out, out  # ordinary ended OK, invalid and malformed INVALID
    assert srv.proc.poll() is None


@pytest.mark.parametrize("target", ["8.8.8.8:30000", "example.com:80", "nonsense"])
def test_non_loopback_target_is_refused(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        fuzz.parse_args(["--target", target])
    assert exc.value.code == 2
    assert "--target" in capsys.readouterr().err


def test_bounds_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--requests", "0"], ["--seconds", "inf"], ["--kinds", "generate,admin"]):
        with pytest.raises(SystemExit) as exc:
            fuzz.parse_args(["--target", "127.0.0.1:1", *argv])
        assert exc.value.code == 2


def test_failing_statuses_fail_the_run() -> None:
    tally = fuzz.Tally()
    tally.add("admin", "OK")
    tally.add("generate-invalid", "OK", "temperature: nan")
    tally.add("generate-invalid", "OK", "top_p: nan")
    assert not tally.bad
    assert tally.unexpected == ["generate-invalid: OK x2 (first: temperature: nan)"]
    tally.add("malformed", "UNKNOWN", "Unexpected DecodeError")
    assert tally.bad == ["malformed: UNKNOWN Unexpected DecodeError"]


def test_a_death_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank killed during the run: the fuzzer exits 1 and says DEATH."""
    server = start_server(tmp_path, "--dp-size", "2")
    try:
        ranks = server.children()
        killer = threading.Timer(1.5, lambda: [os.kill(p, signal.SIGKILL) for p in ranks])
        killer.start()
        code = fuzz.main(["--target", server.target, "--requests", "100000", "--seconds", "4",
                          "--concurrency", "4", "--kinds", "generate-ordinary,admin"])
        killer.join()
        out = capsys.readouterr().out
        assert code == 1
        assert "DEATH: " in out
    finally:
        server.stop(signal.SIGKILL)
