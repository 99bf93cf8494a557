"""A CPU step's index tensors without a torch call per step to make them.

Every step hands the model a few int64 index lists (token ids, positions, table cells,
slots, the decode rows and lengths). Made the obvious way, with ``torch.frombuffer`` and
``split``, and written into the request-to-token table with ``index_copy_``, they cost three
torch calls a step that, right after a forward pass has flushed the CPU caches, took 85 to
200 us of a decode step in one process (1 to 32 sequences), about 85 us of a served
32-stream decode step's ~1 ms of serving time (measured in one process and served).

:class:`StagingBuffer` copies the lists into one persistent buffer instead and hands out
views of it that were made once per layout (the lists' lengths: a decode step of n
sequences always has the same), and :func:`host_table` makes the request-to-token table a
tensor over memory that Python writes directly. CUDA keeps the torch calls (its copies to
the device are what a step must do anyway).
"""

from __future__ import annotations

import struct

import torch

MAX_LAYOUTS = 64  # cached view sets; decode steps need one per batch size


class StagingBuffer:
    """One persistent int64 buffer and its views, cached by layout.

    The tensors :meth:`load` returns alias the buffer: they hold the values until the next
    load, which is the next step (a step uses them only while it runs).
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._memory = bytearray(8 * capacity)
        self._tensor = torch.frombuffer(self._memory, dtype=torch.int64)
        self._views: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}

    @property
    def capacity(self) -> int:
        """How many int64 values fit before the buffer grows."""
        return len(self._memory) // 8

    def load(self, parts: list[list[int]]) -> tuple[torch.Tensor, ...]:
        """One int64 tensor per part, holding its values (until the next load)."""
        flat: list[int] = []
        for part in parts:
            flat.extend(part)
        total = len(flat)
        if total > self.capacity:
            self._allocate(max(total, 2 * self.capacity))
        # one C call for every value: a third of array("q", flat)'s cost
        struct.pack_into(f"{total}q", self._memory, 0, *flat)
        layout = tuple(map(len, parts))
        views = self._views.get(layout)
        if views is None:
            if len(self._views) >= MAX_LAYOUTS:
                self._views.clear()
            views = self._views[layout] = self._tensor[:total].split(layout)
        return views


def host_table(rows: int, columns: int) -> tuple[torch.Tensor, memoryview]:
    """A zeroed int64 [rows, columns] tensor and a flat memoryview of the same memory:
    ``view[r * columns + c] = v`` sets ``tensor[r, c]`` without a torch call."""
    memory = bytearray(8 * rows * columns)
    tensor = torch.frombuffer(memory, dtype=torch.int64).view(rows, columns)
    return tensor, memoryview(memory).cast("q")
