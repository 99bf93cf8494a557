"""A rank process's lifetime: it dies with its server (Linux SIGKILLs it when the server
process goes) and, once stopped, it exits without the interpreter's teardown."""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing.util
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

logger = logging.getLogger(__name__)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the server process dies (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def exit_stopped(code: int) -> NoReturn:
    """End a rank process that has stopped (sockets closed, threads told to stop) with
    ``code``, doing what a normal exit of a spawned process does that anyone can see, then
    skipping the interpreter's teardown.

    That teardown (freeing every module and object of torch, the model and the scheduler
    one by one) costs ~1.5 s of CPU per rank with nothing to show for it: the OS frees the
    memory at exit anyway, and the server waits for the rank before it exits. Kept: the
    non-daemon threads finish (a profile trace being written; thread pools end as they do
    at exit), multiprocessing's finalizers and the atexit handlers run, the logs and stdio
    are flushed."""
    logger.info("process %d exits with code %d, skipping the interpreter's teardown",
                os.getpid(), code)
    multiprocessing.util._exit_function()  # as multiprocessing's Process._bootstrap does
    threading._shutdown()  # joins non-daemon threads; the pools' exit hooks run here
    atexit._run_exitfuncs()  # logging.shutdown() is one of them
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to flush there
            pass
    os._exit(code)


def run_then_exit(main: Callable[[], None]) -> NoReturn:
    """Run a rank's ``main`` and end the process with :func:`exit_stopped`: 0 when it
    returns, the code of a ``sys.exit(code)``. Any other exception propagates (the
    multiprocessing bootstrap prints it and exits 1)."""
    try:
        main()
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            raise
        exit_stopped(exc.code or 0)
    exit_stopped(0)
