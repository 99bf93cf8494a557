"""PD at --tp-size > 1: every TP rank moves its own KV shard.

With tensor parallelism each TP rank holds its KV heads' shard of the pool, at the same
slot numbers as TP rank 0 (the followers keep the slots the broadcast batch names). The
rooms, the control socket and every decision stay with TP rank 0 (prefill.py, decode.py);
each TP follower starts a transfer backend of its own over its own shard, and rank 0 drives
it with commands on the replica's command channel (the broadcast that carries every step's
batch: msgpack in tensors, never pickle), so the commands keep one order with the steps:

- decode, after reserving a room's slots: ``pd-expect`` (each follower's backend expects the
  room in those slots; the followers' descriptors of the room, with the staging region a
  backend set aside for it, are gathered for the handshake, which lists one descriptor per
  TP rank);
- prefill, once the handshake and the held KV are both there: ``pd-send`` (TP rank ``t``
  writes its rows into decode TP rank ``t``'s descriptor, on a thread of its own), then
  ``pd-results`` when rank 0's own send is done (every follower answers at once with the
  outcomes and checksums it has; rank 0 asks again next round for those still running);
- decode, on prefill's ``done``: ``pd-checksum`` with the slots and the room (each
  follower lands what its backend staged for the room, then answers its CRC32 of the
  room's slots, compared with the checksum its prefill peer sent);
- decode, when a room ends: ``pd-release``.

Every collective here is answered by followers waiting in their command loop, so nothing
waits on a transfer inside a collective; a follower's send ends at the transfer timeout. A
failure on any TP rank fails the room (its message names the TP rank) and the room's slots,
which rank 0 owns for every rank, are freed once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sglang_admin.disaggregation.transfer import (
    KVTransferBackend,
    KVTransferError,
    PeerDescriptor,
    TransferResult,
)

logger = logging.getLogger(__name__)

PD_EXPECT, PD_SEND, PD_RESULTS = "pd-expect", "pd-send", "pd-results"
PD_CHECKSUM, PD_RELEASE = "pd-checksum", "pd-release"
PD_COMMANDS = frozenset((PD_EXPECT, PD_SEND, PD_RESULTS, PD_CHECKSUM, PD_RELEASE))


def shard_outcome(result: TransferResult, checksum: int) -> list[Any]:
    """One TP rank's outcome of a room's send as it travels: [ok, error, nbytes, seconds,
    checksum]."""
    return [bool(result.ok), result.error, int(result.nbytes), float(result.seconds),
            int(checksum)]


def send_and_sum(backend: KVTransferBackend, room: int, peer: PeerDescriptor,
                 src: list[int], dst: list[int], timeout_s: float) -> list[Any]:
    """Send ``src`` into the peer's ``dst`` and checksum the source rows: the outcome."""
    try:
        result = backend.send_checked(room, peer, src, dst, timeout_s)
        checksum = 0 if not result.ok else (result.checksum if result.checksum is not None
                                            else backend.checksum(src))
    except Exception as exc:  # noqa: BLE001 - a backend bug fails the room, not the rank
        result, checksum = TransferResult(False, f"kv transfer failed: {exc}"), 0
    return shard_outcome(result, checksum)


class LeaderShards:
    """TP rank 0's handle on its followers' transfer backends (runs in the rank thread)."""

    def __init__(self, tp: Any) -> None:
        self.tp = tp
        self.size: int = tp.size

    def expect(self, room: int, slots: Sequence[int]) -> list[Any]:
        """Decode: every follower expects ``room`` in ``slots``; their descriptors (wire
        dicts, TP ranks 1..N-1), or a string saying why a follower has none."""
        self.tp.broadcast((PD_EXPECT, room, list(slots)))
        return self.tp.gather(None)[1:]

    def send(self, room: int, peers: list[Any], src: list[int], dst: list[int],
             timeout_s: float) -> None:
        """Prefill: follower ``t`` sends its rows of ``src`` into ``peers[t]``'s ``dst``."""
        self.tp.broadcast((PD_SEND, room, peers, src, dst, float(timeout_s)))

    def results(self, rooms: list[int]) -> list[dict[int, list[Any]]]:
        """Prefill: per follower (TP ranks 1..N-1), the outcomes it has of ``rooms``' sends
        (room -> :func:`shard_outcome`); a room still sending is absent."""
        self.tp.broadcast((PD_RESULTS, rooms))
        return [{int(r): o for r, o in got} for got in self.tp.gather(None)[1:]]

    def checksums(self, slots: Sequence[int], room: int) -> list[int]:
        """Decode: each follower's CRC32 of its rows ``slots`` (TP ranks 1..N-1), once its
        backend landed what it staged for ``room``."""
        self.tp.broadcast((PD_CHECKSUM, list(slots), int(room)))
        return [int(c) for c in self.tp.gather(None)[1:]]

    def release(self, room: int) -> None:
        """Decode: the followers' backends take no more data for ``room``."""
        self.tp.broadcast((PD_RELEASE, room))


