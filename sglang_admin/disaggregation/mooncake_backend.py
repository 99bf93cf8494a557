"""The `mooncake` KV transfer backend: one-sided writes with the Mooncake transfer engine.

The prefill side writes a room's KV rows straight into the decode worker's registered pool
(the engine's batch writes, as SGLang's mooncake connector does); the decode side only
registers its pool and advertises its session id ("host:rpc_port"). Engines find each other
without a metadata server ("P2PHANDSHAKE"): the first write to a session opens it with a
handshake on that rpc port, and the engine caches the connection. Each write entry goes as
its own asynchronous batch, polled with short sleeps (disaggregation/mooncake_writes.py): the binding's synchronous
batch write polls in a loop that never sleeps, which on a small machine took a core from the
engine's I/O threads for the whole write, and its one-batch status check reads a batch's
first entry only (so one entry per batch). The writes run on a writer thread, to keep the
caller's deadline through a peer's first handshake.

Protocol: "tcp" (any machine; needs the system library libibverbs.so.1 all the same, since
the engine loads it) or "rdma" (an InfiniBand/RoCE cluster; the NIC from `ib_device`, or
all NICs when empty). Chosen by the constructor's arguments, else the environment:
SGLANG_ADMIN_MOONCAKE_PROTOCOL (tcp|rdma) and SGLANG_ADMIN_MOONCAKE_IB_DEVICE (comma
separated NIC names; setting it alone selects rdma, as SGLang's --disaggregation-ib-device).

A small room (up to ``STAGE_MAX_BYTES``, host pools) is staged (disaggregation/staging.py):
at `expect` the receiver sets a region of its registered staging area aside for the room and
advertises it in the room's descriptor; the sender gathers the rows of every buffer into a
region of its own registered staging area and writes that block with a few write entries
(``STAGE_ENTRIES``, one per engine connection), and the receiver scatters it into the room's
slots at `land` (on prefill's "done", before the checksum). The engine costs a fixed amount
per write entry, which for the 60 layer buffers of a small room was most of its transfer; a
larger room's bytes dominate, and it is written straight from pool to pool, one entry per
buffer and run of slots. (A sender whose staging area is full writes the rows straight into
the peer's staging region instead: a staged room always lands from there.)

The receiver's engine checks every remote-supplied address against its registered buffers
and rejects a write outside them; this backend also checks slot numbers against both sides'
buffer sizes before it writes, so a bad handshake fails that room alone with a
"kv transfer failed" message.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from sglang_admin.disaggregation.mooncake_writes import bounded, write_entries
from sglang_admin.disaggregation.staging import StagingArea, gather, host_only, scatter
from sglang_admin.disaggregation.transfer import (
    BufferInfo,
    KVTransferBackend,
    KVTransferError,
    PeerDescriptor,
    TransferResult,
    check_compatible,
)

logger = logging.getLogger(__name__)

PROTOCOL_ENV = "SGLANG_ADMIN_MOONCAKE_PROTOCOL"
IB_DEVICE_ENV = "SGLANG_ADMIN_MOONCAKE_IB_DEVICE"
PROTOCOLS = ("tcp", "rdma")
INSTALL_HINT = ("install it with `pip install 'sglang-admin[pd]'` (mooncake-transfer-engine-"
                "non-cuda) and the system library libibverbs1 (`make ibverbs`)")

#: rooms of up to this many bytes are staged (see the module doc): measured on loopback,
#: a 1.5 MB room (32 tokens of SmolLM2-135M float32) gains, 2.9 MB ones and up lose (the
#: gather and scatter cost more than the entries they save)
STAGE_MAX_BYTES = 2 << 20
RX_STAGING_BYTES = 32 << 20  # the receiver's staging area: rooms expected at once
TX_STAGING_BYTES = 8 << 20  # the sender's: rooms being sent at once
STAGE_ENTRIES = 4  # a staged block's entries at most: the engine's TCP connections per peer
STAGE_MIN_ENTRY_BYTES = 256 << 10


def _split(src: int, dst: int, nbytes: int) -> tuple[list[int], list[int], list[int]]:
    """A block's write entries: ``STAGE_ENTRIES`` parts of it at most (the engine moves
    each entry over one of its connections to the peer, in chunks, one at a time)."""
    parts = max(1, min(STAGE_ENTRIES, nbytes // STAGE_MIN_ENTRY_BYTES))
    step = -(-nbytes // parts)
    offs = range(0, nbytes, step)
    return ([src + o for o in offs], [dst + o for o in offs],
            [min(step, nbytes - o) for o in offs])


def _resolve_protocol(protocol: str | None, ib_device: str | None) -> tuple[str, str]:
    device = ib_device if ib_device is not None else os.environ.get(IB_DEVICE_ENV, "")
    proto = protocol or os.environ.get(PROTOCOL_ENV, "") or ("rdma" if device else "tcp")
    proto = proto.strip().lower()
    if proto not in PROTOCOLS:
        raise KVTransferError(f"kv transfer: mooncake protocol {proto!r} is not one of "
                              f"{', '.join(PROTOCOLS)}")
    return proto, device.strip()


def coalesce(src_slots: Sequence[int], dst_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs where both slot lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_slots, dst_slots):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((int(s), int(d), 1))
    return runs


def _rdma_nics(engine: Any, ib_device: str) -> list[str]:
    """The RDMA NICs in the engine's topology ({"cpu:0": [[preferred], [available]], ...})."""
    try:
        topo = json.loads(engine.get_local_topology(ib_device))
        return sorted({nic for lists in topo.values() for group in lists for nic in group})
    except (ValueError, TypeError, AttributeError):
        return []


