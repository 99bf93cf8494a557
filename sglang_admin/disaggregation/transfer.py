"""The KV transfer backend interface: moves one request's KV pages from a prefill worker's
pool into a decode worker's pool, keyed by the request's bootstrap room.

A backend is data plane only. The control plane (disaggregation/ bootstrap + handshake)
tells the sender where to write (the receiver's `descriptor()` and the receiver's slots);
after `send_checked` returns ok the control plane notifies the receiver, with a `checksum`
of the source pages so the receiver verifies the bytes that landed
(`received_checksum`: corrupt or short transfers fail the request, never decode on bad KV).
The checksum is CRC-32 (zlib's polynomial), computed with ISA-L's folding kernel
(python-isal, ~10-18 GB/s here) where it is installed and with zlib's (~1.5-2.5 GB/s)
otherwise: both give the same value, so peers of either kind agree.

Layout contract: `register_buffers` gets the KV pool as a list of tensors, each of shape
[num_slots, ...] and contiguous, one item (= one token slot, page size 1) per row. Both
sides register the same number of buffers with the same item sizes (the control plane
checks the descriptors before any send). Slot lists name rows in every buffer.

Backends are picked by name (`--disaggregation-transfer-backend`) through `BACKENDS`
in disaggregation/backends.py: "mooncake" (the mooncake transfer engine) and "zmq"
(a plain TCP connection per peer; the name is the flag's).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

try:  # the same CRC-32 as zlib's, several times faster (carry-less multiply folding)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - python-isal is a dependency; zlib is its equal
    from zlib import crc32


class KVTransferError(RuntimeError):
    """A transfer could not be set up or failed; the message says why ("kv transfer ..")."""


@dataclass(frozen=True)
class BufferInfo:
    """One registered buffer as the peer sees it: base address, total bytes, bytes per slot."""

    ptr: int
    nbytes: int
    item_bytes: int


@dataclass(frozen=True)
class PeerDescriptor:
    """What a sender needs to write into a receiver: its endpoint and its buffers.

    Sent over the control plane as a msgpack-able dict (`to_wire` / `from_wire`).
    """

    endpoint: str  # backend-specific address, e.g. "10.0.0.2:17001" (zmq, mooncake session)
    buffers: tuple[BufferInfo, ...]
    #: one room's staging region on the receiver (address, bytes), where a backend that
    #: stages small rooms (mooncake) writes every buffer's rows as one block; None: none
    staging: tuple[int, int] | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"endpoint": self.endpoint,
                                "buffers": [[b.ptr, b.nbytes, b.item_bytes]
                                            for b in self.buffers]}
        if self.staging is not None:
            wire["staging"] = list(self.staging)
        return wire

    @staticmethod
    def from_wire(obj: Any) -> PeerDescriptor:
        """Parse a wire dict; raises KVTransferError on a malformed one (network input)."""
        try:
            endpoint = obj["endpoint"]
            bufs = tuple(BufferInfo(int(p), int(n), int(i)) for p, n, i in obj["buffers"])
            staged = obj.get("staging")
            staging = None if staged is None else (int(staged[0]), int(staged[1]))
            if staged is not None and len(staged) != 2:
                raise ValueError("staging is not [address, bytes]")
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise KVTransferError(f"kv transfer: malformed peer descriptor ({exc})") from None
        if not isinstance(endpoint, str) or not endpoint:
            raise KVTransferError("kv transfer: peer descriptor has no endpoint")
        if staging is not None and (staging[0] <= 0 or staging[1] <= 0):
            raise KVTransferError("kv transfer: peer descriptor's staging region is empty")
        return PeerDescriptor(endpoint, bufs, staging)


@dataclass
class TransferResult:
    """Outcome of one room's transfer: ok, or failed with a message naming the cause."""

    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: ``send_checked``: CRC-32 of the source rows (what the receiver must find), when ok
    checksum: int | None = None


