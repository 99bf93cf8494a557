"""How the mooncake backend issues a room's writes (disaggregation/mooncake_writes.py): one
asynchronous batch per entry, at most MAX_IN_FLIGHT to a peer at once, polled with sleeps;
a fragmented room (thousands of entries, more than the engine queues per peer) still lands
byte for byte, and a refused entry fails the write and hands its budget back."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")

from sglang_admin.disaggregation import mooncake_writes as mw  # noqa: E402


class Engine:
    """The two calls of the engine's binding that a write makes, answering each batch done
    after ``polls`` status checks (or failed, for the entry at index ``fail_at``)."""

    def __init__(self, polls: int = 2, fail_at: int = -1) -> None:
        self.polls, self.fail_at = polls, fail_at
        self.left: dict[int, int] = {}
        self.failing: set[int] = set()
        self.submitted = 0
        self.peak = 0

    def batch_transfer_async_write(self, endpoint, srcs, dsts, lens) -> int:
        assert len(srcs) == len(dsts) == len(lens) == 1  # one entry per batch
        self.submitted += 1
        bid = self.submitted
        self.left[bid] = self.polls
        if bid - 1 == self.fail_at:
            self.failing.add(bid)
        self.peak = max(self.peak, len(self.left))
        return bid

    def transfer_check_status(self, bid: int) -> int:
        self.left[bid] -= 1
        if self.left[bid] > 0:
            return 0
        del self.left[bid]
        return -1 if bid in self.failing else 1


def test_a_write_of_many_entries_keeps_at_most_max_in_flight() -> None:
    eng = Engine()
    n = 3 * mw.MAX_IN_FLIGHT + 7
    assert mw.write_entries(eng, "p:1", list(range(n)), list(range(n)), [8] * n, 10.0) == 0
    assert eng.submitted == n and not eng.left
    assert eng.peak == mw.MAX_IN_FLIGHT
    assert mw._in_flight.get("p:1", 0) == 0


def test_a_refused_entry_fails_the_write_and_returns_its_budget() -> None:
    eng = Engine(fail_at=5)
    n = 2 * mw.MAX_IN_FLIGHT
    assert mw.write_entries(eng, "p:2", list(range(n)), list(range(n)), [8] * n, 10.0) == -1
    assert mw._in_flight.get("p:2", 0) == 0

    class Refusing(Engine):
        def batch_transfer_async_write(self, *a) -> int:
            return 0 if self.submitted >= 3 else super().batch_transfer_async_write(*a)

    assert mw.write_entries(Refusing(), "p:3", [1] * 9, [1] * 9, [8] * 9, 10.0) == -1
    assert mw._in_flight.get("p:3", 0) == 0


def test_a_write_that_never_completes_ends_at_its_deadline() -> None:
    eng = Engine(polls=10**9)
    assert mw.write_entries(eng, "p:4", [1, 2], [1, 2], [8, 8], 0.05) == -1
    assert mw._in_flight.get("p:4", 0) == 0


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                    reason="mooncake-transfer-engine-non-cuda not installed")
def test_a_fragmented_room_of_thousands_of_entries_lands() -> None:
    """700 slots, no two consecutive on either side: 4200 entries, more than the engine
    queues for one peer by default (a room sent whole was refused: "queue-full")."""
    from sglang_admin.disaggregation.mooncake_backend import MooncakeBackend
    from tests.unit.test_pd_mooncake import LAYERS, ROW, Peer

    slots = 1500
    peer = Peer(slots)
    gen = torch.Generator().manual_seed(3)
    sender = MooncakeBackend("127.0.0.1")
    sender.register_buffers([torch.randn(slots, *ROW, generator=gen)
                             for _ in range(2 * LAYERS)])
    sender.start()
    try:
        src = list(range(0, 1400, 2))
        dst = list(range(1499, 99, -2))
        res = sender.send_checked(1, peer.descriptor, src, dst, 60.0)
        assert res.ok, res.error
        assert res.extra["entries"] == 700 * 2 * LAYERS
        assert peer.read(dst) == sender.read_slots(src)
    finally:
        sender.close()
        peer.kill()