def _non_cuda_build() -> bool:
    """The installed engine is mooncake-transfer-engine-non-cuda (it cannot read GPU memory)."""
    from importlib import metadata

    try:
        metadata.version("mooncake-transfer-engine")
        return False
    except metadata.PackageNotFoundError:
        return True


def _check_slots(slots: Sequence[int], num_slots: int, side: str) -> str | None:
    if len(slots) and not (min(slots) >= 0 and max(slots) < num_slots):
        bad = next(int(s) for s in slots if not 0 <= s < num_slots)
        return (f"kv transfer failed: {side} slot {bad} is outside its pool of "
                f"{num_slots} slots")
    return None


class MooncakeBackend(KVTransferBackend):
    """KV transfer through the Mooncake transfer engine (TCP here, RDMA on a cluster)."""

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str | None = None,
                 ib_device: str | None = None) -> None:
        super().__init__(host)
        self.protocol, self.ib_device = _resolve_protocol(protocol, ib_device)
        self._engine: Any = None
        self._session_id = ""
        self._registered: list[int] = []  # pointers registered with the engine
        self._lock = threading.Lock()  # start/close/register against each other
        self._closed = False
        self.rdma_nics: list[str] = []  # with protocol rdma: the NICs the engine found
        self._rx = StagingArea(RX_STAGING_BYTES)  # regions of expected rooms
        self._tx = StagingArea(TX_STAGING_BYTES)  # regions of rooms being sent
        self._staged: dict[int, list[int]] = {}  # room -> its slots, staged rooms only

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Initialise the engine (P2P handshake, no metadata server) and register the pool."""
        with self._lock:
            if self._closed:
                raise KVTransferError("kv transfer: the mooncake backend is closed")
            if self._engine is not None:
                return
            os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines: per connection
            try:
                from mooncake.engine import TransferEngine
            except ImportError as exc:
                raise KVTransferError(f"kv transfer backend 'mooncake' is not available "
                                      f"({exc}); {INSTALL_HINT}") from None
            engine = TransferEngine()
            rc = engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, self.ib_device)
            if rc != 0:
                raise KVTransferError(
                    f"kv transfer: mooncake engine failed to start on {self.host} with "
                    f"protocol {self.protocol}" + (f" device {self.ib_device}"
                                                   if self.ib_device else "") + f" (rc {rc})")
            self._engine = engine
            if self.protocol == "rdma":
                self.rdma_nics = _rdma_nics(engine, self.ib_device)
                if not self.rdma_nics:
                    logger.warning("mooncake: protocol rdma, but the engine found no RDMA NIC%s; "
                                   "its writes take its fallback transport (TCP)",
                                   f" among {self.ib_device}" if self.ib_device else "")
            host = f"[{self.host}]" if ":" in self.host else self.host
            self._session_id = f"{host}:{engine.get_rpc_port()}"
            try:
                self._register_locked()
            except KVTransferError:
                self._engine, self._session_id = None, ""
                raise

    def register_buffers(self, buffers: Sequence[Any]) -> None:
        """Take the pool's tensors; after `start`, swap the engine's registrations too."""
        super().register_buffers(buffers)
        with self._lock:
            if self._engine is not None:
                self._register_locked()

    def _register_locked(self) -> None:
        if any(t.device.type != "cpu" for t in self._buffers) and _non_cuda_build():
            raise KVTransferError(
                "kv transfer: the KV pool is in GPU memory and the installed mooncake engine "
                "is the non-CUDA build (host memory only); install mooncake-transfer-engine "
                "(the CUDA build) or use --disaggregation-transfer-backend zmq")
        for ptr in self._registered:
            self._engine.unregister_memory(ptr)
        self._registered = []
        for info in self.buffer_infos():
            if info.nbytes == 0:
                continue
            rc = self._engine.register_memory(info.ptr, info.nbytes)
            if rc != 0:
                raise KVTransferError(f"kv transfer: mooncake could not register a KV buffer "
                                      f"of {info.nbytes} bytes (rc {rc})")
            self._registered.append(info.ptr)
        for area in (self._rx, self._tx):
            rc = self._engine.register_memory(area.ptr, area.nbytes)
            if rc != 0:
                raise KVTransferError(f"kv transfer: mooncake could not register its staging "
                                      f"area of {area.nbytes} bytes (rc {rc})")
            self._registered.append(area.ptr)

    def endpoint(self) -> str:
        """The mooncake session id peers write to: "host:rpc_port"."""
        if not self._session_id:
            raise KVTransferError("kv transfer: the mooncake backend is not started")
        return self._session_id

    def close(self) -> None:
        """Unregister the pool and drop the engine (its threads end with it). Idempotent."""
        with self._lock:
            self._closed = True
            engine, self._engine = self._engine, None
            if engine is not None:
                for ptr in self._registered:
                    engine.unregister_memory(ptr)
            self._registered = []

    # ------------------------------------------------------------------ receiver side
    def expect(self, room: int, dst_slots: Sequence[int]) -> None:
        """A small room on a host pool gets a staging region (when one is free)."""
        self.release(room)
        pool = self._pool
        nbytes = len(dst_slots) * sum(pool.item_bytes)
        if (0 < nbytes <= STAGE_MAX_BYTES and host_only(pool)
                and self._rx.take(room, nbytes) is not None):
            self._staged[room] = [int(s) for s in dst_slots]

    def descriptor(self, room: int | None = None) -> PeerDescriptor:
        """The pool's buffers; for a staged room, its staging region too."""
        region = self._rx.region(room) if room in self._staged else None
        staging = None if region is None else (self._rx.ptr + region[0], region[1])
        return PeerDescriptor(self.endpoint(), self.buffer_infos(), staging)

    def land(self, room: int) -> None:
        """A staged room's block, scattered into its slots."""
        self._land(room)

    def _land(self, room: int) -> int | None:
        """`land`: the CRC-32 of the slots' rows as the scatter left them, None when the
        room was not staged."""
        slots = self._staged.get(room)
        region = self._rx.region(room) if slots is not None else None
        if slots is not None and region is not None:
            pool = self._pool
            if region[1] == len(slots) * sum(pool.item_bytes) and host_only(pool):
                return scatter(pool, slots, self._rx.view(*region))
        return None

    def received_checksum(self, room: int, slots: Sequence[int]) -> int:
        """A staged room: the scatter's sum of the rows it wrote (into the slots reserved
        for the room: these, else the pool's rows are summed); else the pool's rows'."""
        crc = self._land(room)
        if crc is not None and self._staged.get(room) == [int(s) for s in slots]:
            return crc
        return self.checksum(slots)

    def release(self, room: int) -> None:
        """The room's staging region is free again."""
        self._staged.pop(room, None)
        self._rx.give(room)

    # ------------------------------------------------------------------ sender side
    def send(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
             dst_slots: Sequence[int], timeout_s: float) -> TransferResult:
        """Write `src_slots` of every buffer into the peer's `dst_slots`; wait up to
        `timeout_s`. A failure comes back as TransferResult(ok=False), never raised."""
        return self._send(room, peer, src_slots, dst_slots, timeout_s, False)

    def send_checked(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
                     dst_slots: Sequence[int], timeout_s: float) -> TransferResult:
        """`send`, the source rows summed while the engine's writer thread writes them."""
        return self._send(room, peer, src_slots, dst_slots, timeout_s, True)

    def _send(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
              dst_slots: Sequence[int], timeout_s: float, with_sum: bool) -> TransferResult:
        t0 = time.perf_counter()

        def fail(msg: str) -> TransferResult:
            return TransferResult(False, f"{msg} (room {room}, peer {peer.endpoint})",
                                  seconds=time.perf_counter() - t0)

        engine = self._engine
        if engine is None:
            return fail("kv transfer failed: the mooncake backend is not started")
        try:  # slot lists can come from a peer: integers only
            src_slots = [operator.index(s) for s in src_slots]
            dst_slots = [operator.index(s) for s in dst_slots]
        except TypeError:
            return fail("kv transfer failed: slot numbers must be integers")
        if len(src_slots) != len(dst_slots):
            return fail(f"kv transfer failed: {len(src_slots)} source slots for "
                        f"{len(dst_slots)} destination slots")
        if len(set(dst_slots)) != len(dst_slots):  # the writes of one batch run in parallel
            return fail("kv transfer failed: a destination slot is listed twice")
        pool = self._pool  # one registration throughout
        local = pool.infos
        why = check_compatible(local, peer)
        if why:
            return fail(why.replace("kv transfer:", "kv transfer failed:", 1))
        why = self._check_ranges(local, peer.buffers, src_slots, dst_slots)
        if why:
            return fail(why)
        total = len(src_slots) * sum(pool.item_bytes)
        if peer.staging is not None and peer.staging[1] != total:
            return fail(f"kv transfer failed: the peer's staging region holds "
                        f"{peer.staging[1]} bytes, the room's rows are {total}")
        key: object | None = None
        summed: list[int] = []  # the source rows' CRC-32, when asked for
        if peer.staging is None:  # pool to pool: one entry per buffer and run of slots
            srcs, dsts, lens, runs = self._entries(local, peer, src_slots, dst_slots)
        elif host_only(pool) and (off := self._tx.take(key := object(), total)) is not None:
            crc = gather(pool, src_slots, self._tx.view(off, total))  # one block, summed
            if with_sum:
                summed.append(crc)
            srcs, dsts, lens = _split(self._tx.ptr + off, peer.staging[0], total)
            runs = 1
        else:  # no local staging free: the rows straight into the peer's staging region
            key = None
            srcs, dsts, lens, runs = self._entries(local, peer, src_slots,
                                                   list(range(len(src_slots))))
        nbytes = sum(lens)
        sum_rows = ((lambda: summed.append(self.checksum(src_slots))) if with_sum
                    and not summed else (lambda: None))
        if nbytes == 0:
            sum_rows()
            return TransferResult(True, nbytes=0, seconds=time.perf_counter() - t0,
                                  checksum=summed[0] if summed else None)
        left = max(0.0, timeout_s - (time.perf_counter() - t0))
        rc = bounded(lambda: write_entries(engine, peer.endpoint, srcs, dsts, lens, left),
                     left, sum_rows)
        secs = time.perf_counter() - t0
        if key is not None and rc is not None:  # a write given up on may still read it
            self._tx.give(key)
        if rc is None:
            return fail(f"kv transfer failed: timed out after {secs:.1f} s writing {nbytes} "
                        "bytes (decode worker stalled or the link is too slow)")
        if rc != 0:
            return fail(f"kv transfer failed: mooncake write of {nbytes} bytes was refused "
                        f"or broke off (rc {rc}: decode worker dead or unreachable, or "
                        "addresses outside its registered pool)")
        return TransferResult(True, nbytes=nbytes, seconds=secs,
                              extra={"runs": runs, "entries": len(lens),
                                     "staged": peer.staging is not None,
                                     "protocol": self.protocol},
                              checksum=summed[0] if summed else None)

    @staticmethod
    def _entries(local: tuple[BufferInfo, ...], peer: PeerDescriptor, src_slots: list[int],
                 dst_slots: list[int]) -> tuple[list[int], list[int], list[int], int]:
        """Write entries (sources, destinations, lengths, runs) of the rows, one per buffer
        and run of slots: into the peer's pool, or, where the peer staged the room, into
        its staging region at the block's layout (``dst_slots`` = row numbers there)."""
        srcs, dsts, lens = [], [], []
        runs = coalesce(src_slots, dst_slots)
        block = 0
        for mine, theirs in zip(local, peer.buffers):
            item = mine.item_bytes
            base = theirs.ptr if peer.staging is None else peer.staging[0] + block
            for s, d, n in runs:
                srcs.append(mine.ptr + s * item)
                dsts.append(base + d * item)
                lens.append(n * item)
            block += len(src_slots) * item
        return srcs, dsts, lens, len(runs)

    @staticmethod
    def _check_ranges(local: tuple[BufferInfo, ...], remote: tuple[BufferInfo, ...],
                      src_slots: Sequence[int], dst_slots: Sequence[int]) -> str | None:
        if not local:
            return "kv transfer failed: no KV buffers are registered"
        if any(b.item_bytes <= 0 for b in (*local, *remote)):
            return "kv transfer failed: a KV buffer has an item size of 0"
        n_local = min(b.nbytes // b.item_bytes for b in local)
        n_remote = min(b.nbytes // b.item_bytes for b in remote)
        return (_check_slots(src_slots, n_local, "source")
                or _check_slots(dst_slots, n_remote, "destination"))
