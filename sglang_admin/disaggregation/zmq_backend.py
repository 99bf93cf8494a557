"""The pyzmq TCP KV transfer backend: for machines without the mooncake transfer engine.

The receiver (decode) binds a ROUTER socket; a sender (prefill) connects a DEALER per room
and sends one multipart message: a msgpack header ``{room, dst_slots, nbuf}`` then one frame
per registered buffer with the rows of the source slots. The receiver checks the room is
expected, the slots are the ones it reserved for it and every frame has the exact size,
writes the rows into its pool and answers ``{ok, error}``. Data for a room it does not
expect is refused (never written).
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
    check_compatible,
    slot_run,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100


def _rows(t: Any) -> Any:
    """A registered tensor as bytes rows [num_slots, item_bytes] (a view)."""
    import torch

    return t.view(torch.uint8).reshape(t.shape[0], -1)


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
            self._ctx.term()

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
                try:
                    error = self._write(rest)
                except Exception as exc:  # noqa: BLE001 - a bad message fails its room only
                    logger.exception("kv transfer receive failed")
                    error = f"kv transfer failed: receiver error {type(exc).__name__}: {exc}"
                sock.send_multipart([ident, msgpack.packb({"ok": error is None,
                                                           "error": error or ""})])
        finally:
            sock.close(linger=0)

    def _write(self, frames: list[Any]) -> str | None:
        """Write one room's rows; None when done, else why refused."""
        import torch

        if not frames:
            return "kv transfer failed: empty message"
        try:
            header = msgpack.unpackb(frames[0].bytes, raw=False)
            room = int(header["room"])
            dst = [int(s) for s in header["dst_slots"]]
        except Exception:  # noqa: BLE001 - network input
            return "kv transfer failed: malformed header"
        data = frames[1:]
        if len(data) != len(self._buffers):
            return (f"kv transfer failed: room {room} sent {len(data)} buffers, "
                    f"expected {len(self._buffers)} (short transfer)")
        with self._lock:
            want = self._expected.get(room)
            if want is None:
                return f"kv transfer failed: unknown room {room} (not expected by decode)"
            if dst != want:
                return f"kv transfer failed: room {room} slots differ from those reserved"
            for frame, t in zip(data, self._buffers):
                item = t.numel() * t.element_size() // t.shape[0]
                if len(frame.buffer) != len(dst) * item:
                    return (f"kv transfer failed: room {room} buffer of {len(frame.buffer)} "
                            f"bytes, expected {len(dst) * item} (short transfer)")
            run = slot_run(dst)  # a run of slots: one block copy, not a scatter
            idx = np.asarray(dst, dtype=np.int64)
            for frame, t in zip(data, self._buffers):
                src = np.frombuffer(frame.buffer, dtype=np.uint8).reshape(len(dst), -1)
                if t.device.type == "cpu":  # numpy alone: no torch op in this thread
                    _rows(t).numpy()[idx if run is None else run] = src
                else:
                    _rows(t).index_copy_(0, torch.as_tensor(idx, device=t.device),
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
        nbytes = 0
        for i in range(len(self._buffers)):
            rows = self.rows_of(i, src_slots)
            nbytes += rows.nbytes
            parts.append(memoryview(rows))
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{peer.endpoint}")
            sock.send_multipart(parts, copy=False)
            if not sock.poll(int(timeout_s * 1000)):
                return TransferResult(False, f"kv transfer failed: no answer from decode at "
                                             f"{peer.endpoint} within {timeout_s:g}s "
                                             "(peer dead?)", nbytes, time.perf_counter() - t0)
            reply = msgpack.unpackb(sock.recv(), raw=False)
        except (zmq.ZMQError, ValueError, TypeError) as exc:
            return TransferResult(False, f"kv transfer failed: {exc}", nbytes,
                                  time.perf_counter() - t0)
        finally:
            sock.close(linger=0)
        if not isinstance(reply, dict) or not reply.get("ok"):
            error = reply.get("error") if isinstance(reply, dict) else "bad reply"
            return TransferResult(False, str(error) or "kv transfer failed", nbytes,
                                  time.perf_counter() - t0)
        return TransferResult(True, "", nbytes, time.perf_counter() - t0)