class KVTransferBackend(abc.ABC):
    """Moves KV slots between two registered pools. One instance per rank process.

    Thread-safety: `send` may be called from several worker threads at once (one per room);
    `expect`/`release` are called from the scheduler thread. Implementations must be safe
    under that use.
    """

    #: the name used by --disaggregation-transfer-backend
    name: str = ""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._pool = RegisteredPool.of([])

    @property
    def _buffers(self) -> list[Any]:
        """The registered tensors, [num_slots, ...] contiguous."""
        return self._pool.tensors

    # ------------------------------------------------------------------ lifecycle
    def register_buffers(self, buffers: Sequence[Any]) -> None:
        """Register the KV pool (tensors [num_slots, ...], contiguous, same num_slots).

        Called once after the pool is allocated, and again if the pool is reallocated
        (release/resume memory): the new pointers replace the old ones.
        """
        for t in buffers:
            if not t.is_contiguous():
                raise KVTransferError("kv transfer: a registered KV buffer is not contiguous")
        self._pool = RegisteredPool.of(buffers)  # one swap: a sending thread sees either
        self._pool.kernel()  # built (once per machine) and checked now, not on a first room

    def buffer_infos(self) -> tuple[BufferInfo, ...]:
        """The registered buffers as (ptr, nbytes, item_bytes)."""
        return self._pool.infos

    @abc.abstractmethod
    def endpoint(self) -> str:
        """The address a peer's backend reaches this one at (after `start`)."""

    def descriptor(self, room: int | None = None) -> PeerDescriptor:
        """This side as a receiver: endpoint + buffers (sent to the sender at handshake);
        with ``room`` (expected), the staging region a backend set aside for it, if any."""
        return PeerDescriptor(self.endpoint(), self.buffer_infos())

    @abc.abstractmethod
    def start(self) -> None:
        """Open sockets / initialise the engine. Raises KVTransferError when it cannot."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the backend; pending sends fail, later calls are errors. Idempotent."""

    # ------------------------------------------------------------------ receiver side
    def expect(self, room: int, dst_slots: Sequence[int]) -> None:
        """Decode: the pages of `room` may now arrive into `dst_slots` (which it owns).

        Backends that receive actively (zmq) refuse data for a room not expected, or for
        slots other than these; one-sided backends (mooncake) may ignore this.
        """
        return None

    def land(self, room: int) -> None:
        """Decode: prefill reported ``room``'s send done; before its checksum, move what
        the backend staged for it into the room's slots (a backend that stages nothing:
        nothing to do)."""
        return None

    def release(self, room: int) -> None:
        """Decode: stop accepting data for `room` (done, aborted or failed). Idempotent.
        After it returns the backend writes nothing more into that room's slots."""
        return None

    def received_checksum(self, room: int, slots: Sequence[int]) -> int:
        """Decode, on prefill's "done" for ``room``: `land` it, then the CRC-32 of its
        ``slots``' rows as they now are in the pool (compared with the sender's). A backend
        whose receiving thread wrote the rows may have summed them there, right after
        writing them (zmq); the default reads them here."""
        self.land(room)
        return self.checksum(slots)

    # ------------------------------------------------------------------ sender side
    @abc.abstractmethod
    def send(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
             dst_slots: Sequence[int], timeout_s: float) -> TransferResult:
        """Prefill: write the pages in local `src_slots` into the peer's `dst_slots`, every
        registered buffer, blocking until the bytes are in the peer's memory or failed.

        Never raises for a transfer failure: returns TransferResult(ok=False, error=...)
        with an error text containing "kv transfer" (dead peer, refused room, timeout).
        """

    def send_checked(self, room: int, peer: PeerDescriptor, src_slots: Sequence[int],
                     dst_slots: Sequence[int], timeout_s: float) -> TransferResult:
        """`send`, and when it is ok the CRC-32 of the source rows in ``result.checksum``
        (what prefill tells decode). Backends sum the rows while their transfer runs where
        they can (zmq, mooncake); the default sums them after it."""
        result = self.send(room, peer, src_slots, dst_slots, timeout_s)
        if result.ok:
            result.checksum = self.checksum(src_slots)
        return result

    # ------------------------------------------------------------------ verification
    def rows_of(self, index: int, slots: Sequence[int]) -> Any:
        """Buffer ``index``'s rows ``slots`` as a contiguous uint8 numpy array [n, item].

        CPU pools go through numpy alone (no torch op: torch's OpenMP threads, called from a
        transfer thread beside the rank's forward, spin against it); a device pool is
        gathered on its device and copied to the host."""
        return next(self.each_rows(slots, index))

    def each_rows(self, slots: Sequence[int], first: int = 0) -> Iterator[Any]:
        """`rows_of` of buffers ``first``, ``first + 1``, .. in turn, the slot list read
        once (a room's 2048 slots read per buffer cost 60 layer buffers ~10 ms)."""
        import numpy as np
        import torch

        pool = self._pool
        run = slot_run(slots)  # one run of consecutive slots: views, no copy
        idx: Any = None
        for i in range(first, len(pool.tensors)):
            rows = pool.host_rows[i]
            if rows is not None and run is not None:
                yield rows[run]
                continue
            if rows is not None:
                if idx is None:
                    idx = np.asarray(slots, dtype=np.int64)
                yield np.take(rows, idx, axis=0)
                continue
            t = pool.tensors[i]
            at = torch.as_tensor(list(slots), dtype=torch.long, device=t.device)
            yield byte_rows(t).index_select(0, at).cpu().numpy()

    def read_slots(self, slots: Sequence[int]) -> bytes:
        """The bytes of `slots` in every buffer, buffer-major (tests and checksums)."""
        return b"".join(rows.tobytes() for rows in self.each_rows(slots))

    def checksum(self, slots: Sequence[int]) -> int:
        """CRC-32 of `read_slots(slots)`: sender and receiver compare it after a transfer."""
        crc = self._pool.rows_crc(slots)
        if crc is not None:  # one kernel call (a host pool)
            return crc
        crc = 0
        for rows in self.each_rows(slots):
            crc = crc32(memoryview(rows), crc)
        return crc


