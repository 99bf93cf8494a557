"""The `zmq` KV transfer backend: for machines without the mooncake transfer engine.

What travels how: the PD control plane (handshakes, "done", cancels) is ZMQ PUSH/PULL with
msgpack (disaggregation/control.py); this backend moves a room's rows, with the room's
header and its answer, over a plain TCP connection (the wire: disaggregation/kv_stream.py).
The bulk bytes do not go through libzmq: its I/O thread's copies and hand-offs cost a 1.5 MB
room more than the socket itself does (a bare pyzmq round trip of 1.5 MB ran at 0.5-0.77x a
raw socket here, and a small message's round trip at ~120 us against ~5 us on a plain TCP
connection), so rows go by ``sendmsg`` from the pool and ``recv`` into it. The name stays
``zmq`` (the flag's value and the peers that use it).

The receiver (decode) listens on one TCP port (its descriptor's endpoint) and serves each
connection on a thread of its own. A sender (prefill) keeps one connection per peer in
each sending thread: a room is its header and rows, then one answer; the connection serves
the next room once answered, and any failure or timeout closes it (the next room connects
anew). A room's rows go buffer-major as the pool's own rows when its source slots are one
run (``sendmsg`` of views, no copy), else gathered into the thread's staging buffer a few
buffers at a time (one kv_rows call: copy and CRC-32), in groups of about ``GROUP_BYTES``;
the sender sums each group right after the kernel took it (`send_checked`), while decode
is still reading it.

The receiver reads the header first and checks, before any row is written: the room is
expected, the slots are the ones it reserved for it, the buffer count and the byte count
are exact, and no other connection is writing that room. A refused room's rows are read
and dropped, then it is answered with the reason ("kv transfer failed: ..."); a malformed
header is answered and the connection closed. Rows for a run of slots are read straight
into the pool's rows (``recv`` into them, at most ``kv_stream.PIECE_BYTES`` a read, under
the backend's lock and only while the room is still expected: `release` waits for at most
one such read, never for the network, and nothing is written after it returns); other
slots through a staging buffer and one kv_rows scatter per group. A read that has to wait
sleeps until the rest of it has arrived (``SO_RCVLOWAT``), not once per packet. The rows
of each group are summed (CRC-32) right after they landed, while in cache: decode's
`received_checksum` takes that sum instead of reading the pool again. A sender that dies
or stalls mid-room leaves the room unanswered and without a sum (decode's checksum then
fails it).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sglang_admin.disaggregation import kv_stream, room_rows
from sglang_admin.disaggregation.kv_stream import Released, StreamClosed
from sglang_admin.disaggregation.room_rows import Group, group_bytes, groups
from sglang_admin.disaggregation.transfer import (
    KVTransferBackend,
    KVTransferError,
    PeerDescriptor,
    RegisteredPool,
    TransferResult,
    check_compatible,
    crc32,
    slot_run,
)

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  # connections served at once (further ones are closed at accept)


class ZmqBackend(KVTransferBackend):
    """KV pages over a plain TCP connection per peer (see the module doc)."""

    name = "zmq"

    def __init__(self, host: str = "127.0.0.1", bind_host: str | None = None) -> None:
        super().__init__(host)
        self.bind_host = bind_host or ("0.0.0.0" if host not in ("127.0.0.1", "localhost")
                                       else host)
        self._listener: socket.socket | None = None
        self._port = 0
        self._lock = threading.Lock()
        self._expected: dict[int, list[int]] = {}
        self._landed: dict[int, int] = {}  # room -> CRC-32 of the rows written for it
        self._receiving: set[int] = set()  # rooms a connection is writing now
        self._conns: set[socket.socket] = set()  # accepted, served
        self._out: set[socket.socket] = set()  # the senders' connections, every thread's
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._local = threading.local()  # a thread's connection per peer, staging buffer

    def endpoint(self) -> str:
        if not self._port:
            raise KVTransferError("kv transfer: zmq backend not started")
        return f"{self.host}:{self._port}"

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # before listen: accepted connections inherit the buffer (and its window scale)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, kv_stream.SOCK_BUF)
            sock.bind((self.bind_host, 0))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise KVTransferError(f"kv transfer: zmq backend cannot listen on "
                                  f"{self.bind_host}: {exc}") from None
        self._listener = sock
        self._port = sock.getsockname()[1]
        self._spawn(self._accept, sock, "kv-tcp-accept")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            socks = [*self._conns, *self._out]
            if self._listener is not None:
                socks.append(self._listener)
        for s in socks:  # wakes the threads blocked on them
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(timeout=2)
        for s in socks:
            s.close()

    def _spawn(self, target: Any, arg: Any, name: str) -> None:
        t = threading.Thread(target=target, args=(arg,), daemon=True, name=name)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    # ------------------------------------------------------------------ receiver side
    def expect(self, room: int, dst_slots: Sequence[int]) -> None:
        want = list(map(int, dst_slots))
        with self._lock:
            self._expected[room] = want

    def release(self, room: int) -> None:
        with self._lock:  # a write into the room's rows holds it: none after this returns
            self._expected.pop(room, None)
            self._landed.pop(room, None)

    def received_checksum(self, room: int, slots: Sequence[int]) -> int:
        """The sum the receiving thread took of the rows it wrote for ``room`` (into these
        slots: the only ones it accepts for the room); the pool's rows summed here when it
        wrote none (a short or refused transfer: they are what the pool holds)."""
        with self._lock:
            landed = self._landed.get(room)
            want = self._expected.get(room)
        if landed is not None and want is not None and len(want) == len(slots) and (
                want == (slots if isinstance(slots, list) else list(map(int, slots)))):
            return landed
        return self.checksum(slots)

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # e.g. out of descriptors: not a busy loop
                continue
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS or self._closed
                if not full:
                    self._conns.add(conn)
            if full:
                conn.close()
                continue
            kv_stream.tune(conn)
            self._spawn(self._serve, conn, "kv-tcp-recv")

    def _serve(self, conn: socket.socket) -> None:
        """One connection's rooms, one after another, each answered after its rows."""
        try:
            while not self._closed:
                try:
                    # a header lists at most the pool's slots: its size is bounded by
                    # them before any of it is read (a peer cannot make it allocate more)
                    raw = kv_stream.next_room(conn, 1024 + 10 * _slots(self._pool))
                    if raw is None:
                        return  # the sender closed it between rooms
                    room, dst, nbuf, nbytes = kv_stream.parse_header(raw)
                except ValueError as exc:  # the stream cannot be followed: answer, close
                    conn.sendall(kv_stream.answer_bytes(None, f"kv transfer failed: {exc}"))
                    kv_stream.hang_up(conn)
                    return
                error = self._receive(conn, room, dst, nbuf, nbytes)
                conn.sendall(kv_stream.answer_bytes(room, error))
        except (OSError, StreamClosed) as exc:
            if not self._closed:
                logger.info("kv transfer: a sender's connection ended: %s", exc)
        except Exception:  # noqa: BLE001 - a bad stream ends its connection only
            logger.exception("kv transfer receive failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _receive(self, conn: socket.socket, room: int, dst: list[int], nbuf: int,
                 nbytes: int) -> str | None:
        """Check a room's header, then land its ``nbytes`` of rows (or drop them when it is
        refused): None when they landed, else why refused."""
        pool = self._pool
        items = pool.item_bytes
        with self._lock:
            want = self._expected.get(room)
            why = None
            if want is None:
                why = f"unknown room {room} (not expected by decode)"
            elif dst != want:
                why = f"room {room} slots differ from those reserved"
            elif nbuf != len(items):
                why = f"room {room} has {nbuf} KV buffers, this pool {len(items)}"
            elif nbytes != len(dst) * sum(items):
                why = (f"room {room} sent {nbytes} bytes, expected {len(dst) * sum(items)} "
                       "(short transfer)")
            elif dst and (min(dst) < 0 or max(dst) >= _slots(pool)):
                why = f"room {room} slots lie outside this pool of {_slots(pool)}"
            elif room in self._receiving:
                why = f"room {room} is already being received on another connection"
            else:
                self._receiving.add(room)
                self._landed.pop(room, None)
        if why is not None:
            kv_stream.drain(conn, nbytes, self._scratch(1 << 20))
            return f"kv transfer failed: {why}"
        done = 0
        run = slot_run(want) if pool.bases is not None else None  # a host pool
        guard = (self._lock, lambda: self._expected.get(room) is want)
        kern = pool.kernel()
        try:
            crc: int | None = 0
            for g in groups(items, len(dst)):
                crc = self._land_group(conn, pool, want, run, guard, g, crc, kern)
                done += group_bytes(pool, g)
            with self._lock:
                if self._expected.get(room) is not want:
                    raise Released(0)
                if crc is not None:
                    self._landed[room] = crc
            return None
        except Released as rel:  # nothing more written; the rest of the rows dropped
            kv_stream.drain(conn, nbytes - done - rel.consumed, self._scratch(1 << 20))
            return f"kv transfer failed: unknown room {room} (released by decode meanwhile)"
        finally:
            with self._lock:
                self._receiving.discard(room)

    def _land_group(self, conn: socket.socket, pool: RegisteredPool, want: list[int],
                    run: slice | None, guard: tuple[threading.Lock, Any], g: Group,
                    crc: int | None, kern: Any) -> int | None:
        """Group ``g`` of a room's rows into its slots ``want`` (``run``: the same slots as
        one run, in a host pool), while ``guard`` holds; the CRC-32 of the rows written,
        continued from ``crc`` (None: a device pool, summed on "done"); ``kern``: the
        pool's kv_rows kernel or None."""
        if run is not None:  # straight into the pool's rows
            kv_stream.fill(conn, room_rows.run_views(pool, run, g), guard)
            return room_rows.sum_run(pool, run, g, crc or 0, kern)
        size = group_bytes(pool, g)
        stage = self._scratch(size)[:size]
        kv_stream.fill(conn, [stage])
        with self._lock:
            if not guard[1]():
                raise Released(size)
            return room_rows.scatter(pool, want, g, np.frombuffer(stage, dtype=np.uint8), crc)

    def _scratch(self, nbytes: int) -> memoryview:
        """This thread's staging buffer, at least ``nbytes``."""
        buf = getattr(self._local, "staging", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.staging = memoryview(np.empty(max(nbytes, 1 << 20),
                                                            dtype=np.uint8)).cast("B")
        return buf

    # ------------------------------------------------------------------ sender side
    def send(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
             dst_slots: Sequence[int], timeout_s: float) -> TransferResult:
        return self._send(room, peer, src_slots, dst_slots, timeout_s, False)

    def send_checked(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
                     dst_slots: Sequence[int], timeout_s: float) -> TransferResult:
        """`send`, each group of source rows summed right after the kernel took it."""
        return self._send(room, peer, src_slots, dst_slots, timeout_s, True)

    def _send(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
              dst_slots: Sequence[int], timeout_s: float, with_sum: bool) -> TransferResult:
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        if self._closed or not self._port:
            return TransferResult(False, "kv transfer failed: zmq backend not running")
        if len(src_slots) != len(dst_slots):
            return TransferResult(False, f"kv transfer failed: {len(src_slots)} source slots "
                                         f"for {len(dst_slots)} destination slots")
        pool = self._pool
        if len(src_slots) and (min(src_slots) < 0 or max(src_slots) >= _slots(pool)):
            return TransferResult(False, "kv transfer failed: source slots lie outside this "
                                         f"pool of {_slots(pool)}")
        theirs = peer.buffers
        why = None if (len(theirs) == len(pool.item_bytes) and tuple(
            b.item_bytes for b in theirs) == pool.item_bytes) else check_compatible(
            pool.infos, peer)
        if why is not None:
            return TransferResult(False, why.replace("kv transfer:", "kv transfer failed:"))
        nbytes = len(src_slots) * sum(pool.item_bytes)
        head = kv_stream.room_header(room, list(map(int, dst_slots)), len(pool.item_bytes),
                                     nbytes)
        kept: dict[str, socket.socket] = self._local.__dict__.setdefault("socks", {})
        sock = kept.pop(peer.endpoint, None)  # back in the dict only once answered
        reply: Any = None
        checksum: int | None = None
        where = peer.endpoint
        try:
            if sock is None:
                sock = self._connect(peer.endpoint, timeout_s)
            checksum = self._send_rows(sock, pool, src_slots, head, deadline)
            kv_stream.set_timeout(sock, max(1e-3, deadline - time.perf_counter()))
            reply = kv_stream.read_answer(sock)
        except (TimeoutError, BlockingIOError):
            return TransferResult(False, f"kv transfer failed: no answer from decode at {where} "
                                         f"within {timeout_s:g}s (peer dead?)", nbytes,
                                  time.perf_counter() - t0)
        except (OSError, ValueError, TypeError) as exc:  # StreamClosed is an OSError
            return TransferResult(False, f"kv transfer failed: no answer from decode at {where} "
                                         f"({exc}; peer dead?)", nbytes,
                                  time.perf_counter() - t0)
        finally:
            if isinstance(reply, dict) and reply.get("room") == room:
                kept[peer.endpoint] = sock  # answered: the next room may use it
            elif sock is not None:
                self._drop(sock)
        if not isinstance(reply, dict) or reply.get("room") not in (room, None):
            return TransferResult(False, f"kv transfer failed: decode at {where} answered "
                                         f"{reply!r:.200} for room {room}", nbytes,
                                  time.perf_counter() - t0)
        if not reply.get("ok"):
            return TransferResult(False, str(reply.get("error")) or "kv transfer failed",
                                  nbytes, time.perf_counter() - t0)
        return TransferResult(True, "", nbytes, time.perf_counter() - t0,
                              checksum=checksum if with_sum else None)

    def _connect(self, endpoint: str, timeout_s: float) -> socket.socket:
        host, _, port = endpoint.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except ValueError:
            raise OSError(f"bad endpoint {endpoint!r}") from None
        sock.settimeout(None)  # blocking; set_timeout bounds each call in the kernel
        kv_stream.tune(sock)
        with self._lock:
            if self._closed:
                sock.close()
                raise OSError("backend closed")
            self._out.add(sock)
        return sock

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._out.discard(sock)
        sock.close()

    def _send_rows(self, sock: socket.socket, pool: RegisteredPool, src: Sequence[int],
                   head: bytes, deadline: float) -> int:
        """The room's header and rows, group by group; the CRC-32 of the source rows."""
        n = len(src)
        run = slot_run(src)
        host = pool.bases is not None  # a host pool (every buffer)
        idx = None if run is not None or not host else np.asarray(src, dtype=np.int64)
        pending = [memoryview(head)]
        crc = 0
        kern = pool.kernel()
        bound = 0.0  # the kernel's timeout on each send, re-set as the deadline nears
        for g in groups(pool.item_bytes, n):
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError
            if left < 0.9 * bound or not bound:
                bound = max(1e-3, left)
                kv_stream.set_timeout(sock, bound)
            if host and run is not None:  # the pool's rows as they lie
                kv_stream.send_views(sock, pending + room_rows.run_views(pool, run, g))
                crc = room_rows.sum_run(pool, run, g, crc, kern)
            elif host:  # gathered (and summed as copied) into this thread's staging buffer
                size = group_bytes(pool, g)
                stage = self._scratch(size)[:size]
                crc = room_rows.gather(pool, idx, g, np.frombuffer(stage, dtype=np.uint8), crc)
                kv_stream.send_views(sock, pending + [stage])
            else:  # a device pool: gathered on its device, copied to the host
                a, b, r0, r1 = g
                rows = [self.rows_of(k, src[r0:r1]) for k in range(a, b)]
                kv_stream.send_views(sock, pending + [memoryview(r).cast("B") for r in rows])
                for r in rows:
                    crc = crc32(memoryview(r), crc)
            pending = []
        if pending:  # a room of no rows: its header alone
            kv_stream.send_views(sock, pending)
        return crc


def _slots(pool: RegisteredPool) -> int:
    """The rows every registered buffer has."""
    if pool.num_slots:
        return pool.num_slots
    return min((int(t.shape[0]) for t in pool.tensors), default=0)
