"""Tensors copied into one buffer backed by transparent huge pages (2 MB), in the order given.

Why (measured, docs/cpu-performance.md): a batch-1 decode step streams every kept weight once
(SmolLM2-135M Q4_1: 96 MB a token) from the L3 cache; on 4 KB pages that is ~24k pages a
token, each a TLB miss and a page walk (two-level in a VM), and the hardware prefetchers stop
at every page's end. The layers' weights on 2 MB pages took 0.95x the time of the same
weights where they were allocated; the same copy on 4 KB pages took 1.1x, so nothing is
copied where the kernel gives no huge pages (``/sys/kernel/mm/transparent_hugepage/enabled``
``never``, madvise refused, or none granted: checked in ``/proc/self/smaps_rollup``).
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE = 2 << 20  # bytes of a transparent huge page (x86-64)
_MADV_HUGEPAGE = 14
_ALIGN = 4096  # each tensor starts on a page of its own


def thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or "" where
    it cannot be read (not Linux)."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1: end] if 0 <= start < end else ""


def _huge_kb() -> int:
    """The process's anonymous memory on huge pages (kB), -1 where unknown."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of contiguous CPU ``tensors`` (same shapes, dtypes and values) in one buffer on
    transparent huge pages, each starting on a 4 KB boundary, in the given order; None
    where huge pages are not granted (the tensors are best left where they are)."""
    if thp_mode() not in ("always", "madvise") or not tensors:
        return None
    madvise = _madvise()
    if madvise is None or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
    span = -(-total // HUGE) * HUGE
    before = _huge_kb()
    buf = torch.empty(span + HUGE, dtype=torch.uint8)  # untouched: no page is backed yet
    start = (-buf.data_ptr()) % HUGE
    if madvise(buf.data_ptr() + start, span, _MADV_HUGEPAGE) != 0:
        logger.info("huge pages: madvise refused (errno %d)", ctypes.get_errno())
        return None
    views, offset = [], start
    for t, n in zip(tensors, sizes):
        view = buf[offset: offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append(view)
        offset += -(-n // _ALIGN) * _ALIGN
    granted = _huge_kb() - before
    if before < 0 or granted * 1024 < span // 2:  # most of it on huge pages, or leave it
        logger.info("huge pages: %d kB of %d granted; the weights stay where they are",
                    granted, span // 1024)
        return None
    return views


def return_freed() -> None:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim``): the
    layouts a move replaced were heap blocks (the ranks serve blocks up to 32 MiB from the
    heap and trim it only past 1 GiB free: model/runner_memory.py), which would otherwise
    stay in the rank's resident set (96 MB for SmolLM2-135M)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass
