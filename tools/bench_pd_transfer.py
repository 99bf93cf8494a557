#!/usr/bin/env python
"""KV transfer throughput of the PD backends against a raw TCP socket moving the same
bytes, side by side in one run, over loopback.

A receiver process (the decode side) holds a KV pool of 2 x LAYERS buffers [slots, row
bytes] and serves every backend at once: the `mooncake` backend (its engine's TCP protocol,
or `--protocol rdma`), the `zmq` backend when its module is importable, and a bare socket.
This process (the prefill side) holds a pool of the same shape and, per round and per
prompt length, moves one request's KV (the first N slots of every buffer into the
receiver's slots, in the same order) with each method in turn:

- a backend: the receiver is told `expect(room, dst)` first and hands over the room's
  descriptor, as decode does at its handshake; then `send_checked(room, descriptor, src,
  dst)` as the prefill worker calls it (the send and the CRC-32 of the source rows that
  prefill tells decode), timed to its return, plus the receiver's
  `received_checksum(room, dst)` (what decode runs on prefill's "done": the scatter of a
  staged room into the pool, e.g. mooncake's small rooms, and the sum of the rows that
  landed), timed in the receiver. That is a served transfer's work on both sides, less the
  control messages; each round's two sums must agree (else the run fails);
- raw: the rows of every buffer (views, no copies) gathered by `sendmsg` over one
  connected TCP socket (8 MiB socket buffers, no Nagle); the receiver `recv_into`s them
  straight into its pool's rows and answers one byte; timed to that byte. One stream on one
  thread per side: what a plain socket moves for these bytes on this link, with no check of
  them (so the backends' integrity check counts against them).

Every method's bytes are also checked once per size by this tool's own zlib CRC-32 of the
receiver's rows against the sender's. Rounds alternate the methods; each figure is the
median GB/s of its rounds (the machine may be shared and noisy), the ratio to raw beside
it. Target: >= 0.7x. The 1-minute load average before and after the run is printed.
With ``--clock cpu`` each round counts instead the CPU seconds both processes spent on it
(every thread: the backends' I/O and engine threads too; ``time.process_time``), so the
figures are GB per CPU-second: what a transfer costs a worker, and far steadier than wall
time on a machine others share.

Usage: python tools/bench_pd_transfer.py [--tokens 256 2048] [--layers 30] [--row-bytes 768]
       [--rounds 5] [--backends mooncake zmq] [--protocol tcp|rdma] [--clock wall|cpu]
       [--json FILE]
Defaults are SmolLM2-135M's float32 KV: 30 layers x (3 KV heads x 64 dims x 4 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sglang_admin.disaggregation.backends import make_backend  # noqa: E402
from sglang_admin.disaggregation.transfer import KVTransferError, PeerDescriptor  # noqa: E402

HOST = "127.0.0.1"


def _pool(slots: int, layers: int, row_bytes: int, fill: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    if fill:
        return [torch.randint(0, 256, (slots, row_bytes), dtype=torch.uint8, generator=gen)
                for _ in range(2 * layers)]
    return [torch.zeros(slots, row_bytes, dtype=torch.uint8) for _ in range(2 * layers)]


def _crc(pool: list[torch.Tensor], slots: list[int]) -> int:
    idx = torch.tensor(slots, dtype=torch.long)
    crc = 0
    for t in pool:
        crc = zlib.crc32(memoryview(t.index_select(0, idx).numpy()), crc)
    return crc


SOCK_BUF = 8 << 20  # raw socket send/receive buffers: the kernel's largest by default


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    while len(view):
        n = conn.recv_into(view)
        if n == 0:
            raise ConnectionError("raw sender closed")
        view = view[n:]


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Every view, gathered by sendmsg (one syscall for as many bytes as the kernel takes)."""
    views = [v for v in views if len(v)]
    while views:
        n = sock.sendmsg(views[:512])
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0


# ---------------------------------------------------------------------------- receiver
def serve(args: argparse.Namespace) -> None:
    """The decode side: backends and a raw socket over one pool; commands on stdin."""
    import threading

    pool = _pool(args.slots, args.layers, args.row_bytes, fill=False)
    backends = {name: b for name in args.backends
                if (b := _start(name, args.protocol, pool)) is not None}
    lsock = socket.create_server((HOST, 0))
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    raw_port = lsock.getsockname()[1]

    def raw_loop() -> None:
        conn, _ = lsock.accept()
        _tune(conn)
        head = bytearray(8)
        while True:
            try:
                _recv_exact(conn, memoryview(head))
            except ConnectionError:
                return
            n = struct.unpack("!Q", head)[0]
            for t in pool:  # the first n slots of every buffer, in place
                _recv_exact(conn, memoryview(t.numpy()[:n]).cast("B"))
            conn.sendall(b"\x01")

    threading.Thread(target=raw_loop, daemon=True).start()
    print(json.dumps({"raw_port": raw_port,
                      "backends": {k: b.descriptor().to_wire() for k, b in backends.items()}}),
          flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "expect":
            b = backends[cmd["backend"]]
            b.expect(cmd["room"], cmd["slots"])
            out = {"descriptor": b.descriptor(cmd["room"]).to_wire()}
            print(json.dumps({**out, "cpu": time.process_time()}), flush=True)
        elif cmd["op"] == "verify":  # decode's work on prefill's "done"
            t0 = time.perf_counter()
            b = backends[cmd["backend"]]
            if hasattr(b, "received_checksum"):
                crc = b.received_checksum(cmd["room"], cmd["slots"])
            else:  # a tree from before received_checksum: what its decode ran
                b.land(cmd["room"])
                crc = b.checksum(cmd["slots"])
            print(json.dumps({"seconds": time.perf_counter() - t0, "crc": crc,
                              "cpu": time.process_time()}), flush=True)
        elif cmd["op"] == "release":
            backends[cmd["backend"]].release(cmd["room"])
            print("{}", flush=True)
        elif cmd["op"] == "crc":
            print(json.dumps({"crc": _crc(pool, cmd["slots"])}), flush=True)
        elif cmd["op"] == "cpu":  # this process's CPU seconds so far, every thread's
            print(json.dumps({"cpu": time.process_time()}), flush=True)
        elif cmd["op"] == "zero":
            for t in pool:
                t.zero_()
            print("{}", flush=True)


# ---------------------------------------------------------------------------- sender
class Receiver:
    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, __file__, "--serve", "--slots", str(args.slots),
               "--layers", str(args.layers), "--row-bytes", str(args.row_bytes),
               "--protocol", args.protocol, "--backends", *args.backends]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=str(ROOT))
        hello = json.loads(self.proc.stdout.readline())
        self.raw_port = hello["raw_port"]
        self.descriptors = {k: PeerDescriptor.from_wire(v)
                            for k, v in hello["backends"].items()}

    def ask(self, **cmd: Any) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048],
                    help="prompt lengths: slots moved per request")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--row-bytes", type=int, default=768,
                    help="bytes of one token in one K or V buffer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["mooncake", "zmq"])
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="wall: seconds to move a request's KV; cpu: CPU seconds both "
                         "processes spent moving it (all threads; steadier on a shared "
                         "machine, and what a transfer takes from a busy worker)")
    ap.add_argument("--json", type=Path, help="write the figures here as well")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--slots", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return
    args.slots = max(args.tokens)
    pool = _pool(args.slots, args.layers, args.row_bytes, fill=True)
    senders = {name: b for name in args.backends
               if (b := _start(name, args.protocol, pool)) is not None}
    args.backends = list(senders)
    rx = Receiver(args)
    raw = socket.socket()
    _tune(raw)
    raw.connect((HOST, rx.raw_port))
    methods = ["raw", *[b for b in args.backends if b in rx.descriptors]]
    room = 1

    def once(method: str, n: int) -> float:
        """One transfer of ``n`` slots' rows: its wall seconds, or with ``--clock cpu``
        the CPU seconds both processes spent on it (every thread of each)."""
        nonlocal room
        room += 1
        slots = list(range(n))
        cpu = args.clock == "cpu"
        if method == "raw":
            rx_cpu = rx.ask(op="cpu")["cpu"] if cpu else 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            _send_all(raw, [memoryview(struct.pack("!Q", n)),
                            *(memoryview(t.numpy()[:n]).cast("B") for t in pool)])
            if raw.recv(1) != b"\x01":
                raise SystemExit("raw receiver failed")
            if cpu:
                return time.process_time() - c0 + rx.ask(op="cpu")["cpu"] - rx_cpu
            return time.perf_counter() - t0
        ready = rx.ask(op="expect", backend=method, room=room, slots=slots)
        desc = PeerDescriptor.from_wire(ready["descriptor"])
        t0, c0 = time.perf_counter(), time.process_time()
        res = _send_checked(senders[method], room, desc, slots)
        took, spent = time.perf_counter() - t0, time.process_time() - c0
        if not res.ok:
            raise SystemExit(f"{method}: {res.error}")
        got = rx.ask(op="verify", backend=method, room=room, slots=slots)
        rx.ask(op="release", backend=method, room=room)
        if got["crc"] != res.checksum:
            raise SystemExit(f"{method}: room {room}'s checksums differ (sent "
                             f"{res.checksum}, landed {got['crc']})")
        if cpu:
            return spent + got["cpu"] - ready["cpu"]
        return took + got["seconds"]

    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()
                                        if k not in ("json", "serve")}, "sizes": {}}
    load0 = os.getloadavg()[0]
    try:  # the rows' copies and sums in one C call per side (a tree that has it)
        from sglang_admin.disaggregation.kv_rows import kernel
        copies = "kv_rows kernel" if kernel() is not None else "numpy (kv_rows not built)"
    except ImportError:
        copies = "numpy"
    results["copies"] = copies
    print(f"# {args.layers} layers x K,V x {args.row_bytes} B/token, methods "
          f"{', '.join(methods)}, {args.rounds} rounds, loopback {HOST}, {args.clock} clock, "
          f"load {load0:.2f}, rows copied and summed by {copies}")
    for n in args.tokens:
        nbytes = n * args.row_bytes * 2 * args.layers
        checked = {}
        for m in methods:  # warm-up (connections, handshakes) and the bytes check
            rx.ask(op="zero")
            once(m, n)
            checked[m] = rx.ask(op="crc", slots=list(range(n)))["crc"] == _crc(pool,
                                                                                list(range(n)))
        times: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for m in methods:
                times[m].append(once(m, n))
        gbs = {m: nbytes / statistics.median(ts) / 1e9 for m, ts in times.items()}
        row = {m: {"gb_s": float(f"{gbs[m]:.4g}"), "ratio": round(gbs[m] / gbs["raw"], 3),
                   "median_ms": round(statistics.median(times[m]) * 1e3, 2),
                   "best_ms": round(min(times[m]) * 1e3, 2), "bytes_checked": checked[m]}
               for m in methods}
        results["sizes"][str(n)] = {"bytes": nbytes, "methods": row}
        print(f"\n{n} tokens = {nbytes / 1e6:.1f} MB per request")
        unit = ("GB/s", "median ms") if args.clock == "wall" else ("GB/cpu-s", "cpu ms")
        print(f"  {'method':<10}{unit[0]:>9}{'x raw':>8}{unit[1]:>11}{'best ms':>9}  bytes")
        for m in methods:
            r = row[m]
            print(f"  {m:<10}{r['gb_s']:>9.2f}{r['ratio']:>7.2f}x{r['median_ms']:>11.2f}"
                  f"{r['best_ms']:>9.2f}  {'ok' if r['bytes_checked'] else 'MISMATCH'}")
    results["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    print(f"\n# 1-min load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after")
    raw.close()
    rx.close()
    for b in senders.values():
        b.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not all(r["bytes_checked"] for s in results["sizes"].values()
               for r in s["methods"].values()):
        raise SystemExit("a transfer's bytes differ from the source")


def _send_checked(backend: Any, room: int, desc: PeerDescriptor, slots: list[int]) -> Any:
    """What prefill's send thread runs for a room: ``send_checked``, or, in a tree from
    before it, ``send`` then ``checksum`` (so one tool times both)."""
    if hasattr(backend, "send_checked"):
        return backend.send_checked(room, desc, slots, slots, 120.0)
    res = backend.send(room, desc, slots, slots, 120.0)
    if res.ok:
        res.checksum = backend.checksum(slots)
    return res


def _start(name: str, protocol: str, pool: list[torch.Tensor]) -> Any:
    """A started backend over `pool`, or None (said on stderr) where it is unavailable."""
    try:
        if name == "mooncake":
            from sglang_admin.disaggregation.mooncake_backend import MooncakeBackend
            b = MooncakeBackend(HOST, protocol=protocol)
        else:
            b = make_backend(name, HOST)
        b.register_buffers(pool)
        b.start()
        return b
    except KVTransferError as exc:
        print(f"# skipping {name}: {exc}", file=sys.stderr)
        return None


if __name__ == "__main__":
    main()