class FollowerShards:
    """A TP follower's transfer backend over its own KV shard, driven by rank 0's PD
    commands (scheduler/tp/worker.py hands them here)."""

    def __init__(self, backend: KVTransferBackend, kv_buffers: Callable[[], list[Any]],
                 rank: int) -> None:
        self.backend = backend
        self.kv_buffers = kv_buffers
        self.rank = rank
        self._ptrs: list[int] = []
        self.refresh()
        backend.start()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-send-shard")
        self.sends: dict[int, Future] = {}

    def refresh(self) -> None:
        """(Re-)register the KV shard when it was (re)allocated (memory release/resume)."""
        bufs = self.kv_buffers()
        ptrs = [b.data_ptr() for b in bufs]
        if ptrs != self._ptrs:
            self.backend.register_buffers(bufs)
            self._ptrs = ptrs

    def handle(self, command: tuple, gather: Callable[[Any], list[Any]]) -> None:
        """Run one PD command from rank 0 (and answer the gather it expects)."""
        kind = command[0]
        if kind == PD_EXPECT:
            gather(self._expect(int(command[1]), [int(s) for s in command[2]]))
        elif kind == PD_SEND:
            self._send(*command[1:])
        elif kind == PD_RESULTS:
            gather(self._results([int(r) for r in command[1]]))
        elif kind == PD_CHECKSUM:
            gather(self._checksum([int(s) for s in command[1]], int(command[2])))
        elif kind == PD_RELEASE:
            self.backend.release(int(command[1]))

    def _expect(self, room: int, slots: list[int]) -> Any:
        try:
            self.refresh()
            self.backend.expect(room, slots)
            return self.backend.descriptor(room).to_wire()
        except Exception as exc:  # noqa: BLE001 - named in the room's failure
            return f"{type(exc).__name__}: {exc}"

    def _send(self, room: int, peers: list[Any], src: list[int], dst: list[int],
              timeout_s: float) -> None:
        room = int(room)
        try:
            self.refresh()
            peer = PeerDescriptor.from_wire(peers[self.rank])
        except (KVTransferError, IndexError, TypeError) as exc:
            fut: Future = Future()
            fut.set_result(shard_outcome(TransferResult(
                False, f"kv transfer failed: no descriptor for this TP rank ({exc})"), 0))
            self.sends[room] = fut
            return
        self.sends[room] = self.pool.submit(send_and_sum, self.backend, room, peer,
                                            [int(s) for s in src], [int(s) for s in dst],
                                            float(timeout_s))

    def _results(self, rooms: list[int]) -> list[list[Any]]:
        out = []
        for room in rooms:
            fut = self.sends.get(room)
            if fut is None:  # rank 0 asks only for rooms it sent: a lost one fails it
                out.append([room, shard_outcome(TransferResult(
                    False, "kv transfer failed: this TP rank has no send for the room"), 0)])
            elif fut.done():
                del self.sends[room]
                out.append([room, fut.result()])
        return out

    def _checksum(self, slots: list[int], room: int) -> int:
        try:
            self.refresh()
            return self.backend.received_checksum(room, slots)
        except Exception as exc:  # noqa: BLE001 - -1 never equals a CRC32: the room fails
            logger.warning("PD checksum on this TP rank failed: %s", exc)
            return -1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.backend.close()
