"""The mooncake KV transfer backend (disaggregation/mooncake_backend.py), over TCP on
127.0.0.1: the bytes that land in a second process equal the source rows, and a dead,
stalled or lying peer fails that send with a "kv transfer failed" message in bounded time."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from sglang_admin.disaggregation.backends import make_backend  # noqa: E402
from sglang_admin.disaggregation.mooncake_backend import MooncakeBackend, coalesce  # noqa: E402
from sglang_admin.disaggregation.transfer import (  # noqa: E402
    BufferInfo,
    KVTransferError,
    PeerDescriptor,
)
from tests.mooncake_peer import LAYERS, NUM_SLOTS, ROW, Peer  # noqa: E402

# mooncake is the `pd` extra (make test installs it): absent, these tests skip; present but
# not loadable (libibverbs.so.1 missing) they fail, naming the library.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                reason="mooncake-transfer-engine-non-cuda not installed")

@pytest.fixture(scope="module")
def _shared_peer():
    p = Peer()
    yield p
    p.kill()


@pytest.fixture
def peer(_shared_peer: Peer):
    """A live receiver with a zeroed pool (one process for the module's tests)."""
    _shared_peer.zero()
    return _shared_peer


@pytest.fixture
def own_peer():
    """A receiver of the test's own, which it may kill, stop or reallocate."""
    p = Peer()
    yield p
    p.kill()


@pytest.fixture
def sender():
    gen = torch.Generator().manual_seed(7)
    b = MooncakeBackend("127.0.0.1")
    b.register_buffers([torch.randn(NUM_SLOTS, *ROW, generator=gen) for _ in range(2 * LAYERS)])
    b.start()
    yield b
    b.close()


def test_coalesce_runs() -> None:
    assert coalesce([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 8]) == [(3, 0, 3), (9, 3, 2), (2, 8, 1)]
    assert coalesce([], []) == []
    assert coalesce([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]


def test_transfer_lands_the_source_bytes(peer: Peer, sender: MooncakeBackend) -> None:
    src = [5, 6, 7, 8, 20, 3, 40, 41]
    dst = [10, 11, 12, 13, 0, 63, 30, 31]  # runs, single slots, both pool ends
    res = sender.send(1234, peer.descriptor, src, dst, 10.0)
    assert res.ok, res.error
    assert res.nbytes == len(src) * 64 * 2 * LAYERS
    landed = peer.read(dst)
    assert landed == sender.read_slots(src)
    assert any(landed)  # random floats, not a pool of zeros on both sides
    untouched = [s for s in range(NUM_SLOTS) if s not in dst]
    assert not any(peer.read(untouched))  # nothing else in the pool was written
    # the same connection again, other rows: still exact
    res = sender.send(1235, peer.descriptor, [0, 1], [1, 2], 10.0)
    assert res.ok, res.error
    assert peer.read([1, 2]) == sender.read_slots([0, 1])


def test_through_the_registry(peer: Peer) -> None:
    b = make_backend("mooncake", "127.0.0.1")
    assert isinstance(b, MooncakeBackend) and b.protocol == "tcp"
    b.register_buffers([torch.full((NUM_SLOTS, *ROW), 2.5) for _ in range(2 * LAYERS)])
    b.start()
    try:
        assert b.send(1, peer.descriptor, [9], [9], 10.0).ok
        assert peer.read([9]) == b.read_slots([9])
    finally:
        b.close()
        b.close()  # idempotent


def test_dead_peer_fails_fast(own_peer: Peer, sender: MooncakeBackend) -> None:
    assert sender.send(1, own_peer.descriptor, [0], [0], 10.0).ok  # a warm connection
    own_peer.kill()
    t = time.monotonic()
    res = sender.send(2, own_peer.descriptor, [1, 2], [1, 2], 10.0)
    assert not res.ok
    assert "kv transfer failed" in res.error and "room 2" in res.error
    assert time.monotonic() - t < 5.0
    # a peer that never existed (nothing listens on the port)
    gone = PeerDescriptor("127.0.0.1:1", own_peer.descriptor.buffers)
    res = sender.send(3, gone, [0], [0], 10.0)
    assert not res.ok and "kv transfer failed" in res.error


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until every thread of ``pid`` is stopped (state T): a loaded machine delivers the
    SIGSTOP to a thread only when it next runs."""
    deadline = time.monotonic() + timeout
    while True:
        states = [(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0])
                  for tid in os.listdir(f"/proc/{pid}/task")]
        if all(state == "T" for state in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.01)


def test_stalled_peer_keeps_the_deadline(own_peer: Peer, sender: MooncakeBackend) -> None:
    """A stopped peer accepts the TCP connect and then says nothing: the handshake would
    wait a minute in the engine; send returns at its own deadline."""
    os.kill(own_peer.proc.pid, signal.SIGSTOP)
    try:
        _wait_stopped(own_peer.proc.pid)  # every thread, the engine's too, before the send
        t = time.monotonic()
        res = sender.send(7, own_peer.descriptor, list(range(8)), list(range(8)), 1.5)
        took = time.monotonic() - t
        assert not res.ok and "kv transfer failed: timed out" in res.error
        assert 1.4 < took < 4.0
    finally:
        os.kill(own_peer.proc.pid, signal.SIGCONT)


def test_short_or_lying_descriptor_is_refused(peer: Peer, sender: MooncakeBackend) -> None:
    desc = peer.descriptor
    # a destination slot beyond the peer's pool: refused before any byte moves
    res = sender.send(1, desc, [0, 1], [62, 64], 10.0)
    assert not res.ok and "destination slot 64 is outside" in res.error
    res = sender.send(1, desc, [-1], [0], 10.0)
    assert not res.ok and "source slot -1" in res.error
    res = sender.send(1, desc, [0, 1], [0], 10.0)
    assert not res.ok and "2 source slots for 1 destination" in res.error
    for bad in (["0"], [1.5], [None]):  # slot lists can come from the network
        res = sender.send(1, desc, [0], bad, 10.0)
        assert not res.ok and "slot numbers must be integers" in res.error
    res = sender.send(1, desc, [0, 1], [5, 5], 10.0)  # its writes would race each other
    assert not res.ok and "destination slot is listed twice" in res.error
    # a descriptor that claims more memory than the peer registered: the peer's engine
    # refuses a write outside every buffer it registered (a short pool, not a silent
    # overrun; a row just past one buffer's end could be inside the next one's, so far out)
    big = PeerDescriptor(desc.endpoint, tuple(BufferInfo(b.ptr, b.nbytes << 20, b.item_bytes)
                                              for b in desc.buffers))
    res = sender.send(2, big, [0], [NUM_SLOTS << 19], 10.0)
    assert not res.ok and "kv transfer failed" in res.error and "refused" in res.error
    # a descriptor whose buffers are shifted (corrupt handshake): refused, nothing written
    shifted = PeerDescriptor(desc.endpoint, tuple(BufferInfo(b.ptr + (1 << 40), b.nbytes,
                                                             b.item_bytes)
                                                  for b in desc.buffers))
    res = sender.send(3, shifted, [0], [0], 10.0)
    assert not res.ok and "kv transfer failed" in res.error
    assert not any(peer.read(list(range(NUM_SLOTS))))
    # another model's pool (row size differs): refused by the compatibility check
    other = PeerDescriptor(desc.endpoint, tuple(BufferInfo(b.ptr, b.nbytes, b.item_bytes * 2)
                                                for b in desc.buffers))
    res = sender.send(4, other, [0], [0], 10.0)
    assert not res.ok and "kv transfer failed: KV buffer 0 item size differs" in res.error
    # and the peer still serves good transfers afterwards: the engine may fail the first one
    # while it re-opens the connection the refused writes broke (seen once on a loaded
    # machine: "refused or broke off"), a failure of that one room with a clear status
    results = [sender.send(5 + i, desc, [3], [4], 10.0) for i in range(3)]
    assert results[-1].ok and sum(r.ok for r in results) >= 2, results
    assert all("kv transfer failed" in r.error for r in results if not r.ok), results
    assert peer.read([4]) == sender.read_slots([3])


def test_short_transfer_fails_the_checksum(peer: Peer, sender: MooncakeBackend) -> None:
    """What the control plane compares after each send: the receiver's checksum of the
    destination rows against the sender's of the source rows. A transfer that wrote only
    part of the rows does not match."""
    src, dst = [1, 2, 3, 4], [7, 8, 9, 10]
    assert sender.send(1, peer.descriptor, src[:3], dst[:3], 10.0).ok  # one row short
    import zlib
    assert zlib.crc32(peer.read(dst)) != sender.checksum(src)
    assert sender.send(2, peer.descriptor, src[3:], dst[3:], 10.0).ok
    assert zlib.crc32(peer.read(dst)) == sender.checksum(src)


def test_reregistered_pool(own_peer: Peer, sender: MooncakeBackend) -> None:
    """A pool reallocated on the receiver (memory release and resume) registers anew: the
    new descriptor works; the old one's addresses are no longer writable."""
    old = own_peer.descriptor
    new = own_peer.realloc()
    res = sender.send(1, new, [2], [3], 10.0)
    assert res.ok, res.error
    assert own_peer.read([3]) == sender.read_slots([2])
    if all(o.ptr != n.ptr for o, n in zip(old.buffers, new.buffers)):
        res = sender.send(2, old, [2], [3], 10.0)
        assert not res.ok and "kv transfer failed" in res.error
    # the sender's own pool reallocated too
    sender.register_buffers([torch.full((NUM_SLOTS, *ROW), 3.0) for _ in range(2 * LAYERS)])
    assert sender.send(3, new, [0], [5], 10.0).ok
    assert own_peer.read([5]) == sender.read_slots([0])


def test_fuzz_send_never_raises(peer: Peer, sender: MooncakeBackend) -> None:
    rng = random.Random(3)
    for room in range(200):
        n = rng.randint(0, 6)
        src = [rng.randint(-3, NUM_SLOTS + 3) for _ in range(n)]
        dst = [rng.randint(-3, NUM_SLOTS + 3) for _ in range(n + rng.choice([0, 0, 0, 1]))]
        res = sender.send(room, peer.descriptor, src, dst, 60.0)
        valid = (len(src) == len(dst) and len(set(dst)) == len(dst)
                 and all(0 <= s < NUM_SLOTS for s in src + dst))
        assert res.ok == valid, (src, dst, res.error)
        if not res.ok:
            assert "kv transfer failed" in res.error
        elif src:
            assert peer.read(dst) == sender.read_slots(src)
    # descriptors a broken or hostile handshake could carry: refused, never raised, and
    # nothing lands in the peer's pool
    peer.zero()
    real = peer.descriptor
    for room in range(60):
        bufs = tuple(BufferInfo(rng.choice([b.ptr ^ (1 << rng.randint(24, 62)), -b.ptr, 0,
                                            rng.getrandbits(64)]),
                                rng.choice([b.nbytes, b.nbytes << 30, -1, 0]),
                                rng.choice([b.item_bytes, 0, -64]))
                     for b in real.buffers)
        desc = PeerDescriptor(real.endpoint, bufs)
        res = sender.send(room, desc, [1, 2], [3, 4], 5.0)
        assert not res.ok and "kv transfer failed" in res.error
    assert not any(peer.read(list(range(NUM_SLOTS))))


def test_lifecycle_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    b = MooncakeBackend("127.0.0.1")
    with pytest.raises(KVTransferError, match="not started"):
        b.endpoint()
    res = b.send(1, PeerDescriptor("127.0.0.1:1", ()), [0], [0], 1.0)
    assert not res.ok and "kv transfer failed: the mooncake backend is not started" in res.error
    b.close()
    with pytest.raises(KVTransferError, match="closed"):
        b.start()
    monkeypatch.setenv("SGLANG_ADMIN_MOONCAKE_PROTOCOL", "carrier-pigeon")
    with pytest.raises(KVTransferError, match="protocol 'carrier-pigeon'"):
        MooncakeBackend("127.0.0.1")
    monkeypatch.delenv("SGLANG_ADMIN_MOONCAKE_PROTOCOL")
    monkeypatch.setenv("SGLANG_ADMIN_MOONCAKE_IB_DEVICE", "mlx5_0")
    assert MooncakeBackend("127.0.0.1").protocol == "rdma"  # SGLang's ib-device rule
    assert MooncakeBackend("127.0.0.1", protocol="tcp").protocol == "tcp"


def test_gpu_pool_refused_by_the_host_memory_build() -> None:
    """The non-CUDA engine would read a GPU pointer as host memory: refused at start."""
    b = MooncakeBackend("127.0.0.1")
    b.register_buffers([torch.empty(4, 8, device="meta")])  # any non-CPU device
    with pytest.raises(KVTransferError, match="GPU memory.*non-CUDA build"):
        b.start()
    with pytest.raises(KVTransferError, match="not started"):
        b.endpoint()  # a failed start leaves no half-started engine
    b.close()


def test_rdma_without_a_nic_says_so_and_still_moves_bytes(caplog: pytest.LogCaptureFixture,
                                                          ) -> None:
    """--protocol rdma on a machine with no RDMA NIC: the engine falls back to its TCP
    transport; the backend warns, and the bytes still land exactly."""
    gen = torch.Generator().manual_seed(5)
    a = MooncakeBackend("127.0.0.1", protocol="rdma")
    b = MooncakeBackend("127.0.0.1", protocol="rdma")
    a.register_buffers([torch.zeros(NUM_SLOTS, *ROW) for _ in range(2)])
    b.register_buffers([torch.randn(NUM_SLOTS, *ROW, generator=gen) for _ in range(2)])
    with caplog.at_level("WARNING", logger="sglang_admin.disaggregation.mooncake_backend"):
        a.start()
        b.start()
    try:
        if a.rdma_nics:
            pytest.skip(f"this machine has RDMA NICs: {a.rdma_nics}")
        assert "no RDMA NIC" in caplog.text
        res = b.send(1, a.descriptor(), [4, 5, 9], [0, 1, 2], 10.0)
        assert res.ok, res.error
        assert a.read_slots([0, 1, 2]) == b.read_slots([4, 5, 9])
    finally:
        a.close()
        b.close()


def test_a_small_room_is_staged_written_as_one_block_and_lands_at_land(
        peer: Peer, sender: MooncakeBackend) -> None:
    """A room the receiver expects gets a staging region in its descriptor; the sender
    writes every buffer's rows there as one block (a few write entries, not one per buffer
    and run), and they reach the room's slots when decode lands the room."""
    src = [5, 6, 7, 20, 3, 40]
    dst = [10, 11, 12, 0, 63, 30]
    desc = peer.expect(7, dst)
    assert desc.staging is not None and desc.staging[1] == len(dst) * 64 * 2 * LAYERS
    res = sender.send(7, desc, src, dst, 10.0)
    assert res.ok, res.error
    assert res.extra["staged"] and res.extra["entries"] <= 4
    assert not any(peer.read(dst))  # in the staging region until landed
    peer.land(7)
    assert peer.read(dst) == sender.read_slots(src)
    assert not any(peer.read([s for s in range(NUM_SLOTS) if s not in dst]))
    peer.release(7)
    # released: the region is free for the next room, which lands its own rows
    desc = peer.expect(8, [1, 2])
    assert sender.send(8, desc, [9, 8], [1, 2], 10.0).ok
    peer.land(8)
    assert peer.read([1, 2]) == sender.read_slots([9, 8])
    peer.release(8)


def test_a_sender_without_a_free_staging_region_writes_into_the_peers(
        peer: Peer, sender: MooncakeBackend) -> None:
    from sglang_admin.disaggregation.staging import StagingArea

    sender._tx = StagingArea(64)  # too small for the room: one entry per buffer and run
    desc = peer.expect(9, [4, 5, 6])
    res = sender.send(9, desc, [1, 3, 2], [4, 5, 6], 10.0)
    assert res.ok and res.extra["staged"] and res.extra["entries"] == 3 * 2 * LAYERS
    peer.land(9)
    assert peer.read([4, 5, 6]) == sender.read_slots([1, 3, 2])
    peer.release(9)


def test_a_lying_staging_region_fails_the_room_cleanly(peer: Peer,
                                                       sender: MooncakeBackend) -> None:
    desc = peer.expect(11, [4, 5])
    assert desc.staging is not None
    ptr, size = desc.staging
    for bad, why in (((ptr, size + 64), "staging region holds"),
                     ((ptr, size // 2), "staging region holds"),
                     ((ptr + (1 << 40), size), "kv transfer failed")):
        res = sender.send(11, PeerDescriptor(desc.endpoint, desc.buffers, bad), [1, 2],
                          [4, 5], 10.0)
        assert not res.ok and "kv transfer failed" in res.error and why in res.error
    # (prefill reports the failure; decode never lands a failed room, it releases it)
    assert not any(peer.read(list(range(NUM_SLOTS))))
    peer.release(11)
    # the connection survives the refused writes: the next room lands
    results = [sender.send(12 + i, peer.expect(12 + i, [3]), [2], [3], 10.0)
               for i in range(3)]
    assert results[-1].ok, results
    peer.land(14)
    assert peer.read([3]) == sender.read_slots([2])
    for room in (12, 13, 14):
        peer.release(room)
    for bad in ({"endpoint": "h:1", "buffers": [], "staging": [1]},
                {"endpoint": "h:1", "buffers": [], "staging": [0, 5]},
                {"endpoint": "h:1", "buffers": [], "staging": "x"}):
        with pytest.raises(KVTransferError, match="peer descriptor"):
            PeerDescriptor.from_wire(bad)


def test_a_large_room_is_not_staged(sender: MooncakeBackend) -> None:
    from sglang_admin.disaggregation import mooncake_backend

    rx = MooncakeBackend("127.0.0.1")
    rx.register_buffers([torch.zeros(NUM_SLOTS, *ROW) for _ in range(2 * LAYERS)])
    rx.start()
    try:
        room_bytes = 8 * 64 * 2 * LAYERS
        old = mooncake_backend.STAGE_MAX_BYTES
        mooncake_backend.STAGE_MAX_BYTES = room_bytes - 1
        try:
            rx.expect(1, list(range(8)))
        finally:
            mooncake_backend.STAGE_MAX_BYTES = old
        desc = rx.descriptor(1)
        assert desc.staging is None and rx.descriptor().staging is None
        res = sender.send(1, desc, list(range(8)), list(range(8)), 10.0)
        assert res.ok and not res.extra["staged"]
        rx.land(1)  # nothing staged: nothing to do
        assert rx.read_slots(list(range(8))) == sender.read_slots(list(range(8)))
        rx.expect(2, [1])
        assert rx.descriptor(2).staging is not None
        rx.release(2)
        assert rx.descriptor(2).staging is None
    finally:
        rx.close()
