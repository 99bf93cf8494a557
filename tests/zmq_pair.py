"""Two started zmq KV backends over small pools (3 layers x K, V of 2 heads x 8 dims): the
sender's rows random, the receiver's zeroed. Shared by the zmq backend's unit tests
(tests/unit/test_pd_transfer.py, test_pd_zmq_stream.py). Test code only."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sglang_admin.disaggregation.zmq_backend import ZmqBackend

LAYERS = 3


def pool(fill: bool, slots: int = 64, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """2 x LAYERS buffers [slots, 2, 8], views of one tensor; random rows when ``fill``."""
    kv = torch.zeros(LAYERS, 2, slots, 2, 8, dtype=dtype)
    if fill:
        kv.copy_(torch.randn(kv.shape).to(dtype))
    return [kv[i, j] for i in range(LAYERS) for j in range(2)]


@contextmanager
def started_pair() -> Iterator[tuple[ZmqBackend, ZmqBackend]]:
    """(sender, receiver), started; both closed on exit."""
    sender, receiver = ZmqBackend(), ZmqBackend()
    sender.register_buffers(pool(True))
    receiver.register_buffers(pool(False))
    sender.start()
    receiver.start()
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()
