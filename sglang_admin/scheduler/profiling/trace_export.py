"""Write a stopped torch.profiler session's Chrome trace from a forked child process.

torch's exporter (``profile.export_chrome_trace``) is one C++ call that holds the GIL for
its whole run (1.1 s for 60,000 events with stacks here; more for bigger traces). On the
rank's export thread that stopped the loop and the heartbeat thread together for as long
(no step, no HealthCheck answer; held long enough, the watchdog takes the worker down). A
forked child has a copy of the recorded events and writes them under its own GIL while the
rank keeps serving; the calling thread only waits for it, without the GIL.

The child runs nothing but the export: forked from the export thread, it calls torch's
exporter and leaves with ``os._exit`` (no cleanup of the rank's sockets, no atexit). Where forking is not safe, the trace is written on the calling thread
as before: no ``os.fork`` on this platform, or CUDA initialized in this process (a forked
child must not touch the parent's CUDA context, and torch's exporter may).

Profiling is spread over several modules; their map is in ``scheduler/profiling/export.py``'s
docstring.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import warnings
from typing import Any

import torch

# A child still writing after this long is killed and the export reported as failed. A
# CPU rank's trace covers at most one 16-step segment (profiler.SEGMENT_STEPS): seconds.
EXPORT_TIMEOUT_S = 120.0
_MESSAGE_BYTES = 4096

logger = logging.getLogger(__name__)


def forks() -> bool:
    """Whether traces are written by a forked child in this process (see the module)."""
    return hasattr(os, "fork") and not torch.cuda.is_initialized()


def export_chrome_trace(prof: Any, path: str, timeout_s: float = EXPORT_TIMEOUT_S) -> None:
    """Write ``prof``'s trace (a stopped ``torch.profiler.profile``) to ``path``, plain JSON
    or gzipped by its suffix, as torch's ``export_chrome_trace`` does.

    Raises RuntimeError with the child's error when the export failed (torch only logs a
    file it cannot open: that reads as no file written), TimeoutError when it ran past
    ``timeout_s`` (the child is killed)."""
    if not (forks() and _export_in_child(prof, path, timeout_s)):
        prof.export_chrome_trace(path)
    if not os.path.exists(path):
        raise RuntimeError(f"torch wrote no trace to {path} (see the rank's log for why)")


def _export_in_child(prof: Any, path: str, timeout_s: float) -> bool:
    """Export in a forked child; False when no child could be forked (then the caller
    writes the trace itself, e.g. under strict memory overcommit)."""
    read_fd, write_fd = os.pipe()
    try:
        with warnings.catch_warnings():  # Python >= 3.12 warns of fork() with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        logger.warning("cannot fork to write %s (%s); writing it on this thread", path, exc)
        return False
    if pid == 0:
        _child(prof, path, read_fd, write_fd)
    os.close(write_fd)
    try:  # readable at the child's error message or at its exit (end of file)
        ready, _, _ = select.select([read_fd], [], [], timeout_s)
        message = os.read(read_fd, _MESSAGE_BYTES).decode(errors="replace") if ready else ""
    finally:
        os.close(read_fd)
    if not ready:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise TimeoutError(f"writing {os.path.basename(path)} took over {timeout_s:g}s")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(message or (
            f"the export process was killed by signal {-code}" if code < 0
            else f"the export process exited with status {code}"
        ))
    return True


def _child(prof: Any, path: str, read_fd: int, write_fd: int) -> None:
    """(The forked child) export, send the error if any, and exit at once."""
    code = 1
    try:
        os.close(read_fd)
        with contextlib.suppress(ValueError):  # the rank's handlers are not the child's
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        prof.export_chrome_trace(path)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        with contextlib.suppress(OSError):
            os.write(write_fd, f"{type(exc).__name__}: {exc}".encode()[:_MESSAGE_BYTES])
    finally:
        os._exit(code)
