"""The imports a rank needs only for some requests, done once by a thread after it is ready.

``torch._dynamo`` (with sympy: torch.profiler's start asks ``hasattr(torch, "_inductor")``,
which imports it) and ``xgrammar`` (with transformers: constrained decoding) cost about half
of a rank's start-up CPU (~2.5 s of ~5). A rank does not need them to serve, so it imports
them in a daemon thread started once it has told the server it is ready
(:func:`start_in_background`), and the two paths that need them wait for that thread
(:func:`wait_until_imported`) instead of importing themselves: the profiler before it
starts tracing, a grammar compile (in the compile pool) before it touches xgrammar.

The thread starts :data:`DELAY_S` after READY, or at once when one of those two asks
first. A worker that lives less than that and never profiles nor constrains (most of a
test suite's, a short benchmark's) never pays for them; one that does pays the same ~2 s of
CPU, off its loop, once. A StartProfile that comes first is answered once they are done,
the loop serving meanwhile (scheduler/profiling/control.py); the first constrained request
waits ~2 s for them in its compile thread. A TP follower starts them at READY (it is driven
by rank 0: its loop must not wait), and so does a PD leg (a router gives up on a prefill
leg that stays silent for 3 s, which a first grammar waiting for them was on a loaded
machine).

Why not simply import them where they are used: on the rank's loop the import takes
seconds where the loop must answer (HealthCheck wants every rank within 3 s), and inside
a profile's traced window the import's millions of traced calls made the profile's stop
hold the GIL for over 15 s (the heartbeat stopped, the server declared the rank dead).
Waiting for this thread never imports on the waiter's thread, and a profile never starts
before all of them are done: torch.profiler's Python tracer (``with_stack``) records every
thread, so an import still running here would be traced too.

The imports hold the GIL for up to ~0.4 s at a time (a 10 ms sleeper thread's longest gaps
while they ran: 65-420 ms at load average 7, 12-25 ms without them), so the rank's heartbeat
thread falls silent that long. A rank whose server declares it dead after a shorter silence
than :data:`MIN_PROBE_TIMEOUT_S` (``--watchdog-probe-timeout``, 15 s by default) imports
them before READY instead, as it did before (:func:`import_before_ready`).
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

logger = logging.getLogger(__name__)

# torch.profiler's start imports torch._dynamo (with torch._inductor.config and sympy)
PROFILER_MODULES = ("torch._dynamo",)
# constrained decoding (xgrammar imports transformers)
GRAMMAR_MODULES = ("xgrammar",)

# a shorter --watchdog-probe-timeout than this: the imports run before READY
MIN_PROBE_TIMEOUT_S = 5.0
# seconds from READY to the thread's start, unless the profiler or a compile asks first
DELAY_S = 30.0

_done = threading.Event()
_lock = threading.Lock()
_started = False  # the imports are scheduled (or done before READY)
_thread: threading.Thread | None = None  # the late-imports thread, once it started
_timer: threading.Timer | None = None


def _import_all(names: tuple[str, ...]) -> None:
    """Import the modules, each failure logged (its user reports its own error)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the profiler or a compile says what failed
            logger.exception("importing %s failed", name)


def _run(names: tuple[str, ...]) -> None:
    started = time.process_time()
    try:
        _import_all(names)
    finally:
        _done.set()
    logger.debug("late imports done: %.2f s of CPU", time.process_time() - started)


def import_before_ready(probe_timeout_s: float, grammar: bool = True) -> None:
    """Where the heartbeat probe is shorter than :data:`MIN_PROBE_TIMEOUT_S`, import now on
    this thread (the rank's start-up), and :func:`start_in_background` will not."""
    global _started
    if probe_timeout_s >= MIN_PROBE_TIMEOUT_S:
        return
    with _lock:
        if _started:
            return
        _started = True
    _run(PROFILER_MODULES + (GRAMMAR_MODULES if grammar else ()))


def start_in_background(grammar: bool = True, delay_s: float | None = None) -> None:
    """Start the imports in a daemon thread :data:`DELAY_S` from now, or when
    :func:`wait_until_imported` asks first (once per process; later calls do nothing);
    ``delay_s``: another delay (0: now).
    ``grammar=False``: a process that never compiles a grammar (a TP follower) imports
    only what the profiler needs."""
    global _started, _thread, _timer
    with _lock:
        if _started:
            return
        _started = True
        names = PROFILER_MODULES + (GRAMMAR_MODULES if grammar else ())
        _thread = threading.Thread(target=_run, args=(names,), name="late-imports",
                                   daemon=True)
        _timer = threading.Timer(DELAY_S if delay_s is None else delay_s, _start_thread)
        _timer.daemon = True
        _timer.start()


def pending() -> bool:
    """The imports are scheduled in this process and not done yet."""
    return _thread is not None and not _done.is_set()


def start_now() -> None:
    """Start the scheduled imports now without waiting for them (a profile's start, which
    then waits off the loop for :func:`imported`)."""
    _start_thread()


def _start_thread() -> None:
    """Start the late-imports thread now (once; the timer's start and a waiter's race)."""
    with _lock:
        if _thread is None or _thread.ident is not None:
            return
        if _timer is not None:
            _timer.cancel()
        _thread.start()


def imported() -> bool:
    """The late-imports thread is done."""
    return _done.is_set()


def wait_until_imported() -> None:
    """Block until the late-imports thread is done, starting it now if its delay has not
    run out. In a process that never scheduled it (a tool, a unit test building a Profiler
    by hand) the modules are imported here, on this thread."""
    if not _started:
        _import_all(PROFILER_MODULES + GRAMMAR_MODULES)
        return
    _start_thread()
    _done.wait()
