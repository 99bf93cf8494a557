"""Test-side stand-ins for one leg of a PD pair, driving a real worker's other leg through
the real wire protocol (bootstrap HTTP, control messages, the zmq KV backend's data
connection), so a test can make that leg die, send corrupt or short pages, or answer for a
room nobody asked for; and a stand-in decode receiver (`StalledReceiver`) that takes a
room's pages and holds its answer."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgpack
import torch
import zmq

from sglang_admin.disaggregation import kv_stream
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
        """The room's header and random rows of its buffers ``0..first + count`` on the zmq
        backend's data connection, then the connection closed: part of a room, as a sender
        that dies or stops midway leaves it (decode's receiver wrote the rows of buffers
        ``0..first + count``, the rest never came)."""
        peer = PeerDescriptor.from_wire(hs["peer"])
        dst = hs["dst_slots"]
        nbytes = len(dst) * sum(b.item_bytes for b in peer.buffers)
        rows = [torch.randint(0, 255, (len(dst) * b.item_bytes,), dtype=torch.uint8)
                .numpy().tobytes() for b in peer.buffers[:first + count]]
        host, _, port = peer.endpoint.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(kv_stream.room_header(room, dst, len(peer.buffers), nbytes)
                         + b"".join(rows))  # then closed: the rest of the room never comes

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
    """A decode worker's KV receiver (the zmq backend's wire: a TCP listener) that takes a
    room's pages and holds its answer: prefill's send is in flight until `answer` or
    `die`."""

    def __init__(self, like: PeerDescriptor) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        port = self.listener.getsockname()[1]
        self.descriptor = PeerDescriptor(f"127.0.0.1:{port}", like.buffers).to_wire()
        self.conn: socket.socket | None = None

    def take(self, room: int, timeout_s: float = 30) -> int:
        """Wait for the header and every row of ``room``: their data bytes."""
        self.listener.settimeout(timeout_s)
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(timeout_s)
        head = kv_stream.next_room(self.conn)
        assert head is not None, f"no pages of room {room} came"
        got_room, _dst, _nbuf, nbytes = kv_stream.parse_header(head)
        assert got_room == room, got_room
        left = nbytes
        while left:
            data = self.conn.recv(min(left, 1 << 20))
            assert data, f"room {room}'s sender closed mid-room"
            left -= len(data)
        return nbytes

    def answer(self, room: int) -> None:
        assert self.conn is not None
        self.conn.sendall(kv_stream.answer_bytes(room, None))

    def die(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()
