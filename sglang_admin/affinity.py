"""Which CPU cores each thread of the worker runs on (Linux; elsewhere nothing is pinned).

On CPU the ranks compute and the server streams on the same few cores. Left to the
kernel, the server's bursts (a message per token of every stream after each step) land on
the core of a rank's decoding thread and stop it; bound, each rank lane keeps its own cores
and the server keeps off the cores where the ranks decode (figures in docs/benchmarks.md).
SGLang's and vLLM's CPU backends bind their threads the same way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

logger = logging.getLogger(__name__)


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def lane_cores(rank: int, lanes: int, threads: int,
               cores: list[int] | None = None) -> list[tuple[int, ...]]:
    """The cores of each lane of rank ``rank``: ``threads`` consecutive cores per lane,
    ranks one after another, wrapping around when there are fewer cores than threads."""
    cores = cores if cores is not None else allowed_cores()
    start = rank * lanes * threads
    return [tuple(cores[(start + lane * threads + j) % len(cores)] for j in range(threads))
            for lane in range(lanes)]


def server_cores(decode_cores: Iterable[int], cores: list[int] | None = None) -> tuple[int, ...]:
    """The cores no rank decodes on (every rank's first lane); empty when there are none."""
    cores = cores if cores is not None else allowed_cores()
    taken = set(decode_cores)
    return tuple(c for c in cores if c not in taken)


def pin_thread(cores: Iterable[int]) -> bool:
    """Bind the calling thread (and the threads it starts later) to ``cores``."""
    try:
        os.sched_setaffinity(0, set(cores))
    except (AttributeError, OSError) as exc:
        logger.debug("cannot bind a thread to cores %s: %s", list(cores), exc)
        return False
    return True


def pin_process(cores: Iterable[int]) -> bool:
    """Bind every thread of this process to ``cores`` (threads started later inherit it
    from the thread that starts them)."""
    wanted = set(cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        for tid in tids:
            os.sched_setaffinity(tid, wanted)
    except (AttributeError, OSError, ValueError) as exc:
        logger.debug("cannot bind the process to cores %s: %s", sorted(wanted), exc)
        return False
    return True
