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
by rank 0: its loop must not wait). A PD leg imports the grammar's modules (xgrammar, ~0.6 s
of CPU) at READY and the profiler's after the delay (a router gives up on a prefill leg
that stays silent for 3 s, which a first grammar waiting for both was on a loaded
machine); its compiles wait for the grammar's alone (:func:`wait_for_grammar`).

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

_done = threading.Event()  # every scheduled module imported
_grammar_done = threading.Event()  # the grammar's modules imported (or not scheduled)
_go = threading.Event()  # the delay is over, or a waiter asked
_lock = threading.Lock()
_started = False  # the imports are scheduled (or done before READY)
_thread: threading.Thread | None = None  # the late-imports thread, once scheduled
_grammar_first = False  # the grammar's modules are imported before the delay


def _import_all(names: tuple[str, ...]) -> None:
    """Import the modules, each failure logged (its user reports its own error)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the profiler or a compile says what failed
            logger.exception("importing %s failed", name)


def _run(first: tuple[str, ...], later: tuple[str, ...], delay_s: float) -> None:
    """The late-imports thread: ``first`` at once, ``later`` once the delay is over or a
    waiter asks (one thread imports everything, in turn: two importing that graph at once
    break it)."""
    started = time.process_time()
    try:
        _import_all(first)
        if set(GRAMMAR_MODULES) <= set(first):
            _grammar_done.set()
        _go.wait(delay_s)
        _import_all(later)
    finally:
        _grammar_done.set()
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
    _go.set()
    _run(GRAMMAR_MODULES if grammar else (), PROFILER_MODULES, 0.0)


def start_in_background(grammar: bool = True, delay_s: float | None = None,
                        grammar_at_once: bool = False) -> None:
    """Start the imports in a daemon thread :data:`DELAY_S` from now, or when
    :func:`wait_until_imported` asks first (once per process; later calls do nothing);
    ``delay_s``: another delay (0: now).
    ``grammar=False``: a process that never compiles a grammar (a TP follower) imports
    only what the profiler needs. ``grammar_at_once``: the grammar's modules at once, the
    profiler's after the delay (a PD leg: a router gives up on a leg that stays silent for
    3 s, which a first grammar waiting for its imports was on a loaded machine)."""
    global _started, _thread, _grammar_first
    with _lock:
        if _started:
            return
        _started = True
        _grammar_first = grammar and grammar_at_once
        grammar_names = GRAMMAR_MODULES if grammar else ()
        first = grammar_names if grammar_at_once else ()
        later = PROFILER_MODULES + (() if grammar_at_once else grammar_names)
        if not grammar:
            _grammar_done.set()
        _thread = threading.Thread(
            target=_run, args=(first, later, DELAY_S if delay_s is None else delay_s),
            name="late-imports", daemon=True)
        _thread.start()


def pending() -> bool:
    """The imports are scheduled in this process and not done yet."""
    return _thread is not None and not _done.is_set()


def start_now() -> None:
    """Cut the delay short: the scheduled imports start now; nothing waits for them (a
    profile's start, which then waits off the loop for :func:`imported`)."""
    _go.set()


def imported() -> bool:
    """The late-imports thread is done."""
    return _done.is_set()


def wait_until_imported() -> None:
    """Block until the late-imports thread is done, cutting its delay short. In a process
    that never scheduled it (a tool, a unit test building a Profiler by hand) the modules
    are imported here, on this thread."""
    if not _started:
        _import_all(PROFILER_MODULES + GRAMMAR_MODULES)
        return
    _go.set()
    _done.wait()


def wait_for_grammar() -> None:
    """Block until the grammar's modules are imported (a compile): where they were imported
    first (``grammar_at_once``) the profiler's are not waited for; otherwise as
    :func:`wait_until_imported`."""
    if _started and _grammar_first:
        _grammar_done.wait()
        return
    wait_until_imported()
