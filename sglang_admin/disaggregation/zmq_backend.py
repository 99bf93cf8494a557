"""The pyzmq TCP KV transfer backend: for machines without the mooncake transfer engine.

The receiver (decode) binds a ROUTER socket; a sender (prefill) keeps one DEALER per peer
in each sending thread (a room's transfer is one request and its answer, so a connection
serves the next room once answered; any failure or timeout closes it, and the next room
connects anew) and sends one multipart message: a msgpack header ``{room, dst_slots, nbuf}``
then the rows of the source slots, buffer-major (every row of buffer 0, then of buffer 1, ..).
A room of up to ``GATHER_MAX_BYTES`` goes as ONE data frame, gathered into the sending
thread's staging buffer (a frame costs pyzmq and libzmq a fixed amount on both sides: 60
layer buffers' frames cost a small room more than its bytes); a larger one as one frame per
registered buffer (views of the pool, no gather: its bytes dominate). The receiver checks the
room is expected, the slots are the ones it reserved for it and the data has the exact size
(one frame of every buffer's rows, or one frame per buffer of its rows), writes the rows into
its pool and answers ``{room, ok, error}``. Data for a room it does not expect is refused
(never written).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from sglang_admin.disaggregation.transfer import (
    KVTransferBackend,
    KVTransferError,
    PeerDescriptor,
    TransferResult,
    byte_rows,
    check_compatible,
    slot_run,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100
#: rooms of up to this many bytes go as one gathered frame (see the module doc); each
#: sending thread keeps a staging buffer of up to this size
GATHER_MAX_BYTES = 16 << 20


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
                    room, error = self._write(rest)
                except Exception as exc:  # noqa: BLE001 - a bad message fails its room only
                    logger.exception("kv transfer receive failed")
                    error = f"kv transfer failed: receiver error {type(exc).__name__}: {exc}"
                sock.send_multipart([ident, msgpack.packb({"room": room, "ok": error is None,
                                                           "error": error or ""})])
        finally:
            sock.close(linger=0)

    def _write(self, frames: list[Any]) -> tuple[int | None, str | None]:
        """Write one room's rows: (the room, None when done, else why refused)."""
        if not frames:
            return None, "kv transfer failed: empty message"
        try:
            header = msgpack.unpackb(frames[0].bytes, raw=False)
            room = int(header["room"])
            dst = [int(s) for s in header["dst_slots"]]
        except Exception:  # noqa: BLE001 - network input
            return None, "kv transfer failed: malformed header"
        return room, self._write_rows(room, dst, frames[1:])

    def _write_rows(self, room: int, dst: list[int], data: list[Any]) -> str | None:
        """Write the rows of ``room`` into slots ``dst``; None when done, else why refused."""
        import torch

        pool = self._pool
        items = pool.item_bytes
        sizes = [len(f.buffer) for f in data]
        if len(data) == 1 and len(items) != 1:  # one gathered frame: split it per buffer
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
            run = slot_run(dst)  # a run of slots: one block copy, not a scatter
            idx = np.asarray(dst, dtype=np.int64)
            for part, t, rows in zip(parts, pool.tensors, pool.host_rows):
                src = part.reshape(len(dst), -1)
                if rows is not None:  # numpy alone: no torch op in this thread
                    rows[idx if run is None else run] = src
                else:
                    byte_rows(t).index_copy_(0, torch.as_tensor(idx, device=t.device),
                                             torch.from_numpy(src.copy()).to(t.device))
        return None

    # ------------------------------------------------------------------ sender side
    def send(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
             dst_slots: Sequence[int], timeout_s: float) -> TransferResult:

        t0 = time.perf_counter()
        if self._ctx is None or self._closed:
            return TransferResult(False, "kv transfer failed: zmq backend not running")
        if len(src_slots) != len(dst_slots):
            return TransferResult(False, f"kv transfer failed: {len(src_slots)} source slots "
                                         f"for {len(dst_slots)} destination slots")
        why = check_compatible(self.buffer_infos(), peer)
        if why is not None:
            return TransferResult(False, why.replace("kv transfer:", "kv transfer failed:"))
        parts: list[Any] = [msgpack.packb({"room": room, "dst_slots": list(dst_slots),
                                           "nbuf": len(self._buffers)})]
        parts += self._data_frames(src_slots)
        nbytes = sum(len(p) for p in parts[1:])
        kept: dict[str, zmq.Socket] = self._local.__dict__.setdefault("socks", {})
        sock = kept.pop(peer.endpoint, None)  # back in the dict only once answered
        reply: Any = None
        try:
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://{peer.endpoint}")
            sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)  # never waits
            if not sock.poll(int(timeout_s * 1000)):
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
        return TransferResult(True, "", nbytes, time.perf_counter() - t0)

    def _data_frames(self, src_slots: Sequence[int]) -> list[memoryview]:
        """The rows of ``src_slots`` as the message's data frames (see the module doc).

        The gathered frame lives in this thread's staging buffer, reused by its next room:
        the message is answered only once all of it arrived, so libzmq is done with it (an
        unanswered one drops the buffer instead)."""
        pool = self._pool
        n = len(src_slots)
        total = n * sum(pool.item_bytes)
        if total > GATHER_MAX_BYTES or len(pool.tensors) == 1:
            return [memoryview(self.rows_of(i, src_slots)).cast("B")
                    for i in range(len(pool.tensors))]
        staging = getattr(self._local, "staging", None)
        if staging is None or staging.nbytes < total:
            staging = self._local.staging = np.empty(max(total, 1 << 20), dtype=np.uint8)
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
