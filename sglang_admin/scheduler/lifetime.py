"""A rank process dies with its server: Linux SIGKILLs it when the server process goes."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the server process dies (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
