"""The wire of the `zmq` KV backend's data connection: one plain TCP stream per sending
thread and peer, carrying rooms one after another.

Per room, sender -> receiver: ``MAGIC`` (4 bytes), the header's length (4 bytes, big
endian), the header (msgpack ``{room, dst_slots, nbuf, nbytes}``), then exactly ``nbytes``
of rows, buffer-major (every row of buffer 0 in slot order, then buffer 1's, ..). Receiver
-> sender, once per room, after its last byte: the answer's length (4 bytes) and the answer
(msgpack ``{room, ok, error}``). A room's header and its first rows leave in one
``sendmsg``; the rows are the pool's own rows where they lie (no copy in user space).

The helpers here read and write that framing over blocking sockets; reads of a room's rows
never block while holding a lock (see :func:`fill`).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

MAGIC = b"KVr1"
MAX_HEADER_BYTES = 64 << 20  # a header lists a room's slots: bounded
MAX_ANSWER_BYTES = 1 << 16
#: the TCP send and receive buffers of both ends (the OS's default autotunes from ~128 KiB;
#: a room's megabytes move in fewer, larger copies with these)
SOCK_BUF = 8 << 20
#: a room's rows that arrive are written into the pool this many bytes at a time at most
#: (the receiver holds the backend's lock while one such copy runs, so that `release`
#: waits for at most one of them: never for the network)
PIECE_BYTES = 1 << 20
#: a connection whose sender sent nothing for this long in the middle of a room is closed
STALL_S = 60.0
_IOV_MAX = 512  # buffers per sendmsg / recvmsg_into (the kernel's limit is 1024)
_LEN = struct.Struct("!I")
_TIMEVAL = struct.Struct("@ll")


class StreamClosed(ConnectionError):
    """The peer closed the connection (or it stalled mid-room); the message says where."""


def tune(sock: socket.socket) -> None:
    """No Nagle (a room's answer goes at once), large buffers, keep-alive probes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def set_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking send and receive on ``sock`` (kept blocking: no poll before every
    call, as a Python-level timeout adds) to ``seconds``: a send that times out returns
    short or raises BlockingIOError, a receive raises BlockingIOError."""
    tv = _TIMEVAL.pack(int(seconds), max(1, int(seconds % 1 * 1e6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def room_header(room: int, dst_slots: list[int], nbuf: int, nbytes: int) -> bytes:
    """A room's framing: magic, length, msgpack header."""
    head = msgpack.packb({"room": room, "dst_slots": dst_slots, "nbuf": nbuf,
                          "nbytes": nbytes})
    return MAGIC + _LEN.pack(len(head)) + head


def parse_header(data: bytes) -> tuple[int, list[int], int, int]:
    """(room, dst_slots, nbuf, nbytes) of a header's msgpack; ValueError when malformed."""
    try:
        head = msgpack.unpackb(data, raw=False, strict_map_key=True)
        room, dst, nbuf, nbytes = (head["room"], head["dst_slots"], head["nbuf"],
                                   head["nbytes"])
    except Exception as exc:  # noqa: BLE001 - network input
        raise ValueError(f"malformed header ({type(exc).__name__})") from None
    if not (isinstance(room, int) and isinstance(nbuf, int) and isinstance(nbytes, int)
            and isinstance(dst, list) and set(map(type, dst)) <= {int}):
        raise ValueError("malformed header (field types)")
    if isinstance(room, bool) or nbytes < 0 or nbuf < 0:
        raise ValueError("malformed header (negative size)")
    return room, dst, nbuf, nbytes


def answer_bytes(room: int | None, error: str | None) -> bytes:
    body = msgpack.packb({"room": room, "ok": error is None, "error": error or ""})
    return _LEN.pack(len(body)) + body