def byte_rows(t: Any) -> Any:
    """A registered tensor as bytes rows [num_slots, item_bytes] (a view)."""
    import torch

    return t.view(torch.uint8).reshape(t.shape[0],
                                       t.numel() * t.element_size() // max(1, t.shape[0]))


@dataclass(frozen=True)
class RegisteredPool:
    """The registered KV buffers and what a transfer reads of them on every room, taken
    once per registration (a torch view costs microseconds a call: 60 layer buffers' worth
    per room was most of a small room's transfer)."""

    tensors: list[Any]
    infos: tuple[BufferInfo, ...]
    host_rows: list[Any]  # per buffer: numpy uint8 rows [num_slots, item] (host), or None
    item_bytes: tuple[int, ...]
    #: for the kv_rows kernel (a host pool only, else None): the buffers' addresses (uint64),
    #: their row sizes (int64), and the rows every buffer has
    bases: Any = None
    items: Any = None
    num_slots: int = 0
    #: per host buffer, its bytes as one flat memoryview (a run of rows is a slice of it:
    #: cheaper than a numpy view made into a memoryview, 60 of them a room)
    flat: tuple[Any, ...] = ()

    @staticmethod
    def of(buffers: Sequence[Any]) -> RegisteredPool:
        import numpy as np

        tensors = list(buffers)
        infos, host = [], []
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            infos.append(BufferInfo(t.data_ptr(), nbytes, nbytes // max(1, t.shape[0])))
            host.append(byte_rows(t).numpy() if t.device.type == "cpu" else None)
        items = tuple(i.item_bytes for i in infos)
        if not tensors or any(h is None for h in host):
            return RegisteredPool(tensors, tuple(infos), host, items)
        return RegisteredPool(tensors, tuple(infos), host, items,
                              np.array([i.ptr for i in infos], dtype=np.uint64),
                              np.array(items, dtype=np.int64),
                              min(int(t.shape[0]) for t in tensors),
                              tuple(memoryview(h).cast("B") for h in host))

    def run_views(self, run: slice, first: int = 0, stop: int | None = None) -> list[Any]:
        """Buffers ``first``..``stop``'s rows ``run`` as flat byte memoryviews (host pool)."""
        return [f[run.start * i:run.stop * i]
                for f, i in zip(self.flat[first:stop], self.item_bytes[first:stop])]

    @functools.cached_property
    def addrs(self) -> tuple[int, int]:
        """The addresses of ``bases`` and ``items`` (for the kernel's fast path)."""
        return int(self.bases.ctypes.data), int(self.items.ctypes.data)

    def kernel(self) -> Any:
        """The kv_rows kernel where this pool may use it (a host pool), else None."""
        if self.bases is None:
            return None
        from sglang_admin.disaggregation.kv_rows import kernel

        return kernel()

    def rows_crc(self, slots: Sequence[int], blocks: Any = None, mode: int = 2,
                 acc: int = 0, start: int = 0, stop: int | None = None) -> int | None:
        """Buffers ``start``..``stop``'s rows ``slots`` through the kv_rows kernel
        (``mode``: 1 gather into ``blocks``, 0 scatter from them, 2 sum only), their CRC-32
        continued from ``acc``; None where the kernel is not available."""
        k = self.kernel()
        if k is None:
            return None
        run = slot_run(slots)
        return k.rows(self.bases[start:stop], self.items[start:stop], slots,
                      None if run is None else run.start, blocks, mode, acc=acc,
                      num_slots=self.num_slots)


def slot_run(slots: Sequence[int]) -> slice | None:
    """``slots`` as a slice when they are one run of consecutive slots (a fresh request's
    usually are), else None. A list is compared in C (a 2048-slot room in ~20 us, where a
    Python loop over it took ~150 us)."""
    n = len(slots)
    if n == 0:
        return None
    first = int(slots[0])
    if int(slots[-1]) - first != n - 1 or first < 0:
        return None
    if isinstance(slots, range):
        ok = slots.step == 1
    elif isinstance(slots, list):
        ok = slots == list(range(first, first + n))
    else:
        import numpy as np

        ok = bool(np.array_equal(np.asarray(slots), np.arange(first, first + n)))
    return slice(first, first + n) if ok else None


def check_compatible(local: Sequence[BufferInfo], peer: PeerDescriptor) -> str | None:
    """None when the peer's buffers match ours in count and item size, else why not."""
    if len(local) != len(peer.buffers):
        return (f"kv transfer: peer has {len(peer.buffers)} KV buffers, this worker "
                f"{len(local)} (different model or layer count)")
    for i, (a, b) in enumerate(zip(local, peer.buffers)):
        if a.item_bytes != b.item_bytes:
            return (f"kv transfer: KV buffer {i} item size differs ({a.item_bytes} vs "
                    f"{b.item_bytes} bytes: model, dtype or tp split differ)")
    return None
