"""The zmq KV backend's data connection (disaggregation/kv_stream.py, room_rows.py): rooms in
groups land byte for byte with the sums agreeing; on the stream, a room not expected, for
other slots, of the wrong size or buffer count is refused and never written, and the
connection serves the next room; a sender that dies or closes mid-room, or a room released
while its rows arrive, leaves nothing written after and no sum; a malformed or fuzzed
header ends that connection only."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from sglang_admin.disaggregation import kv_stream, room_rows
from sglang_admin.disaggregation.zmq_backend import ZmqBackend
from tests.zmq_pair import LAYERS, started_pair

SLOTS, ITEM = 64, 2 * 8 * 4  # float32 rows of 2 heads x 8 dims (the pair's pools)
NBUF = 2 * LAYERS
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def pair():
    with started_pair() as both:
        yield both


def connect(backend: ZmqBackend) -> socket.socket:
    host, _, port = backend.endpoint().rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.settimeout(10)
    return sock


def room(sock: socket.socket, room_id: int, dst: list[int], rows: bytes,
         nbytes: int | None = None, nbuf: int = NBUF) -> None:
    """One room on the wire: its header, then ``rows`` (``nbytes`` declared)."""
    sock.sendall(kv_stream.room_header(room_id, dst, nbuf,
                                       len(rows) if nbytes is None else nbytes) + rows)


def answer(sock: socket.socket) -> dict:
    return kv_stream.read_answer(sock)


def test_groups_cover_every_row_once_in_stream_order() -> None:
    items = [ITEM, 3 * ITEM, ITEM]
    for n, limit in ((0, 100), (1, 10), (5, 64), (7, 1 << 20), (64, 300), (64, 1000)):
        got = room_rows.groups(items, n, limit)
        covered = [(k, r) for a, b, r0, r1 in got for k in range(a, b) for r in range(r0, r1)]
        assert covered == [(k, r) for k in range(3) for r in range(n)], (n, limit, got)
        for a, b, r0, r1 in got:  # a group is whole buffers or rows of one buffer
            assert (r0, r1) == (0, n) or b == a + 1
            assert b == a + 1 or (r1 - r0) * sum(items[a:b]) <= limit
    assert len(room_rows.groups([768] * 60, 2048, 512 << 10)) == 180  # even cuts, no tail


@pytest.mark.parametrize("limit", [1, ITEM * 5 + 7, 4 * ITEM * 64, 1 << 20])
@pytest.mark.parametrize("layout", ["runs", "scattered"])
def test_a_room_in_groups_lands_and_its_sums_agree(pair, monkeypatch, limit: int,
                                                   layout: str) -> None:
    """Rows of a run of slots (sent from and landed in the pool's own rows) and of
    scattered slots (gathered, staged, scattered), in groups of one row up to the whole
    room: the bytes land, nothing else is written, and the receiver's sum of what it wrote
    equals the sender's sum of its source rows and zlib's CRC-32 of the same bytes."""
    monkeypatch.setattr(room_rows, "GROUP_BYTES", limit)
    sender, receiver = pair
    rng = random.Random(limit)
    for room_id in (1, 2):  # the kept connection serves the second room
        if layout == "runs":
            src, dst = list(range(5, 25)), list(range(30 + room_id, 50 + room_id))
        else:
            src, dst = rng.sample(range(SLOTS), 20), rng.sample(range(SLOTS), 20)
        receiver.expect(room_id, dst)
        res = sender.send_checked(room_id, receiver.descriptor(), src, dst, 10)
        assert res.ok, res.error
        assert receiver.read_slots(dst) == sender.read_slots(src)
        assert res.checksum == zlib.crc32(sender.read_slots(src)) == receiver.checksum(dst)
        assert receiver.received_checksum(room_id, dst) == res.checksum
        others = sorted(set(range(SLOTS)) - set(dst))
        receiver.release(room_id)
        if room_id == 1:
            assert set(receiver.read_slots(others)) == {0}
        else:
            assert len(sender._local.socks) == 1
        for t in receiver._buffers:
            t.zero_()


def test_refused_rooms_are_never_written_and_the_connection_serves_the_next(pair) -> None:
    """On one connection: a room not expected, one for other slots, one declaring another
    byte count or buffer count, one released before it came. Each one's rows are read and
    dropped, its answer names the cause, nothing is written; then a good room lands."""
    sender, receiver = pair
    rows1 = os.urandom(NBUF * ITEM)
    receiver.expect(11, [3])
    receiver.expect(14, [6])
    receiver.release(14)
    cases = [(10, [2], rows1, None, NBUF, "unknown room 10"),
             (11, [4], rows1, None, NBUF, "slots differ"),
             (11, [3], rows1[:-1], None, NBUF, "short transfer"),
             (11, [3], rows1 + b"x", None, NBUF, "short transfer"),
             (11, [3], rows1, None, NBUF - 1, "KV buffers"),
             (14, [6], rows1, None, NBUF, "unknown room 14")]
    with connect(receiver) as sock:
        for room_id, dst, rows, nbytes, nbuf, words in cases:
            room(sock, room_id, dst, rows, nbytes, nbuf)
            got = answer(sock)
            assert got["room"] == room_id and got["ok"] is False, got
            assert "kv transfer failed" in got["error"] and words in got["error"], got
            assert set(receiver.read_slots(list(range(SLOTS)))) == {0}
            assert receiver.received_checksum(room_id, dst) == receiver.checksum(dst)
        room(sock, 11, [3], rows1)
        assert answer(sock) == {"room": 11, "ok": True, "error": ""}
    assert receiver.read_slots([3]) == rows1
    assert receiver.received_checksum(11, [3]) == zlib.crc32(rows1)


def test_a_room_released_while_its_rows_arrive_gets_nothing_more(pair, monkeypatch) -> None:
    """Decode releases a room whose sender sent part of its rows and stalls: `release`
    returns at once (it never waits for the network), the rows that come after are dropped,
    the room is refused, and no sum is kept for it."""
    monkeypatch.setattr(room_rows, "GROUP_BYTES", ITEM)  # a group per buffer
    sender, receiver = pair
    dst = [7, 8]
    receiver.expect(21, dst)
    part = NBUF * len(dst) * ITEM // 2
    rows = os.urandom(NBUF * len(dst) * ITEM)
    with connect(receiver) as sock:
        sock.sendall(kv_stream.room_header(21, dst, NBUF, len(rows)) + rows[:part])
        time.sleep(0.3)  # the first half landed; the receiver waits for the rest
        t0 = time.monotonic()
        receiver.release(21)
        assert time.monotonic() - t0 < 0.2
        landed = receiver.read_slots(dst)
        assert landed[:part] == rows[:part] and set(landed[part:]) == {0}
        sock.sendall(rows[part:])
        got = answer(sock)
        assert got["ok"] is False and "released by decode" in got["error"], got
    assert receiver.read_slots(dst) == landed  # nothing written after the release
    assert receiver._landed == {} and receiver._receiving == set()


def test_a_second_connection_for_a_room_in_progress_is_refused(pair) -> None:
    sender, receiver = pair
    receiver.expect(31, [9])
    rows = os.urandom(NBUF * ITEM)
    with connect(receiver) as first, connect(receiver) as second:
        first.sendall(kv_stream.room_header(31, [9], NBUF, len(rows)) + rows[:ITEM])
        time.sleep(0.2)
        room(second, 31, [9], os.urandom(NBUF * ITEM))
        got = answer(second)
        assert got["ok"] is False and "another connection" in got["error"], got
        first.sendall(rows[ITEM:])
        assert answer(first)["ok"] is True
    assert receiver.read_slots([9]) == rows


@pytest.mark.parametrize("how", ["closed", "killed"])
def test_a_sender_that_dies_mid_room_leaves_no_sum_and_harms_nothing(pair, how: str) -> None:
    """A sender that closes its connection, or whose process is SIGKILLed, half-way through
    a room: the receiver keeps no sum for it (decode's checksum of the slots is what the
    pool holds, not the sender's), frees the connection, and the next room lands."""
    sender, receiver = pair
    dst = [12, 13]
    receiver.expect(41, dst)
    rows = os.urandom(NBUF * len(dst) * ITEM)
    head = kv_stream.room_header(41, dst, NBUF, len(rows))
    if how == "closed":
        with connect(receiver) as sock:
            sock.sendall(head + rows[:len(rows) // 2])
    else:
        host, _, port = receiver.endpoint().rpartition(":")
        code = ("import os, signal, socket, sys\n"
                f"s = socket.create_connection(({host!r}, {port}))\n"
                "data = sys.stdin.buffer.read()\n"
                "s.sendall(data)\n"
                "os.kill(os.getpid(), signal.SIGKILL)\n")
        done = subprocess.run([sys.executable, "-c", code], input=head + rows[:len(rows) // 2],
                              timeout=60, cwd=str(ROOT))
        assert done.returncode == -9
    deadline = time.monotonic() + 10
    while receiver._receiving and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver._receiving == set() and 41 not in receiver._landed
    assert receiver.received_checksum(41, dst) == receiver.checksum(dst)
    assert receiver.received_checksum(41, dst) != zlib.crc32(rows)
    res = sender.send_checked(41, receiver.descriptor(), [1, 2], dst, 10)  # a new sender
    assert res.ok, res.error
    assert receiver.received_checksum(41, dst) == res.checksum == receiver.checksum(dst)
    deadline = time.monotonic() + 10
    while len(receiver._conns) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(receiver._conns) == 1  # the dead sender's connection is gone


def test_a_malformed_header_is_answered_and_ends_that_connection_only(pair) -> None:
    sender, receiver = pair
    receiver.expect(51, [5])
    bad = [b"GET / HTTP/1.1\r\n\r\n",  # not our magic
           kv_stream.MAGIC + (1 << 30).to_bytes(4, "big"),  # a header too large
           kv_stream.MAGIC + (1 << 20).to_bytes(4, "big"),  # more than 64 slots could need
           kv_stream.MAGIC + b"\x00\x00\x00\x01\xc1",  # not msgpack
           kv_stream.MAGIC + b"\x00\x00\x00\x01\x90"]  # not a header map
    import msgpack

    for fields in ({"room": "x", "dst_slots": [5], "nbuf": NBUF, "nbytes": 1},
                   {"room": 51, "dst_slots": [5], "nbuf": NBUF, "nbytes": -1},
                   {"room": 51, "dst_slots": ["5"], "nbuf": NBUF, "nbytes": 1},
                   {"room": 51, "dst_slots": [5]}):
        body = msgpack.packb(fields)
        bad.append(kv_stream.MAGIC + len(body).to_bytes(4, "big") + body)
    for data in bad:
        with connect(receiver) as sock:
            sock.sendall(data)
            got = answer(sock)
            assert got["ok"] is False and "kv transfer failed" in got["error"], (data, got)
            assert sock.recv(1) == b""  # closed: the stream cannot be followed
    assert set(receiver.read_slots([5])) == {0}
    assert sender.send(51, receiver.descriptor(), [3], [5], 10).ok


def test_a_receiver_that_lies_or_vanishes_fails_the_room_with_a_clear_error(pair) -> None:
    """A stand-in decode that answers for another room, answers garbage, or closes without
    answering: the send fails with "kv transfer failed" and the connection is not kept."""
    sender, receiver = pair
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    fake = receiver.descriptor().__class__(f"127.0.0.1:{port}", receiver.buffer_infos())
    replies = [kv_stream.answer_bytes(99, None), b"\x00\x00\x00\x02\xc1\xc1", b""]

    def serve() -> None:
        for reply in replies:
            conn, _ = listener.accept()
            with conn:
                head = kv_stream.next_room(conn)
                left = kv_stream.parse_header(head)[3]
                while left:
                    left -= len(conn.recv(min(left, 1 << 16)))
                conn.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    for words in ("answered", "kv transfer failed", "no answer from decode"):
        res = sender.send(61, fake, [1], [1], 5)
        assert not res.ok and "kv transfer failed" in res.error and words in res.error, res
        assert sender._local.socks == {}
    t.join(10)
    listener.close()
    receiver.expect(62, [1])
    assert sender.send(62, receiver.descriptor(), [1], [1], 5).ok


def test_fuzzed_headers_and_rows_never_break_the_receiver(pair) -> None:
    """Random but well-framed headers with random rows, and random bytes: every answer is
    a refusal or an exact landing, the receiver still moves a real room afterwards."""
    import msgpack

    sender, receiver = pair
    rng = random.Random(5)
    receiver.expect(70, [3, 4])
    values = [0, 1, 5, -1, 2**40, "x", None, [1], 3.5]
    for _ in range(120):
        with connect(receiver) as sock:
            if rng.random() < 0.2:
                sock.sendall(kv_stream.MAGIC + rng.randbytes(rng.randrange(1, 40)))
            else:
                fields = {"room": rng.choice([70, 71, "r", None]),
                          "dst_slots": rng.choice([[3, 4], [3], [], "x", [2**60], [-1]]),
                          "nbuf": rng.choice(values),
                          "nbytes": rng.choice([*values, 2 * NBUF * ITEM])}
                body = msgpack.packb(fields)
                rows = rng.randbytes(rng.choice([0, 1, 64, 2 * NBUF * ITEM]))
                sock.sendall(kv_stream.MAGIC + len(body).to_bytes(4, "big") + body + rows)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(5)
            try:
                got = answer(sock)
            except (ConnectionError, ValueError, TimeoutError):
                continue  # closed without an answer: a header that never completed
            assert isinstance(got, dict) and "ok" in got
            if got["ok"]:
                assert got["room"] == 70
    receiver.release(70)
    receiver.expect(72, [9])
    assert sender.send_checked(72, receiver.descriptor(), [2], [9], 10).ok
    assert receiver.read_slots([9]) == sender.read_slots([2])


def test_a_small_room_after_a_large_one_that_waited_is_not_held_back(pair) -> None:
    """The receiver waits for the rest of a room's read as one wake-up (the socket's
    receive low-water mark set to what is still to come): a room that made it wait, then a
    room far smaller than that mark, on the same connection: the second lands at once."""
    sender, receiver = pair
    big = list(range(SLOTS))
    rows = os.urandom(NBUF * SLOTS * ITEM)
    receiver.expect(81, big)
    receiver.expect(82, [1])
    with connect(receiver) as sock:
        sock.sendall(kv_stream.room_header(81, big, NBUF, len(rows)) + rows[:ITEM])
        time.sleep(0.3)  # the receiver now waits for the rest of its first read
        sock.sendall(rows[ITEM:])
        assert answer(sock)["ok"] is True
        assert receiver.read_slots(big) == rows
        one = os.urandom(NBUF * ITEM)
        time.sleep(0.3)  # the receiver now waits for the next room's header
        t0 = time.monotonic()
        room(sock, 82, [1], one)
        assert answer(sock)["ok"] is True
        assert time.monotonic() - t0 < 2
    assert receiver.read_slots([1]) == one


@pytest.mark.parametrize("layout", ["runs", "scattered"])
def test_a_pool_the_host_cannot_address_goes_through_torch(monkeypatch, layout: str) -> None:
    """A device pool's path (no host rows: gathered with torch, staged, landed with
    ``index_copy_``, summed on "done"), taken here by CPU tensors registered as if they were
    on a device: the bytes land and the sums agree."""
    import dataclasses

    from sglang_admin.disaggregation import transfer

    real = transfer.RegisteredPool.of

    def as_device(buffers):
        got = real(buffers)
        return dataclasses.replace(got, host_rows=[None] * len(got.tensors), bases=None,
                                   items=None, num_slots=0, flat=())

    monkeypatch.setattr(transfer.RegisteredPool, "of", staticmethod(as_device))
    monkeypatch.setattr(room_rows, "GROUP_BYTES", 3 * ITEM)  # row cuts and whole buffers
    with started_pair() as (sender, receiver):
        assert sender._pool.kernel() is None and sender._pool.host_rows[0] is None
        if layout == "runs":
            src, dst = list(range(3, 13)), list(range(40, 50))
        else:
            src = random.Random(3).sample(range(SLOTS), 10)
            dst = random.Random(4).sample(range(SLOTS), 10)
        receiver.expect(91, dst)
        res = sender.send_checked(91, receiver.descriptor(), src, dst, 10)
        assert res.ok, res.error
        assert receiver.read_slots(dst) == sender.read_slots(src)
        assert receiver.received_checksum(91, dst) == res.checksum == zlib.crc32(
            sender.read_slots(src))


def test_send_views_sends_every_byte_once_when_the_kernel_takes_part() -> None:
    """A send the kernel cuts short (its timeout, a signal) goes on from where it stopped,
    over more views than one call takes."""

    class Partial:
        def __init__(self, rng: random.Random) -> None:
            self.out, self.rng = bytearray(), rng

        def sendmsg(self, views: list[memoryview]) -> int:
            assert len(views) <= 512
            data = b"".join(bytes(v) for v in views)[:self.rng.randrange(1, 200)]
            self.out += data
            return len(data)

    rng = random.Random(1)
    for _ in range(200):
        views = [memoryview(rng.randbytes(rng.randrange(0, 50)))
                 for _ in range(rng.randrange(0, 700))]
        sock = Partial(rng)
        kv_stream.send_views(sock, list(views))
        assert bytes(sock.out) == b"".join(bytes(v) for v in views)
