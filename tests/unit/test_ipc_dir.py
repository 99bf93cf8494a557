"""Stale IPC directories: removed when their owner is gone, kept while it lives."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from sglang_admin.server import ipc_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _owned_by(base: Path, name: str, owner: str) -> Path:
    path = base / f"{ipc_dir.PREFIX}{name}"
    path.mkdir()
    (path / ipc_dir.OWNER_FILE).write_text(owner)
    (path / "scheduler-0").write_text("")
    return path


def test_a_dead_owners_directory_is_removed_a_live_ones_kept(tmp_path: Path) -> None:
    dead = _owned_by(tmp_path, "dead", f"{_dead_pid()} 1\n")
    live = Path(ipc_dir.create(str(tmp_path)))
    parent = _owned_by(
        tmp_path, "parent", f"{os.getppid()} {ipc_dir.process_start_time(os.getppid())}\n"
    )
    other = tmp_path / "not-ours"
    other.mkdir()
    removed = ipc_dir.remove_stale(str(tmp_path))
    assert removed == [str(dead)]
    assert not dead.exists()
    assert live.exists() and parent.exists() and other.exists()


def test_a_reused_pid_is_not_the_owner(tmp_path: Path) -> None:
    # Our own pid but another start time: the process that wrote it is gone.
    reused = _owned_by(tmp_path, "reused", f"{os.getpid()} 1\n")
    assert ipc_dir.remove_stale(str(tmp_path)) == [str(reused)]


def test_a_directory_without_owner_is_kept_while_young(tmp_path: Path) -> None:
    young = tmp_path / f"{ipc_dir.PREFIX}young"
    young.mkdir()
    assert ipc_dir.remove_stale(str(tmp_path)) == []
    old = tmp_path / f"{ipc_dir.PREFIX}old"
    old.mkdir()
    past = os.stat(old).st_mtime - ipc_dir.UNOWNED_GRACE_S - 10
    os.utime(old, (past, past))
    assert ipc_dir.remove_stale(str(tmp_path)) == [str(old)]
    assert young.exists()


def test_create_writes_the_owner(tmp_path: Path) -> None:
    path = ipc_dir.create(str(tmp_path))
    pid, started = Path(path, ipc_dir.OWNER_FILE).read_text().split()
    assert int(pid) == os.getpid()
    assert started == ipc_dir.process_start_time(os.getpid())
    assert not ipc_dir.is_stale(path)


def test_a_dead_owners_directory_with_a_listener_is_kept(tmp_path: Path) -> None:
    """A server in another pid namespace looks dead by pid; its socket says otherwise."""
    busy = _owned_by(tmp_path, "busy", f"{_dead_pid()} 1\n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(busy / "server"))
        listener.listen(1)
        assert ipc_dir.remove_stale(str(tmp_path)) == []
    assert busy.exists()
    assert ipc_dir.remove_stale(str(tmp_path)) == [str(busy)]  # closed: nobody listens
