"""A stopped rank exits fast (scheduler/rank/lifetime.py): what a normal exit does that anyone can
see still happens, the interpreter's teardown (~1.5 s of CPU per torch rank) does not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import ROOT

CHILD = textwrap.dedent("""
    import atexit, logging, sys, threading, time
    from pathlib import Path
    from sglang_admin.scheduler.rank.lifetime import run_then_exit

    out = Path(sys.argv[1])
    code = int(sys.argv[2])


    class TornDown:
        def __del__(self):  # runs only in the interpreter's teardown
            out.joinpath("teardown").write_text("ran")


    KEEP = TornDown()  # a module global: freed by the teardown, never before


    def writer():
        time.sleep(0.3)
        out.joinpath("thread").write_text("done")


    def main():
        logging.basicConfig(filename=out / "log", level=logging.INFO)
        atexit.register(lambda: out.joinpath("atexit").write_text("ran"))
        threading.Thread(target=writer).start()  # non-daemon: the exit waits for it
        logging.getLogger("rank").info("stopped cleanly")
        print("to stdout, buffered", end="")
        if code:
            sys.exit(code)


    run_then_exit(main)
""")


def run_child(tmp_path: Path, code: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), str(code)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )


def test_a_stopped_rank_finishes_its_threads_and_exit_hooks_then_skips_the_teardown(
    tmp_path: Path,
) -> None:
    done = run_child(tmp_path, 0)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "to stdout, buffered"  # stdio flushed
    assert (tmp_path / "thread").read_text() == "done"  # non-daemon threads joined
    assert (tmp_path / "atexit").read_text() == "ran"  # atexit handlers ran
    log = (tmp_path / "log").read_text()
    assert "stopped cleanly" in log  # log handlers flushed
    assert "exits with code 0, skipping the interpreter's teardown" in log
    assert not (tmp_path / "teardown").exists()  # the interpreter's teardown was skipped


def test_a_rank_that_calls_sys_exit_leaves_with_that_code(tmp_path: Path) -> None:
    done = run_child(tmp_path, 3)
    assert done.returncode == 3, done.stderr
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()
