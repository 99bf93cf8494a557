"""A receiving mooncake KV backend in a process of its own, driven over its stdin: the peer
of the mooncake backend's tests (tests/unit/test_pd_mooncake.py). Test code only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sglang_admin.disaggregation.transfer import PeerDescriptor

ROOT = Path(__file__).resolve().parents[1]

NUM_SLOTS, LAYERS = 64, 3
ROW = (2, 8)  # one slot: 2 heads x 8 dims, float32 -> 64 bytes per buffer row

# The receiving worker: registers a zeroed pool, prints its descriptor, then answers
# JSON commands on stdin ("read" slots -> hex of read_slots; "realloc" -> new pool).
PEER = r"""
import json, sys, torch
from sglang_admin.disaggregation.mooncake_backend import MooncakeBackend
slots, layers, row = json.loads(sys.argv[1])
def pool():
    return [torch.zeros(slots, *row) for _ in range(2 * layers)]
b = MooncakeBackend("127.0.0.1")
b.register_buffers(pool())
b.start()
print(json.dumps(b.descriptor().to_wire()), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "read":
        print(json.dumps(b.read_slots(cmd["slots"]).hex()), flush=True)
    elif cmd["op"] == "zero":
        for t in b._buffers:
            t.zero_()
        print("{}", flush=True)
    elif cmd["op"] == "expect":  # as decode: the room's descriptor for the handshake
        b.expect(cmd["room"], cmd["slots"])
        print(json.dumps(b.descriptor(cmd["room"]).to_wire()), flush=True)
    elif cmd["op"] in ("land", "release"):
        getattr(b, cmd["op"])(cmd["room"])
        print("{}", flush=True)
    elif cmd["op"] == "realloc":
        b.register_buffers(pool())
        print(json.dumps(b.descriptor().to_wire()), flush=True)
"""


class Peer:
    """A receiving backend in its own process."""

    def __init__(self, slots: int = NUM_SLOTS) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER, json.dumps([slots, LAYERS, list(ROW)])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env, cwd=str(ROOT))
        self.descriptor = self._descriptor()

    def _descriptor(self) -> PeerDescriptor:
        line = self.proc.stdout.readline()
        assert line, f"peer exited with {self.proc.wait(5)}"
        return PeerDescriptor.from_wire(json.loads(line))

    def _ask(self, **cmd) -> str:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline()

    def read(self, slots: list[int]) -> bytes:
        return bytes.fromhex(json.loads(self._ask(op="read", slots=slots)))

    def zero(self) -> None:
        self._ask(op="zero")

    def expect(self, room: int, slots: list[int]) -> PeerDescriptor:
        return PeerDescriptor.from_wire(json.loads(self._ask(op="expect", room=room,
                                                             slots=slots)))

    def land(self, room: int) -> None:
        self._ask(op="land", room=room)

    def release(self, room: int) -> None:
        self._ask(op="release", room=room)

    def realloc(self) -> PeerDescriptor:
        self.proc.stdin.write(json.dumps({"op": "realloc"}) + "\n")
        self.proc.stdin.flush()
        return self._descriptor()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
