"""The imports a rank needs only for some requests, done once by a thread after it is ready.

``torch._dynamo`` (with sympy: torch.profiler's start asks ``hasattr(torch, "_inductor")``,
which imports it) and ``xgrammar`` (with transformers: constrained decoding) cost about half
of a rank's start-up CPU (~2.5 s of ~5). A rank does not need them to serve, so it imports
them in a daemon thread started once it has told the server it is ready
(:func:`start_in_background`), and the two paths that need them wait for that thread
(:func:`wait_until_imported`) instead of importing themselves: the profiler before it
starts tracing, a grammar compile (in the compile pool) before it touches xgrammar.

Why not simply import them where they are used: on the rank's loop the import takes
seconds where the loop must answer (HealthCheck wants every rank within 3 s), and inside
a profile's traced window the import's millions of traced calls made the profile's stop
hold the GIL for over 15 s (the heartbeat stopped, the server declared the rank dead).
Waiting for this thread never imports on the waiter's thread, and a profile never starts
(so never traces) before the imports are done.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

logger = logging.getLogger(__name__)

_done = threading.Event()
_lock = threading.Lock()
_thread: threading.Thread | None = None

# torch.profiler's start imports torch._dynamo (with torch._inductor.config and sympy)
PROFILER_MODULES = ("torch._dynamo",)
# constrained decoding (with transformers)
GRAMMAR_MODULES = ("xgrammar",)


def _import_all(grammar: bool) -> None:
    """Import the modules, each failure logged (its user reports it when it needs it)."""
    started = time.process_time()
    for name in PROFILER_MODULES + (GRAMMAR_MODULES if grammar else ()):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the profiler or a compile reports its own error
            logger.exception("importing %s failed", name)
    logger.debug("late imports done: %.2f s of CPU", time.process_time() - started)


def _run(grammar: bool) -> None:
    try:
        _import_all(grammar)
    finally:
        _done.set()


def start_in_background(grammar: bool = True) -> None:
    """Start the imports in a daemon thread (once per process; later calls do nothing).
    ``grammar=False``: a process that never compiles a grammar (a TP follower) imports
    only what the profiler needs."""
    global _thread
    with _lock:
        if _thread is not None or _done.is_set():
            return
        _thread = threading.Thread(target=_run, args=(grammar,), name="late-imports",
                                   daemon=True)
        _thread.start()


def imported() -> bool:
    """The imports are done (or were never needed: :func:`wait_until_imported` ran them)."""
    return _done.is_set()


def wait_until_imported() -> None:
    """Block until the background imports are done. In a process that never started them
    (a tool, a unit test building a Profiler by hand) they run here, on this thread, once."""
    global _thread
    if _done.is_set():
        return
    with _lock:
        thread = _thread
        if thread is None:
            # mark as started so a later start_in_background does not run them again
            _thread = threading.current_thread()
    if thread is None:
        _run(True)
        return
    _done.wait()
