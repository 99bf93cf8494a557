"""Test-side stand-ins for one leg of a PD pair, driving a real worker's other leg through
the real wire protocol (bootstrap HTTP, control messages, the zmq KV backend), so a test can
make that leg die, send corrupt or short pages, or answer for a room nobody asked for; and a
stand-in decode receiver (`StalledReceiver`) that takes a room's pages and holds its answer."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgpack
import torch
import zmq

from sglang_admin.disaggregation.transfer import PeerDescriptor
from sglang_admin.disaggregation.zmq_backend import ZmqBackend


class FakePrefill:
    """A prefill worker's bootstrap server and rank, in the test process: it receives
    decode's handshakes and sends (or withholds, or corrupts) the pages."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.control = f"127.0.0.1:{port}"
        self.alive = True
        self.closed = False
        self.stall_s = 0.0  # the bootstrap server answers this late (decode stuck in bootstrap)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if fake.stall_s:
                    time.sleep(fake.stall_s)
                    if fake.closed:  # the test is over; so, likely, is the asker
                        self.close_connection = True
                        return
                if not fake.alive:
                    self.send_response(503)
                    self.end_headers()
                    return
                body = json.dumps({"dp_size": 1, "ranks": {"0": fake.control}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True  # a stalled answer does not hold close() up
        self.http.block_on_close = False
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.backend: ZmqBackend | None = None
        self.out: dict[str, zmq.Socket] = {}

    def handshake(self, timeout_s: float = 60) -> dict[str, Any]:
        """The next handshake decode sends (its room, slots, pool and notify address)."""
        assert self.inbox.poll(int(timeout_s * 1000)), "no handshake from decode"
        msg = msgpack.unpackb(self.inbox.recv(), raw=False)
        return msg

    def next_message(self, timeout_s: float) -> dict[str, Any] | None:
        if not self.inbox.poll(int(timeout_s * 1000)):
            return None
        return msgpack.unpackb(self.inbox.recv(), raw=False)

    def pool_like(self, hs: dict[str, Any]) -> ZmqBackend:
        """A sender whose pool has decode's layout, filled with random bytes."""
        peer = PeerDescriptor.from_wire(hs["peer"])
        backend = ZmqBackend()
        slots = max(hs["dst_slots"]) + 1
        backend.register_buffers([torch.randint(0, 255, (slots, b.item_bytes), dtype=torch.uint8)
                                  for b in peer.buffers])
        backend.start()
        self.backend = backend
        return backend

    def send_chunk(self, hs: dict[str, Any], room: int, first: int, count: int) -> None:
        """Buffers ``first``..``first + count`` of a chunked room (as the zmq backend sends a
        large one) into decode's pool, random rows: part of a room, as a sender that dies
        or stops midway leaves it. Sent from a socket of its own, then closed."""
        peer = PeerDescriptor.from_wire(hs["peer"])
        dst = hs["dst_slots"]
        head = msgpack.packb({"room": room, "dst_slots": dst, "nbuf": len(peer.buffers),
                              "first": first})
        rows = [torch.randint(0, 255, (len(dst) * b.item_bytes,), dtype=torch.uint8)
                .numpy().tobytes() for b in peer.buffers[first:first + count]]
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"tcp://{peer.endpoint}")
        sock.send_multipart([head, *rows])
        sock.close()  # lingers until the frames are out, like a process's last writes

    def notify(self, addr: str, msg: dict[str, Any]) -> None:
        sock = self.out.get(addr)
        if sock is None:
            sock = self.out[addr] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{addr}")
        sock.send(msgpack.packb(msg))

    def close(self) -> None:
        self.closed = True
        self.http.shutdown()
        self.http.server_close()
        if self.backend is not None:
            self.backend.close()
        for sock in self.out.values():
            sock.close(linger=0)
        self.inbox.close(linger=0)
        self.ctx.term()


class StalledReceiver:
    """A decode worker's KV receiver (the zmq backend's wire) that takes a room's pages and
    holds its answer: prefill's send is in flight until `answer` or `die`."""

    def __init__(self, like: PeerDescriptor) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.descriptor = PeerDescriptor(f"127.0.0.1:{port}", like.buffers).to_wire()
        self.ident = b""

    def take(self, room: int, timeout_s: float = 30) -> int:
        """Wait for the messages of ``room``: their total data bytes."""
        got = 0
        while True:
            assert self.sock.poll(int(timeout_s * 1000)), f"no pages of room {room} came"
            frames = self.sock.recv_multipart()
            self.ident, head = frames[0], msgpack.unpackb(frames[1], raw=False)
            assert head["room"] == room, head
            got += sum(len(f) for f in frames[2:])
            if head.get("first", 0) + len(frames) - 2 >= head["nbuf"] or "first" not in head:
                return got

    def answer(self, room: int) -> None:
        self.sock.send_multipart([self.ident, msgpack.packb({"room": room, "ok": True,
                                                             "error": ""})])

    def die(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
