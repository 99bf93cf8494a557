"""How the `mooncake` backend runs the engine's writes: on kept writer threads (to keep the
caller's deadline whatever the engine waits for) and as asynchronous batches polled with
sleeps (the binding's synchronous write polls without sleeping)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class _Writers:
    """Daemon threads that run the engine's blocking writes: an idle one takes the next
    write, a new one starts when none is idle (a stalled write holds its thread until the
    engine gives up). A thread started per write cost a loaded machine a scheduling round
    trip of its own (the start waits for the new thread to run)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1  # that thread takes this job
            else:
                threading.Thread(target=self._work, name="mooncake-write",
                                 daemon=True).start()
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


WRITERS = _Writers()

#: how a write waits for its entries: sleeps of at least this long, at most ``POLL_MAX_S``,
#: an eighth of the time it has taken so far in between (a write's latency grows by about
#: an eighth at most, and a 50 ms write polls a few dozen times)
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3
#: entries in flight to one peer at most, over every room being written to it: the
#: engine's TCP transport queues a bounded number of transfers per peer
#: (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER) and refuses the rest, so a fragmented room
#: (a run of slots per row: thousands of entries) went whole and failed ("queue-full")
MAX_IN_FLIGHT = 256
_BAD_BATCH = (0, (1 << 64) - 1)  # the binding's failed submission (0) and failed open (-1)
_in_flight: dict[str, int] = {}  # peer endpoint -> entries submitted and not yet answered
_in_flight_lock = threading.Lock()


def _take(endpoint: str, want: int) -> int:
    """Up to ``want`` of the peer's in-flight entries, taken (how many)."""
    with _in_flight_lock:
        got = max(0, min(want, MAX_IN_FLIGHT - _in_flight.get(endpoint, 0)))
        _in_flight[endpoint] = _in_flight.get(endpoint, 0) + got
        return got


def _give(endpoint: str, n: int) -> None:
    with _in_flight_lock:
        _in_flight[endpoint] = max(0, _in_flight.get(endpoint, 0) - n)


def write_entries(engine: Any, endpoint: str, srcs: list[int], dsts: list[int],
                  lens: list[int], timeout_s: float) -> int:
    """Write every entry into the peer's memory: 0 once all completed, else -1 (refused,
    broken off, or not done within ``timeout_s``).

    Each entry is its own asynchronous batch, polled with sleeps in between, at most
    ``MAX_IN_FLIGHT`` to one peer at a time (the next submitted as others complete). The
    engine's synchronous batch write polls its batch's status in a loop that never sleeps:
    on a machine of few cores that loop took a core from the engine's own I/O threads and
    from the receiver for the whole write (a 94 MB write cost ~140 ms of CPU against a
    socket's ~50). The binding's one-batch status check (``transfer_check_status``) reads a
    batch's first entry only, hence one entry per batch (it frees the batch when it answers
    done or failed; a batch given up on, failed or late, is left to the engine: a few bytes
    per failed room)."""
    t0 = time.perf_counter()
    pending: list[int] = []
    nxt = 0
    try:
        while True:
            room = _take(endpoint, len(srcs) - nxt)
            for i in range(nxt, nxt + room):
                bid = engine.batch_transfer_async_write(endpoint, [srcs[i]], [dsts[i]],
                                                        [lens[i]])
                if bid in _BAD_BATCH or bid < 0:
                    _give(endpoint, nxt + room - i)  # this one and those not submitted
                    return -1  # the entries already submitted run on; the room fails
                pending.append(bid)
            nxt += room
            still: list[int] = []
            failed = False
            for j, bid in enumerate(pending):
                st = engine.transfer_check_status(bid)
                if st != 0:  # answered: done (1) or failed, and freed by the engine
                    _give(endpoint, 1)
                    if st != 1:
                        still.extend(pending[j + 1:])
                        failed = True
                        break
                    continue
                still.append(bid)
            pending = still
            if failed:
                return -1
            if not pending and nxt == len(srcs):
                return 0
            took = time.perf_counter() - t0
            if took > timeout_s:
                return -1
            time.sleep(min(POLL_MAX_S, max(POLL_MIN_S, took / 8)))
    finally:
        _give(endpoint, len(pending))  # given up on: the engine drains them


def bounded(call: Callable[[], int], timeout_s: float,
            meanwhile: Callable[[], None] = lambda: None) -> int | None:
    """`call()` on a writer thread, its result, or None after `timeout_s`; this thread
    runs ``meanwhile()`` while it waits (the clock runs through it).

    The engine waits for its own limits (a stalled peer's first handshake up to a minute);
    `send` keeps the caller's deadline instead. A write given up on still runs to the engine's limit, so
    its rows may yet land: the caller frees the destination slots only once the
    receiver has been told the room failed (the control plane's rule)."""
    box: list[int] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append(int(call()))
        except Exception:  # the binding raising is a failed write, like rc -1
            box.append(-1)
        done.set()

    t0 = time.monotonic()
    WRITERS.submit(run)
    meanwhile()
    done.wait(max(0.0, timeout_s - (time.monotonic() - t0)))
    return box[0] if box else None
