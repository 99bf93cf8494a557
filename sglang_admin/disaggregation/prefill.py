"""The prefill role at a rank: a request with a bootstrap room is prefilled as usual and
its first token sampled; when it ends, its KV stays held (not freed, not evictable) until the
decode worker's handshake names where to write it, the backend sends it, and decode is told
the outcome with the first token, its logprobs, the cached-token count and a checksum of the
pages. Then the request's final output goes out and its KV is released (into the prefix
cache). Every failure (no handshake in time, a failed send, an abort) releases the KV and
ends the request with a clear error.

Runs in the rank's thread (``poll`` each loop round); only ``backend.send`` runs in worker
threads. No torch here. At --tp-size > 1 every TP rank sends its own KV shard
(tp_shards.py): the handshake lists one descriptor per decode TP rank, and the room
completes once every TP rank's send is in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sglang_admin.disaggregation import settings
from sglang_admin.disaggregation.control import ControlSocket
from sglang_admin.disaggregation.figures import FailureCounts
from sglang_admin.disaggregation.tp_shards import LeaderShards
from sglang_admin.disaggregation.transfer import (
    KVTransferBackend,
    KVTransferError,
    PeerDescriptor,
    TransferResult,
)
from sglang_admin.messages import ReqOutput

logger = logging.getLogger(__name__)

MAX_EARLY_HANDSHAKES = 10000
SHARD_QUERY_INTERVAL_S = 0.002  # the least time between two asks of a still-sending follower


@dataclass(eq=False)
class PrefillRoom:
    """One room at the prefill rank."""

    room: int
    req: Any  # scheduler Req
    created: float = field(default_factory=time.monotonic)
    out: ReqOutput | None = None  # the held final output, once the request ended
    held_since: float = 0.0
    handshake: dict[str, Any] | None = None
    future: Future | None = None
    aborted: str | None = None  # abort reason, while a send is in flight
    cancelled: str = ""  # decode gave the room up before the request ended
    version: str = ""  # the weight version the KV was computed with
    handshake_at: float = 0.0  # decode's handshake arrived
    shard_results: dict[int, list[Any]] = field(default_factory=dict)  # TP rank -> outcome


class PrefillRooms:
    """The prefill rank's rooms: held KV waiting for a handshake or in transfer."""

    role = "prefill"

    def __init__(self, state: Any, backend: KVTransferBackend, control: ControlSocket) -> None:
        self.state = state
        self.backend = backend
        self.control = control
        self.rooms: dict[int, PrefillRoom] = {}
        self.by_rid: dict[str, PrefillRoom] = {}
        self.early: dict[int, tuple[dict[str, Any], float]] = {}  # handshakes before requests
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-send")
        self.bootstrap_timeout = settings.bootstrap_timeout_s()
        self.transfer_timeout = settings.transfer_timeout_s()
        # figures for GetLoads / metrics
        self.weight_version: Callable[[], str] = lambda: ""  # set by the rank
        self.transfers_ok = 0
        self.transfers_failed = 0
        self.last_gb_s = 0.0
        self.last_latency_ms = 0.0
        self.last_total_mb = 0.0
        self.last_bootstrap_ms = 0.0  # the last room's held KV waiting for the handshake
        self.failures = FailureCounts()
        self.shards: LeaderShards | None = None  # the TP followers' backends (tp > 1)
        self._next_shard_query = 0.0  # a follower still sending: asked again from then on

    @property
    def tp_size(self) -> int:
        return 1 if self.shards is None else self.shards.size

    # ------------------------------------------------------------------ figures
    @property
    def busy(self) -> bool:
        return any(r.out is not None for r in self.rooms.values())

    @property
    def num_waiting_handshake(self) -> int:
        return sum(1 for r in self.rooms.values() if r.out is not None and r.future is None)

    @property
    def num_inflight(self) -> int:
        return sum(1 for r in self.rooms.values() if r.future is not None)

    # ------------------------------------------------------------------ scheduler hooks
    def track(self, req: Any, room: int) -> str | None:
        """A new request of ``room``; why it is refused (room already in use) or None."""
        if room in self.rooms:
            return f"bootstrap room {room} is already in use at this prefill worker"
        prefill_room = PrefillRoom(room, req)
        self.rooms[room] = prefill_room
        self.by_rid[req.rid] = prefill_room
        early = self.early.pop(room, None)
        if early is not None:
            prefill_room.handshake, prefill_room.handshake_at = early
        return None

    def hold(self, req: Any, out: ReqOutput) -> bool:
        """The request ended: True when its KV is now held for the transfer (the caller
        keeps its memory and does not send ``out``), False when it ends as usual."""
        room = self.by_rid.get(req.rid)
        if room is None or room.req is not req:
            return False
        if out.finish_reason == "abort" or out.error or req.req_idx < 0:
            self._forget(room)
            if room.handshake is not None:
                self._cancel_decode(room, out.error or "prefill request aborted")
            return False
        room.out = out
        room.version = self.weight_version()
        room.held_since = time.monotonic()
        if room.cancelled:
            self._end(room, f"kv transfer failed: decode gave room {room.room} up: "
                            f"{room.cancelled}", "UNAVAILABLE")
            return True
        if room.handshake is not None:
            self._start(room)
        return True

    def abort(self, rid: str, reason: str) -> bool:
        """Abort a held room; False when ``rid`` holds none (the scheduler's abort runs)."""
        room = self.by_rid.get(rid)
        if room is None or room.out is None:
            return False
        if room.future is not None:
            room.aborted = reason  # the send finishes (or times out), then it ends
            return True
        self._end(room, None, "abort", f"prefill request aborted ({reason})")
        return True

    def end_all(self, reason: str) -> int:
        rooms = [r for r in self.rooms.values() if r.out is not None]
        for room in rooms:
            if room.future is not None:
                room.aborted = reason
            else:
                self._end(room, f"kv transfer failed: {reason}", "UNAVAILABLE")
        return len(rooms)

    # ------------------------------------------------------------------ the loop's round
    def poll(self) -> None:
        for msg in self.control.receive():
            try:
                self._on_message(msg)
            except Exception as exc:  # noqa: BLE001 - a peer's malformed message is dropped
                logger.warning("malformed PD message for room %s dropped: %s", msg["room"], exc)
        now = time.monotonic()
        if self.shards is not None:
            self._collect_shards()
        for room in list(self.rooms.values()):
            fut = room.future
            if fut is not None:
                if fut.done() and len(room.shard_results) == self.tp_size - 1:
                    self._finish_send(room, fut)
                continue
            if room.out is not None and now - room.held_since > self.bootstrap_timeout:
                self._end(room, f"bootstrap timed out: no decode handshake for room "
                                f"{room.room} within {self.bootstrap_timeout:g}s", "UNAVAILABLE")
        if self.early:
            for key, (_, at) in list(self.early.items()):
                if now - at > self.bootstrap_timeout:
                    del self.early[key]

    def _collect_shards(self) -> None:
        """Ask the TP followers (once this round) for the outcomes of the rooms whose send
        is done here and whose followers have not all answered yet."""
        assert self.shards is not None
        asking = [r for r in self.rooms.values() if r.future is not None and r.future.done()
                  and len(r.shard_results) < self.tp_size - 1]
        now = time.monotonic()
        if not asking or now < self._next_shard_query:
            return
        got = self.shards.results([r.room for r in asking])
        for tp_rank, outcomes in enumerate(got, start=1):
            for room in asking:
                if room.room in outcomes:
                    room.shard_results[tp_rank] = outcomes[room.room]
        if any(len(r.shard_results) < self.tp_size - 1 for r in asking):
            # not every round: the follower's send thread needs its CPU more than a query
            self._next_shard_query = now + SHARD_QUERY_INTERVAL_S

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind, room_id = msg["kind"], msg["room"]
        room = self.rooms.get(room_id)
        if kind == "cancel":
            self.early.pop(room_id, None)
            if room is not None and room.out is not None:
                if room.future is not None:
                    room.aborted = str(msg.get("reason", "decode gave the room up"))[:500]
                else:
                    self._end(room, f"kv transfer failed: decode gave room {room_id} up: "
                                    f"{str(msg.get('reason', ''))[:500]}", "UNAVAILABLE")
            elif room is not None:
                room.handshake = None
                room.cancelled = str(msg.get("reason", "") or "decode gave the room up")[:500]
            return
        if kind != "handshake":
            logger.warning("prefill ignores PD message %r for room %s", kind, room_id)
            return
        if room is None:
            if len(self.early) < MAX_EARLY_HANDSHAKES:
                self.early[room_id] = (msg, time.monotonic())
            return
        if room.handshake is not None:
            logger.warning("second handshake for room %s ignored", room_id)
            return
        room.handshake, room.handshake_at = msg, time.monotonic()
        if room.out is not None:
            self._start(room)

    # ------------------------------------------------------------------ transfer
    def _start(self, room: PrefillRoom) -> None:
        hs = room.handshake
        assert hs is not None
        self.last_bootstrap_ms = max(room.handshake_at - room.held_since, 0.0) * 1000
        req = room.req
        src = list(req.slots[: len(req.prompt_ids)])
        try:
            notify = str(hs["notify"])
            wires = hs.get("peers")  # one per decode TP rank; a tp 1 peer may send "peer" only
            peers = [PeerDescriptor.from_wire(w)
                     for w in (wires if wires is not None else [hs.get("peer")])]
            dst = [int(s) for s in hs.get("dst_slots", [])]
        except (KVTransferError, KeyError, TypeError, ValueError) as exc:
            self._end(room, f"kv transfer failed: bad handshake for room {room.room}: {exc}",
                      "UNAVAILABLE")
            return
        if len(peers) != self.tp_size:
            self._end(room, f"bootstrap failed: the handshake for room {room.room} comes from "
                            f"a decode worker with --tp-size {len(peers)}, this prefill worker "
                            f"runs --tp-size {self.tp_size}: a PD pair needs equal TP sizes",
                      "UNAVAILABLE", notify)
            return
        if len(dst) != len(src):
            self._end(room, f"kv transfer failed: decode reserved {len(dst)} slots for room "
                            f"{room.room}, the prompt has {len(src)}", "UNAVAILABLE", notify)
            return
        if self.shards is not None:  # the followers send their shards beside this one
            self.shards.send(room.room, [p.to_wire() for p in peers], src, dst,
                             self.transfer_timeout)
        room.future = self.pool.submit(self._send, room.room, peers[0], src, dst)

    def _send(self, room: int, peer: PeerDescriptor, src: list[int],
              dst: list[int]) -> tuple[TransferResult, int]:
        result = self.backend.send_checked(room, peer, src, dst, self.transfer_timeout)
        if not result.ok:
            return result, 0
        return result, (result.checksum if result.checksum is not None
                        else self.backend.checksum(src))

    def _finish_send(self, room: PrefillRoom, fut: Future) -> None:
        try:
            result, checksum = fut.result()
        except Exception as exc:  # noqa: BLE001 - a backend bug fails the room, not the rank
            result, checksum = TransferResult(False, f"kv transfer failed: {exc}"), 0
        result, checksums = self._with_shards(room, result, checksum)
        hs = room.handshake or {}
        notify = str(hs.get("notify", ""))
        req = room.req
        if not result.ok:
            self.transfers_failed += 1
            self._end(room, result.error, "UNAVAILABLE", notify)
            return
        self.transfers_ok += 1
        if result.seconds > 0:
            self.last_gb_s = result.nbytes / result.seconds / 1e9
            self.last_latency_ms = result.seconds * 1000
            self.last_total_mb = result.nbytes / 1e6
        lp = req.logprob
        done = {
            "kind": "done", "room": room.room, "ok": room.aborted is None,
            "error": f"kv transfer failed: prefill request aborted ({room.aborted})"
                     if room.aborted else "",
            "first_token": req.output_ids[0] if req.output_ids else -1,
            "logprob": lp.logprobs[0] if lp.logprobs else None,
            "top_logprobs": [list(p) for p in lp.top_logprobs[0]] if lp.top_logprobs else [],
            "token_ids_logprobs": ([list(p) for p in lp.token_ids_logprobs[0]]
                                   if lp.token_ids_logprobs else []),
            "cached_tokens": max(req.cached_tokens, 0),
            "checksum": checksum, "checksums": checksums,
            "nbytes": result.nbytes, "seconds": result.seconds,
            "weight_version": room.version,
        }
        if not notify or not self.control.send(notify, done):
            self._end(room, f"kv transfer failed: cannot notify decode at {notify!r}",
                      "UNAVAILABLE")
            return
        if room.aborted is not None:
            self._end(room, None, "abort")
            return
        self._end(room, None, None)

    def _with_shards(self, room: PrefillRoom, result: TransferResult, checksum: int
                     ) -> tuple[TransferResult, list[int]]:
        """The room's outcome over every TP rank: failed when any rank failed (the first
        failing follower named), bytes summed, the slowest rank's time; every rank's
        checksum, in TP rank order."""
        checksums = [checksum]
        if self.tp_size == 1:
            return result, checksums
        nbytes, seconds = result.nbytes, result.seconds
        for tp_rank in range(1, self.tp_size):
            ok, error, shard_bytes, shard_seconds, shard_sum = room.shard_results[tp_rank]
            if not ok and result.ok:
                result = TransferResult(False, f"{error} (TP rank {tp_rank})")
            nbytes += int(shard_bytes)
            seconds = max(seconds, float(shard_seconds))
            checksums.append(int(shard_sum))
        if result.ok:
            result = TransferResult(True, nbytes=nbytes, seconds=seconds)
        return result, checksums

    # ------------------------------------------------------------------ ending
    def _end(self, room: PrefillRoom, error: str | None, code: str | None,
             notify: str = "") -> None:
        """Release the room's KV and send its output: the held one (success), an abort, or
        the error. Tells decode when it failed and decode is known."""
        self._forget(room)
        state, req, out = self.state, room.req, room.out
        if req.req_idx >= 0:
            state.memory.release(req)
        if notify and error:
            self._cancel_decode(room, error, notify)
        elif error and room.handshake is not None:
            self._cancel_decode(room, error)
        if out is None:
            return
        if code == "abort":
            out.finish_reason, out.error, out.error_code = "abort", None, None
        elif error is not None:
            self.failures.count(error)
            out.finish_reason, out.error, out.error_code = "abort", error, code
            logger.warning("room %d (%s): %s", room.room, req.rid, error)
        state.pending_outputs.append(out)

    def _cancel_decode(self, room: PrefillRoom, reason: str, notify: str = "") -> None:
        hs = room.handshake or {}
        addr = notify or str(hs.get("notify", ""))
        if addr:
            self.control.send(addr, {"kind": "done", "room": room.room, "ok": False,
                                     "error": reason})

    def _forget(self, room: PrefillRoom) -> None:
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]
        if self.by_rid.get(room.req.rid) is room:
            del self.by_rid[room.req.rid]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
