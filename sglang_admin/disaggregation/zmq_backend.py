"""The pyzmq TCP KV transfer backend: for machines without the mooncake transfer engine.

The receiver (decode) binds a ROUTER socket; a sender (prefill) keeps one DEALER per peer
in each sending thread (a room's transfer is one request and its answer, so a connection
serves the next room once answered; any failure or timeout closes it, and the next room
connects anew) and sends a room as multipart messages: a msgpack header ``{room,
dst_slots, nbuf[, first]}`` (the slots in a room's first message only) then rows of the source slots, buffer-major (every row of buffer
0, then of buffer 1, ..). A room of up to ``GATHER_MAX_BYTES`` goes as ONE message of ONE data
frame, gathered into the sending thread's staging buffer (a frame costs pyzmq and libzmq a
fixed amount on both sides: 60 layer buffers' frames cost a small room more than its
bytes); a larger one as one frame per registered buffer (views of the pool, no gather: its
bytes dominate), in messages of about ``CHUNK_BYTES`` of whole buffers, each header naming
its first buffer, so that the receiver writes one chunk while the next is on the wire (a
multipart message reaches it only once all of it is in). The receiver checks the room is
expected, the slots are the ones it reserved for it, the chunks come in order and the data
has the exact size, writes the rows into its pool, sums the rows it wrote (CRC-32, each
buffer's right after its copy, while they are in cache: decode's `received_checksum` takes
that sum instead of reading the pool again) and answers ``{room, ok, error}`` once, after
the room's last message. Data for a room it does not expect is refused (never written). The
sender sums its source rows (`send_checked`) while libzmq's I/O thread sends them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

from sglang_admin.disaggregation.staging import gather, host_only
from sglang_admin.disaggregation.transfer import (
    KVTransferBackend,
    KVTransferError,
    PeerDescriptor,
    TransferResult,
    byte_rows,
    check_compatible,
    crc32,
    slot_run,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100
#: rooms of up to this many bytes go as one gathered frame (see the module doc); each
#: sending thread keeps a staging buffer of up to this size
GATHER_MAX_BYTES = 2 << 20
#: the TCP send and receive buffers of both ends (the OS's default autotunes from ~128 KiB;
#: a room's megabytes move in fewer, larger writes with these)
SOCK_BUF = 8 << 20
#: a larger room goes as messages of about this many bytes each (whole buffers): the
#: receiver writes and sums one while the next arrives
CHUNK_BYTES = 8 << 20
MAX_PARTIAL_ROOMS = 1024  # chunked rooms part-received at once (a dead sender's are dropped)


@dataclass(eq=False)
class _Chunked:
    """A chunked room part-received: its slots (from its first chunk), the buffer its next
    chunk must start at, the CRC-32 of the rows written so far, the first refusal."""

    dst: list[int]
    next: int = 0
    crc: int | None = 0
    error: str | None = None
    where: Any = None  # the slots as a slice (one run) or an index array, once computed


class ZmqBackend(KVTransferBackend):
    """KV pages over a ZMQ TCP connection (see the module doc)."""

    name = "zmq"

    def __init__(self, host: str = "127.0.0.1", bind_host: str | None = None) -> None:
        super().__init__(host)
        self.bind_host = bind_host or ("0.0.0.0" if host not in ("127.0.0.1", "localhost")
                                       else host)
        self._ctx: zmq.Context | None = None
        self._port = 0
        self._lock = threading.Lock()
        self._expected: dict[int, list[int]] = {}
        self._landed: dict[int, int] = {}  # room -> CRC-32 of the rows written for it
        self._partial: dict[int, list[Any]] = {}  # room -> a chunked room's state so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._local = threading.local()  # a sending thread's DEALER per peer endpoint

    def endpoint(self) -> str:
        if not self._port:
            raise KVTransferError("kv transfer: zmq backend not started")
        return f"{self.host}:{self._port}"

    def start(self) -> None:
        self._ctx = zmq.Context(1)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVBUF, SOCK_BUF)
        sock.setsockopt(zmq.SNDBUF, SOCK_BUF)
        try:
            self._port = sock.bind_to_random_port(f"tcp://{self.bind_host}")
        except zmq.ZMQError as exc:
            sock.close()
            raise KVTransferError(f"kv transfer: zmq backend cannot listen on "
                                  f"{self.bind_host}: {exc}") from None
        self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                        name="kv-zmq-recv")
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # the senders' kept connections too

    # ------------------------------------------------------------------ receiver side
    def expect(self, room: int, dst_slots: Sequence[int]) -> None:
        with self._lock:
            self._expected[room] = list(dst_slots)

    def release(self, room: int) -> None:
        with self._lock:
            self._expected.pop(room, None)
            self._landed.pop(room, None)
            self._partial.pop(room, None)

    def received_checksum(self, room: int, slots: Sequence[int]) -> int:
        """The sum the receiving thread took of the rows it wrote for ``room`` (into these
        slots: the only ones it accepts for the room); the pool's rows summed here when it
        wrote none (a short or refused transfer: they are what the pool holds)."""
        with self._lock:
            landed = self._landed.get(room)
            if landed is not None and self._expected.get(room) == [int(s) for s in slots]:
                return landed
        return self.checksum(slots)

    def _serve(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart(copy=False)
                ident, rest = frames[0], frames[1:]
                room: int | None = None
                try:
                    room, error, last = self._write(rest)
                except Exception as exc:  # noqa: BLE001 - a bad message fails its room only
                    logger.exception("kv transfer receive failed")
                    error, last = (f"kv transfer failed: receiver error {type(exc).__name__}: "
                                   f"{exc}"), True
                    if room is not None:
                        with self._lock:
                            self._partial.pop(room, None)
                if last:  # one answer per room: after its last chunk
                    sock.send_multipart([ident, msgpack.packb(
                        {"room": room, "ok": error is None, "error": error or ""})])
        finally:
            sock.close(linger=0)

    def _write(self, frames: list[Any]) -> tuple[int | None, str | None, bool]:
        """Write one message's rows: (the room, None or why refused, whether it was the
        room's last message: then it is answered)."""
        if not frames:
            return None, "kv transfer failed: empty message", True
        try:
            header = msgpack.unpackb(frames[0].bytes, raw=False)
            room = int(header["room"])
            first = int(header.get("first", 0))
            # the slots come with a room's first (or only) message
            dst = [int(s) for s in header["dst_slots"]] if first == 0 else []
        except Exception:  # noqa: BLE001 - network input
            return None, "kv transfer failed: malformed header", True
        data = frames[1:]
        nbuf = len(self._pool.item_bytes)
        if "first" not in header:  # the whole room in this message
            return room, self._write_rows(room, dst, data), True
        last = first + len(data) >= nbuf
        with self._lock:
            state = self._partial.pop(room, None)
            if first == 0:
                state = _Chunked(dst)
            elif room not in self._expected:  # never expected, or released meanwhile
                state = _Chunked([], error=f"kv transfer failed: unknown room {room} (not "
                                           "expected by decode)")
            elif state is None or state.next != first:
                state = _Chunked([], error=f"kv transfer failed: room {room} chunk at buffer "
                                           f"{first} came out of order (short transfer)")
        if state.error is None:
            state.error = self._write_rows(room, state.dst, data, first, state)
        state.next = first + len(data)
        if not last:
            with self._lock:
                if len(self._partial) >= MAX_PARTIAL_ROOMS:  # senders that died mid-room
                    self._partial.pop(next(iter(self._partial)))
                self._partial[room] = state
        return room, state.error, last

    def _write_rows(self, room: int, dst: list[int], data: list[Any], first: int = 0,
                    chunk: _Chunked | None = None) -> str | None:
        """Write the rows of ``room`` into slots ``dst``: the whole room, or with ``chunk``
        (the room's state so far) buffers ``first``.. of a chunked one; None when done,
        else why refused."""
        import torch

        pool = self._pool
        items = pool.item_bytes
        sizes = [len(f.buffer) for f in data]
        if chunk is not None:
            if not data or first + len(data) > len(items):
                return (f"kv transfer failed: room {room} sent buffers {first}.."
                        f"{first + len(data)} of {len(items)} (short transfer)")
            for k, size in enumerate(sizes, start=first):
                if size != len(dst) * items[k]:
                    return (f"kv transfer failed: room {room} buffer {k} of {size} bytes, "
                            f"expected {len(dst) * items[k]} (short transfer)")
            parts = [np.frombuffer(f.buffer, dtype=np.uint8) for f in data]
        elif len(data) == 1 and len(items) != 1:  # one gathered frame: split it per buffer
            if sizes[0] != len(dst) * sum(items):
                return (f"kv transfer failed: room {room} sent {sizes[0]} bytes, expected "
                        f"{len(dst) * sum(items)} (short transfer)")
            whole = np.frombuffer(data[0].buffer, dtype=np.uint8)
            offs = np.cumsum([0, *(len(dst) * i for i in items)])
            parts = [whole[offs[k]:offs[k + 1]] for k in range(len(items))]
        elif len(data) == len(items):
            for k, (size, item) in enumerate(zip(sizes, items)):
                if size != len(dst) * item:
                    return (f"kv transfer failed: room {room} buffer {k} of {size} bytes, "
                            f"expected {len(dst) * item} (short transfer)")
            parts = [np.frombuffer(f.buffer, dtype=np.uint8) for f in data]
        else:
            return (f"kv transfer failed: room {room} sent {len(data)} data frames, "
                    f"expected 1 or {len(items)} (short transfer)")
        with self._lock:
            want = self._expected.get(room)
            if want is None:
                return f"kv transfer failed: unknown room {room} (not expected by decode)"
            if dst != want:
                return f"kv transfer failed: room {room} slots differ from those reserved"
            self._landed.pop(room, None)
            where = None if chunk is None else chunk.where
            if where is None:  # a run of slots: one block copy, not a scatter
                run = slot_run(dst)
                where = np.asarray(dst, dtype=np.int64) if run is None else run
                if chunk is not None:
                    chunk.where = where
            crc: int | None = 0 if chunk is None else chunk.crc
            if crc is not None and pool.kernel() is not None:  # one call: copies and sum
                blocks = np.array([p.ctypes.data for p in parts], dtype=np.uint64)
                crc = pool.rows_crc(dst, blocks, 0, crc, first, first + len(parts))
                parts = []
            for part, t, rows in zip(parts, pool.tensors[first:], pool.host_rows[first:]):
                src = part.reshape(len(dst), -1)
                if rows is not None:  # numpy alone: no torch op in this thread
                    rows[where] = src
                    if crc is not None:  # what landed, read back from the pool
                        crc = crc32(memoryview(rows[where]), crc)
                else:
                    idx = np.asarray(dst, dtype=np.int64)
                    byte_rows(t).index_copy_(0, torch.as_tensor(idx, device=t.device),
                                             torch.from_numpy(src.copy()).to(t.device))
                    crc = None  # a device pool: summed on decode's "done" instead
            if chunk is not None:
                chunk.crc = crc
                if first + len(parts) < len(items):
                    return None  # more chunks to come: nothing landed for the room yet
            if crc is not None:
                self._landed[room] = crc
        return None

    # ------------------------------------------------------------------ sender side
    def send(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
             dst_slots: Sequence[int], timeout_s: float) -> TransferResult:
        return self._send(room, peer, src_slots, dst_slots, timeout_s, False)

    def send_checked(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
                     dst_slots: Sequence[int], timeout_s: float) -> TransferResult:
        """`send`, the source rows summed while libzmq's I/O thread sends them."""
        return self._send(room, peer, src_slots, dst_slots, timeout_s, True)

    def _send(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
              dst_slots: Sequence[int], timeout_s: float, with_sum: bool) -> TransferResult:
        t0 = time.perf_counter()
        if self._ctx is None or self._closed:
            return TransferResult(False, "kv transfer failed: zmq backend not running")
        if len(src_slots) != len(dst_slots):
            return TransferResult(False, f"kv transfer failed: {len(src_slots)} source slots "
                                         f"for {len(dst_slots)} destination slots")
        why = check_compatible(self.buffer_infos(), peer)
        if why is not None:
            return TransferResult(False, why.replace("kv transfer:", "kv transfer failed:"))
        head = {"room": room, "dst_slots": list(dst_slots), "nbuf": len(self._buffers)}
        self._local.crc = None
        frames = self._data_frames(src_slots)
        checksum: int | None = self._local.crc  # a gathered frame's, taken as it was copied
        nbytes = sum(len(f) for f in frames)
        if len(frames) == 1:
            messages = [[msgpack.packb(head), *frames]]
        else:  # chunks of whole buffers, each message self-describing
            messages, first = [], 0
            while first < len(frames):
                end, size = first, 0
                while end < len(frames) and (end == first or size + len(frames[end])
                                             <= CHUNK_BYTES):
                    size += len(frames[end])
                    end += 1
                chunk_head = {**head, "first": first} if first == 0 else {
                    "room": room, "nbuf": head["nbuf"], "first": first}
                messages.append([msgpack.packb(chunk_head), *frames[first:end]])
                first = end
        kept: dict[str, zmq.Socket] = self._local.__dict__.setdefault("socks", {})
        sock = kept.pop(peer.endpoint, None)  # back in the dict only once answered
        reply: Any = None
        try:
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDBUF, SOCK_BUF)
                sock.setsockopt(zmq.RCVBUF, SOCK_BUF)
                sock.connect(f"tcp://{peer.endpoint}")
            for parts in messages:
                sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)  # never waits
            if with_sum and checksum is None:
                checksum = self.checksum(src_slots)  # while it goes
            left = timeout_s - (time.perf_counter() - t0)
            if not sock.poll(max(1, int(left * 1000))):
                return TransferResult(False, f"kv transfer failed: no answer from decode at "
                                             f"{peer.endpoint} within {timeout_s:g}s "
                                             "(peer dead?)", nbytes, time.perf_counter() - t0)
            reply = msgpack.unpackb(sock.recv(), raw=False)
        except (zmq.ZMQError, ValueError, TypeError) as exc:
            return TransferResult(False, f"kv transfer failed: {exc}", nbytes,
                                  time.perf_counter() - t0)
        finally:
            if isinstance(reply, dict) and reply.get("room") == room:
                kept[peer.endpoint] = sock  # answered: the next room may use it
            else:
                if sock is not None:
                    sock.close(linger=0)
                # unanswered: libzmq may still hold the staged frame; the next room stages
                # into a new buffer
                self._local.staging = None
        if not isinstance(reply, dict) or reply.get("room") not in (room, None):
            return TransferResult(False, f"kv transfer failed: decode at {peer.endpoint} "
                                         f"answered {reply!r:.200} for room {room}", nbytes,
                                  time.perf_counter() - t0)
        if not reply.get("ok"):
            return TransferResult(False, str(reply.get("error")) or "kv transfer failed",
                                  nbytes, time.perf_counter() - t0)
        return TransferResult(True, "", nbytes, time.perf_counter() - t0,
                              checksum=checksum if with_sum else None)

    def _data_frames(self, src_slots: Sequence[int]) -> list[memoryview]:
        """The rows of ``src_slots`` as the message's data frames (see the module doc).

        The gathered frame lives in this thread's staging buffer, reused by its next room:
        the message is answered only once all of it arrived, so libzmq is done with it (an
        unanswered one drops the buffer instead)."""
        pool = self._pool
        n = len(src_slots)
        total = n * sum(pool.item_bytes)
        if total > GATHER_MAX_BYTES or len(pool.tensors) == 1:
            return [memoryview(rows).cast("B") for rows in self.each_rows(src_slots)]
        staging = getattr(self._local, "staging", None)
        if staging is None or staging.nbytes < total:
            staging = self._local.staging = np.empty(max(total, 1 << 20), dtype=np.uint8)
        if host_only(pool):  # one copy, summed as it goes (the kv_rows kernel)
            self._local.crc = gather(pool, src_slots, staging[:total])
            return [memoryview(staging[:total])]
        run = slot_run(src_slots)
        idx = None if run is not None else np.asarray(src_slots, dtype=np.int64)
        off = 0
        for i, (rows, item) in enumerate(zip(pool.host_rows, pool.item_bytes)):
            out = staging[off:off + n * item].reshape(n, item)
            if rows is None:  # a device pool: gathered on its device
                out[...] = self.rows_of(i, src_slots)
            elif run is not None:  # numpy alone: no torch op in a sending thread
                out[...] = rows[run]
            else:
                np.take(rows, idx, axis=0, out=out)
            off += n * item
        return [memoryview(staging[:total])]