def _drop_front(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` in place (whole views, then a slice)."""
    while n:
        if n >= len(views[0]):
            n -= len(views.pop(0))
        else:
            views[0] = views[0][n:]
            n = 0


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Every byte of ``views`` (gathered by sendmsg, as many as the kernel takes a call);
    the socket's `set_timeout` bounds each call (BlockingIOError out)."""
    n = 0
    if len(views) <= _IOV_MAX:
        n = sock.sendmsg(views)
        if n == sum(map(len, views)):
            return  # the common case: a blocking socket takes all of it in one call
    # else cut short (the send timeout, a signal) or too many views: the rest in turns
    views = [v for v in views if len(v)]
    while views:
        _drop_front(views, n)
        if views:
            n = sock.sendmsg(views[:_IOV_MAX])


def read_answer(sock: socket.socket) -> Any:
    """The room's answer (`set_timeout` bounds the wait); StreamClosed on EOF."""
    buf = bytearray()
    while len(buf) < 4 or len(buf) < 4 + _LEN.unpack_from(buf)[0]:
        if len(buf) >= 4 and _LEN.unpack_from(buf)[0] > MAX_ANSWER_BYTES:
            raise ValueError("answer too large")
        more = sock.recv(MAX_ANSWER_BYTES)
        if not more:
            raise StreamClosed("the connection closed before the answer")
        buf += more
    size = _LEN.unpack_from(buf)[0]
    return msgpack.unpackb(bytes(buf[4:4 + size]), raw=False)


def fill(sock: socket.socket, views: list[memoryview],
         guard: tuple[threading.Lock, Callable[[], bool]] | None = None,
         stall_s: float = STALL_S) -> None:
    """Fill ``views`` in order with the stream's next bytes (the socket is blocking).

    Each read takes only what has arrived (``MSG_DONTWAIT``, at most ``PIECE_BYTES``) and
    waits for more outside any lock; with ``guard`` (lock, live) every read runs under the
    lock and only while ``live()`` holds, so a writer into the pool never outlives the
    room's release by more than one piece. Raises `Released` when ``live()`` turned false
    (nothing more written), StreamClosed on EOF or a stall of ``stall_s``."""
    views = [v for v in views if len(v)]
    poller: Any = None
    got = 0
    left = sum(map(len, views))
    while views:
        if left <= PIECE_BYTES and len(views) <= _IOV_MAX:
            batch, asked = views, left  # the common case: the whole rest in one read
        else:
            batch, asked = [], 0
            for v in views[:_IOV_MAX]:
                if asked >= PIECE_BYTES:
                    break
                batch.append(v if asked + len(v) <= PIECE_BYTES else v[:PIECE_BYTES - asked])
                asked += len(batch[-1])
        try:
            if guard is None:
                n = sock.recvmsg_into(batch, 0, socket.MSG_DONTWAIT)[0]
            else:
                with guard[0]:
                    if not guard[1]():
                        raise Released(got)
                    n = sock.recvmsg_into(batch, 0, socket.MSG_DONTWAIT)[0]
        except BlockingIOError:
            n = -1
        if n == 0:
            raise StreamClosed("the sender closed the connection mid-room (short transfer)")
        if n > 0:
            got += n
            left -= n
            if not left:
                return  # the common case: all of it in one read
            _drop_front(views, n)
        if views and n < asked:  # less than asked had come: wait for the rest of it
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLIN)
            # woken once the rest of this read is queued (at most a piece), not for every
            # packet: on a busy core each wake-up was a switch away from the sender, which
            # cost a 1.5 MB room a third of its time (`next_room` sets it back to 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT,
                            max(1, min(left, PIECE_BYTES)))
            t0 = time.monotonic()
            if not poller.poll(stall_s * 1000):
                raise StreamClosed(f"nothing came for {time.monotonic() - t0:.0f}s "
                                   "mid-room (sender stalled)") from None


def next_room(sock: socket.socket, max_header: int = MAX_HEADER_BYTES) -> bytes | None:
    """The next room's header msgpack, waiting as long as the connection is idle (a sender
    keeps it between rooms); None when the peer closed it between rooms. ValueError when the
    framing is wrong (the stream cannot be followed any further)."""
    head = bytearray(8)
    # any byte wakes the wait for a header (a `fill` may have left the mark higher: a
    # smaller room's bytes would never reach it)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    got = sock.recv_into(head)  # blocks while idle; close() shuts the socket down
    if got == 0:
        return None
    if got < 8:
        fill(sock, [memoryview(head)[got:]])
    if head[:4] != MAGIC:
        raise ValueError("not a KV room header (bad magic)")
    size = _LEN.unpack_from(head, 4)[0]
    if size > min(max_header, MAX_HEADER_BYTES):
        raise ValueError(f"header of {size} bytes (over "
                         f"{min(max_header, MAX_HEADER_BYTES)})")
    return read_exact(sock, size)


def read_exact(sock: socket.socket, nbytes: int, stall_s: float = STALL_S) -> bytes:
    """The stream's next ``nbytes`` bytes (see :func:`fill`)."""
    buf = bytearray(nbytes)
    fill(sock, [memoryview(buf)], stall_s=stall_s)
    return bytes(buf)


def drain(sock: socket.socket, nbytes: int, scratch: memoryview) -> None:
    """Read and drop the stream's next ``nbytes`` (a refused room's rows)."""
    while nbytes > 0:
        k = min(nbytes, len(scratch))
        fill(sock, [scratch[:k]])
        nbytes -= k


def hang_up(sock: socket.socket, linger_s: float = 1.0, most: int = 16 << 20) -> None:
    """End a connection whose stream cannot be followed, after its answer: no more writes,
    then what the peer still sends is read and dropped (up to ``most`` bytes or
    ``linger_s``) so that closing does not reset the connection under the answer."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(linger_s)
        end = time.monotonic() + linger_s
        while most > 0 and time.monotonic() < end:
            got = sock.recv(min(most, 1 << 16))
            if not got:
                return
            most -= len(got)
    except OSError:
        pass


class Released(Exception):
    """The room was released (or never expected) while its rows were arriving; ``consumed``:
    the bytes of it read from the stream before that was seen."""

    def __init__(self, consumed: int = 0) -> None:
        super().__init__(consumed)
        self.consumed = consumed
