"""The decode role at a rank: a request with a bootstrap room waits here, not in the
scheduler's queue: prealloc (a table row and KV slots for its prompt), bootstrap (the
prefill rank that holds the room, room % prefill dp size, from the prefill's bootstrap
server), handshake (where to write: this pool's descriptor and slots), transfer (wait for
prefill's "done", verify the pages' checksum), then it joins the running batch with its
prompt's KV in place and its first token from prefill, and decodes from token 2 without a
prefill forward.

Every failure (bootstrap unreachable, a timeout, a dead prefill, a failed or corrupt
transfer, an abort) frees the request's KV, tells the prefill side when it knows it, and
ends the request with a clear error using the words the router classifies ("bootstrap",
"kv transfer"). Runs in the rank's thread; HTTP calls run in worker threads. No torch here.
At --tp-size > 1 each TP rank receives its own KV shard (tp_shards.py): the followers
expect the room with rank 0, the handshake lists every TP rank's descriptor, and each
rank's checksum is checked before the request joins; the prefill must run the same TP size
(its bootstrap server says which; another is refused before the handshake).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sglang_admin.disaggregation import settings
from sglang_admin.disaggregation.control import ControlSocket, http_ok, resolve_prefill_rank
from sglang_admin.disaggregation.figures import FailureCounts
from sglang_admin.disaggregation.tp_shards import LeaderShards
from sglang_admin.disaggregation.transfer import KVTransferBackend

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # one heartbeat probe of a prefill's bootstrap server
MAX_PEER_ERROR_CHARS = 500  # a peer's error text, as passed on to the client
DEAD_PREFILL = "kv transfer failed: Failed to get kvcache from prefill instance, it might be dead"


@dataclass(eq=False)
class DecodeRoom:
    """One request waiting for its KV at the decode rank."""

    room: int
    host: str
    port: int
    req: Any  # scheduler Req
    created: float = field(default_factory=time.monotonic)
    phase: str = "prealloc"  # prealloc -> bootstrap -> transfer
    future: Future | None = None
    prefill_addr: str = ""
    handshake_at: float = 0.0
    reserved_at: float = 0.0  # its KV slots reserved (the end of prealloc)
    grammar_wait: bool = False  # constrained: its grammar is still compiling
    arrived: dict[str, Any] | None = None  # prefill's "done", kept while the grammar compiles
    shard_peers: list[Any] = field(default_factory=list)  # TP ranks 1.. descriptors (tp > 1)


class DecodeRooms:
    """The decode rank's requests waiting for their KV."""

    role = "decode"

    def __init__(self, state: Any, backend: KVTransferBackend, control: ControlSocket) -> None:
        self.state = state
        self.backend = backend
        self.control = control
        self.rooms: dict[int, DecodeRoom] = {}
        self.by_rid: dict[str, DecodeRoom] = {}
        self.prealloc: deque[DecodeRoom] = deque()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pd-bootstrap")
        self.bootstrap_timeout = settings.bootstrap_timeout_s()
        self.waiting_timeout = settings.waiting_timeout_s()
        self.heartbeat_interval = settings.heartbeat_interval_s()
        self.heartbeat_max = settings.heartbeat_max_failures()
        # prefill bootstrap "host:port" -> (probe future, last probe time, failures)
        self.probes: dict[str, list[Any]] = {}
        self.weight_version: Callable[[], str] = lambda: ""  # set by the rank
        self.transfers_ok = 0
        self.transfers_failed = 0
        self.last_gb_s = 0.0
        self.last_latency_ms = 0.0
        self.last_total_mb = 0.0
        self.last_alloc_ms = 0.0  # the last room's wait for its KV slots
        self.last_bootstrap_ms = 0.0  # the last room's bootstrap lookup and handshake
        self.failures = FailureCounts()
        self.shards: LeaderShards | None = None  # the TP followers' backends (tp > 1)

    @property
    def tp_size(self) -> int:
        return 1 if self.shards is None else self.shards.size

    @property
    def busy(self) -> bool:
        return bool(self.rooms)

    @property
    def num_prealloc(self) -> int:
        return len(self.prealloc) + sum(1 for r in self.rooms.values() if r.phase == "bootstrap")

    @property
    def num_transfer(self) -> int:
        return sum(1 for r in self.rooms.values() if r.phase == "transfer")

    # ------------------------------------------------------------------ scheduler hooks
    def add(self, req: Any, room: int, host: str, port: int) -> str | None:
        """Take a new request; why it is refused (room in use) or None."""
        if room in self.rooms:
            return f"bootstrap room {room} is already in use at this decode worker"
        # prompt logprobs come from prefill (the router copies them): none computed here
        req.logprob.logprob_start_len = -1
        droom = DecodeRoom(room, host, port, req)
        self.rooms[room] = droom
        self.by_rid[req.rid] = droom
        self.prealloc.append(droom)
        params = req.sampling.params
        if params.grammar_kind and self.state.grammar_queue is not None:
            droom.grammar_wait = True  # compiled beside the transfer; joins once both are in
            self.state.grammar_queue.submit(req, params.grammar_kind, params.grammar)
        return None

    def grammar_compiled(self, req: Any, grammar: Any, error: str | None,
                         code: str | None) -> bool:
        """A compile finished for ``req``: True when it is one of these rooms' (then handled:
        kept, joined if its KV is in, or failed), False for the scheduler's own."""
        droom = self.by_rid.get(req.rid)
        if droom is None or droom.req is not req:
            return False
        if grammar is None:
            self._end(droom, error or "grammar compile failed", code or "INVALID_ARGUMENT",
                      tell_prefill="the request's grammar did not compile")
            return True
        req.sampling.grammar = grammar
        droom.grammar_wait = False
        if droom.arrived is not None:
            self._join(droom, int(droom.arrived["first_token"]), droom.arrived)
        return True

    def abort(self, rid: str, reason: str) -> bool:
        droom = self.by_rid.get(rid)
        if droom is None:
            return False
        self._end(droom, None, "abort", tell_prefill=f"decode request aborted ({reason})")
        return True

    def end_all(self, reason: str) -> int:
        rooms = list(self.rooms.values())
        for droom in rooms:
            self._end(droom, None, "abort", tell_prefill=reason)
        return len(rooms)

    # ------------------------------------------------------------------ the loop's round
    def poll(self) -> None:
        for msg in self.control.receive():
            try:
                self._on_message(msg)
            except Exception as exc:  # noqa: BLE001 - a peer's malformed message fails its room
                droom = self.rooms.get(msg["room"])
                logger.warning("malformed PD message for room %s: %s", msg["room"], exc)
                if droom is not None and droom.phase in ("transfer", "grammar"):
                    self._end(droom, f"kv transfer failed: malformed message from prefill "
                                     f"({type(exc).__name__})", "UNAVAILABLE",
                              tell_prefill="malformed completion")
        self._preallocate()
        now = time.monotonic()
        wall = time.time()
        for droom in list(self.rooms.values()):
            deadline = droom.req.deadline
            if deadline is not None and deadline < wall:
                self._end(droom, "deadline exceeded while waiting for the KV",
                          "DEADLINE_EXCEEDED", tell_prefill="decode's deadline passed")
                continue
            if droom.phase == "bootstrap" and droom.future is not None and droom.future.done():
                self._bootstrapped(droom)
            elif droom.phase == "transfer" and now - droom.handshake_at > self.waiting_timeout:
                self._end(droom, f"kv transfer timed out: no KV for room {droom.room} within "
                                 f"{self.waiting_timeout:g}s of the handshake", "UNAVAILABLE",
                          tell_prefill="decode timed out waiting for the KV")
            elif droom.phase != "transfer" and now - droom.created > self.bootstrap_timeout:
                self._end(droom, f"bootstrap timed out for room {droom.room} after "
                                 f"{self.bootstrap_timeout:g}s", "UNAVAILABLE")
        self._heartbeat(now)

    def _preallocate(self) -> None:
        state = self.state
        memory = state.memory
        while self.prealloc:
            droom = self.prealloc[0]
            req = droom.req
            if droom.room not in self.rooms:  # ended meanwhile
                self.prealloc.popleft()
                continue
            n = len(req.prompt_ids)
            headroom = len(state.running) + 1
            if (not memory.free_rows
                    or state.allocator.available + state.cache.evictable_size - headroom < n):
                return  # waits for memory (in arrival order)
            req.req_idx = memory.free_rows.pop()
            req.slots, req.kv_len, req.cached_len, req.table_synced = [], 0, 0, 0
            req.last_node = None
            if not memory.reserve(req, n):
                memory.free_rows.append(req.req_idx)
                req.req_idx = -1
                return
            self.prealloc.popleft()
            self.backend.expect(droom.room, req.slots)
            droom.reserved_at = time.monotonic()
            self.last_alloc_ms = (droom.reserved_at - droom.created) * 1000
            droom.phase = "bootstrap"
            if self.shards is not None:
                droom.shard_peers = self.shards.expect(droom.room, req.slots)
                bad = [(t, p) for t, p in enumerate(droom.shard_peers, 1)
                       if not isinstance(p, dict)]
                if bad:
                    self._end(droom, f"bootstrap failed: TP rank {bad[0][0]} cannot receive "
                                     f"room {droom.room}: {bad[0][1]}", "UNAVAILABLE")
                    continue
            droom.future = self.pool.submit(resolve_prefill_rank, droom.host, droom.port,
                                            droom.room)

    def _bootstrapped(self, droom: DecodeRoom) -> None:
        fut, droom.future = droom.future, None
        try:
            addr, prefill_tp = fut.result()
        except Exception as exc:  # noqa: BLE001 - unreachable or malformed
            self._end(droom, f"bootstrap failed: cannot reach the prefill bootstrap server "
                             f"{droom.host}:{droom.port} for room {droom.room}: {exc}",
                      "UNAVAILABLE")
            return
        droom.prefill_addr = addr
        if prefill_tp != self.tp_size:  # each TP rank's shard has one peer: equal sizes only
            why = (f"bootstrap failed: the prefill worker at {droom.host}:{droom.port} runs "
                   f"--tp-size {prefill_tp}, this decode worker --tp-size {self.tp_size}: a PD "
                   f"pair needs equal TP sizes (no handshake sent for room {droom.room})")
            self._end(droom, why, "UNAVAILABLE", tell_prefill=why)
            return
        own = self.backend.descriptor(droom.room).to_wire()
        msg = {"kind": "handshake", "room": droom.room, "rid": droom.req.rid,
               "peer": own, "peers": [own, *droom.shard_peers], "tp_size": self.tp_size,
               "dst_slots": list(droom.req.slots), "notify": self.control.address}
        if not self.control.send(addr, msg):
            self._end(droom, f"bootstrap failed: handshake with prefill rank {addr} could "
                             "not be sent", "UNAVAILABLE")
            return
        droom.phase = "transfer"
        droom.handshake_at = time.monotonic()
        self.last_bootstrap_ms = (droom.handshake_at - droom.reserved_at) * 1000

    def _on_message(self, msg: dict[str, Any]) -> None:
        room_id = msg["room"]
        droom = self.rooms.get(room_id)
        if msg["kind"] != "done":
            logger.warning("decode ignores PD message %r for room %s", msg["kind"], room_id)
            return
        if droom is None or droom.phase != "transfer":
            logger.warning("kv transfer for unknown room %s ignored", room_id)
            return
        if not msg.get("ok"):
            error = str(msg.get("error") or "")[:MAX_PEER_ERROR_CHARS]
            if not error.startswith(("kv transfer", "bootstrap")):
                error = f"kv transfer failed: prefill reported: {error or 'no reason'}"
            self._end(droom, error, "UNAVAILABLE")
            return
        req = droom.req
        try:
            first = int(msg["first_token"])
            checksum = int(msg["checksum"])
        except (KeyError, TypeError, ValueError):
            self._end(droom, "kv transfer failed: malformed completion from prefill",
                      "UNAVAILABLE", tell_prefill="malformed completion")
            return
        theirs, ours = str(msg.get("weight_version", "")), self.weight_version()
        if theirs != ours:  # never decode with one model's weights on another's KV
            self._end(droom, f"kv transfer failed: weight version mismatch (prefill computed "
                             f"the KV with {theirs!r}, decode runs {ours!r}): refit both "
                             "legs to the same version", "UNAVAILABLE")
            return
        got = self.backend.received_checksum(room_id, req.slots)  # landed first
        if got != checksum:
            self.transfers_failed += 1
            self._end(droom, f"kv transfer failed: checksum mismatch for room {room_id} "
                             "(corrupt or short transfer)", "UNAVAILABLE")
            return
        if self.shards is not None:
            why = self._shard_checksums(room_id, msg.get("checksums"), req.slots)
            if why:
                self.transfers_failed += 1
                self._end(droom, why, "UNAVAILABLE")
                return
        self.transfers_ok += 1
        seconds = float(msg.get("seconds") or 0.0)
        if seconds > 0:
            self.last_gb_s = float(msg.get("nbytes") or 0) / seconds / 1e9
            self.last_latency_ms = seconds * 1000
            self.last_total_mb = float(msg.get("nbytes") or 0) / 1e6
        if droom.grammar_wait:
            droom.arrived, droom.phase = msg, "grammar"
            return
        self._join(droom, first, msg)

    def _shard_checksums(self, room_id: int, theirs: Any, slots: list[int]) -> str:
        """Why the followers' shards of the room are not what prefill's TP ranks sent ("" when
        every TP rank's checksum matches)."""
        assert self.shards is not None
        if not isinstance(theirs, list) or len(theirs) != self.tp_size:
            return (f"kv transfer failed: prefill sent no checksum per TP rank for room "
                    f"{room_id} (this decode worker runs --tp-size {self.tp_size})")
        ours_all = self.shards.checksums(slots, room_id)
        for tp_rank, (ours, sent) in enumerate(zip(ours_all, theirs[1:]), 1):
            if not isinstance(sent, int) or ours != sent:
                return (f"kv transfer failed: checksum mismatch for room {room_id} on TP rank "
                        f"{tp_rank} (corrupt or short transfer)")
        return ""

    def _join(self, droom: DecodeRoom, first: int, msg: dict[str, Any]) -> None:
        """The KV is in place: the request runs from its second token."""
        from sglang_admin.scheduler.request_end import check_finished, finish, progress

        self._forget(droom)
        state, req = self.state, droom.req
        req.kv_len = len(req.prompt_ids)
        req.output_ids.append(first)
        lp = req.logprob
        if lp.return_logprob:
            lp.logprobs.append(float(msg.get("logprob") or 0.0))
            if lp.top_logprobs_num:
                lp.top_logprobs.append([(int(t), float(v)) for t, v in
                                        msg.get("top_logprobs") or []])
            if lp.token_ids_logprob:
                lp.token_ids_logprobs.append([(int(t), float(v)) for t, v in
                                              msg.get("token_ids_logprobs") or []])
        req.cached_tokens = int(msg.get("cached_tokens") or 0)
        req.queue_time_s = time.monotonic() - req.arrived
        state.prompt_tokens_total += len(req.prompt_ids)
        state.cached_tokens_total += req.cached_tokens
        req.running_since = state.clock()
        state.running.append(req)
        # the prompt's KV into the radix cache at once (locked by this request): forked
        # samples (n > 1) and later requests with the same prefix reuse it
        state.memory.share_prefilled(req)
        grammar = req.sampling.grammar
        if grammar is not None and not grammar.accept(first):
            finish(state, req, "abort", error=f"token {first} from prefill violates the "
                   "request's grammar", code="INTERNAL")
            return
        check_finished(state, req, first)
        if req.key in state.by_rid:
            state.pending_outputs.append(progress(req))

    # ------------------------------------------------------------------ dead prefill
    def _heartbeat(self, now: float) -> None:
        """Probe the bootstrap server of every prefill a room waits on; a prefill that
        fails ``heartbeat_max`` probes in a row fails its rooms."""
        waiting: dict[str, list[DecodeRoom]] = {}
        for droom in self.rooms.values():
            if droom.phase == "transfer":
                waiting.setdefault(f"{droom.host}:{droom.port}", []).append(droom)
        for key in list(self.probes):
            if key not in waiting:
                del self.probes[key]
        for key, rooms in waiting.items():
            probe = self.probes.setdefault(key, [None, now, 0])
            fut = probe[0]
            if fut is not None and fut.done():
                probe[0] = None
                try:
                    fut.result()
                    probe[2] = 0
                except Exception:  # noqa: BLE001 - unreachable
                    probe[2] += 1
                if probe[2] >= self.heartbeat_max:
                    for droom in rooms:
                        self._end(droom, f"{DEAD_PREFILL} (bootstrap {key} unreachable)",
                                  "UNAVAILABLE")
                    del self.probes[key]
                    continue
            if probe[0] is None and now - probe[1] >= self.heartbeat_interval:
                probe[1] = now
                # its own timeout (not the interval): a loaded but live prefill answers late
                probe[0] = self.pool.submit(http_ok, f"http://{key}/health", PROBE_TIMEOUT_S)

    # ------------------------------------------------------------------ ending
    def _end(self, droom: DecodeRoom, error: str | None, code: str | None,
             tell_prefill: str = "") -> None:
        """Free the room's KV and end its request (an abort, or the error)."""
        from sglang_admin.scheduler.request_end import error_output, finish

        self._forget(droom)
        state, req = self.state, droom.req
        if droom.grammar_wait and state.grammar_queue is not None:
            state.grammar_queue.remove(req)
        if droom.prefill_addr and tell_prefill:
            self.control.send(droom.prefill_addr, {"kind": "cancel", "room": droom.room,
                                                    "reason": tell_prefill})
        if req.req_idx >= 0:
            state.memory.release(req, keep=False)
        if error is not None:
            self.failures.count(error)
            logger.warning("room %d (%s): %s", droom.room, req.rid, error)
        if req.key in state.by_rid:
            finish(state, req, "abort", error=error,
                   code=None if code == "abort" else code)
        else:
            state.pending_outputs.append(error_output(req.rid, code or "ABORTED", error or ""))

    def _forget(self, droom: DecodeRoom) -> None:
        self.backend.release(droom.room)
        if self.shards is not None and droom.phase != "prealloc":  # the followers expected it
            self.shards.release(droom.room)
        if self.rooms.get(droom.room) is droom:
            del self.rooms[droom.room]
        if self.by_rid.get(droom.req.rid) is droom:
            del self.by_rid[droom.req.rid]
        if droom.future is not None:
            droom.future.cancel()
            droom.future = None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
