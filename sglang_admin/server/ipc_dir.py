"""The private directory of one server's IPC sockets, and the clean-up of those that a
killed server left behind.

Each directory is ``$TMPDIR/sglang-admin-XXXX`` and holds an ``owner`` file with the
server's pid and that process's start time (so a reused pid is not taken for the owner).
At start a server removes every such directory of its user whose owner is gone and
whose ``server`` socket nobody listens on. A directory without an owner file (being
created right now, or from an older version) is left alone unless it is older than
:data:`UNOWNED_GRACE_S` and nothing listens on its ``server`` socket.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time

logger = logging.getLogger(__name__)

PREFIX = "sglang-admin-"
OWNER_FILE = "owner"
UNOWNED_GRACE_S = 300.0


def process_start_time(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot, from /proc), "" where /proc
    is missing but the process exists, None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        return stat[stat.rindex(")") + 2 :].split()[19]
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def create(base: str | None = None) -> str:
    """A fresh private directory for this process's sockets, its owner file written."""
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
    pid = os.getpid()
    owner = os.path.join(path, OWNER_FILE)
    with open(owner + ".tmp", "w") as f:
        f.write(f"{pid} {process_start_time(pid) or ''}\n")
    os.replace(owner + ".tmp", owner)
    return path


def _owner_alive(path: str) -> bool | None:
    """True/False for a directory with an owner file; None without one."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            fields = f.read().split()
    except FileNotFoundError:
        return None
    except OSError:
        return True  # unreadable: not ours to judge
    try:
        pid = int(fields[0])
    except (IndexError, ValueError):
        return None
    started = process_start_time(pid)
    if started is None:
        return False
    recorded = fields[1] if len(fields) > 1 else ""
    return not (recorded and started and recorded != started)


def _socket_listening(path: str) -> bool:
    sock_path = os.path.join(path, "server")
    if not os.path.exists(sock_path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(sock_path)
        except OSError:
            return False
    return True


def is_stale(path: str, now: float | None = None) -> bool:
    """Whether `path` (one of these directories) belongs to a server that is gone: its
    owner is gone (or, without an owner file, it is old) and nothing listens on its
    ``server`` socket (a live server in another pid namespace keeps its directory)."""
    alive = _owner_alive(path)
    if alive is not None:
        return not alive and not _socket_listening(path)
    try:
        age = (now or time.time()) - os.stat(path).st_mtime
    except OSError:
        return False
    return age > UNOWNED_GRACE_S and not _socket_listening(path)


def remove_stale(base: str | None = None) -> list[str]:
    """Remove this user's directories whose server is gone; returns the removed paths."""
    base = base or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != uid:
            continue
        if is_stale(path):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    if removed:
        logger.info("removed %d stale IPC director%s: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed
