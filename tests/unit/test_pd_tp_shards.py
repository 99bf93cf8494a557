"""PD at --tp-size 2, one room at the prefill rank with real zmq backends on every side: TP
rank 0's PrefillRooms drives a TP follower's backend (FollowerShards) through the TP
commands, each command and answer passed through the TP group's real wire (msgpack) by an
in-process stand-in for the group. A room completes only with both shards moved and one
checksum per TP rank; a send that fails on the follower alone fails the room, names the TP
rank, releases the KV once and tells decode. Decode's per-rank checksum check names the TP
rank whose shard differs."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch
import zmq

from sglang_admin.disaggregation.control import ControlSocket
from sglang_admin.disaggregation.decode import DecodeRooms
from sglang_admin.disaggregation.prefill import PrefillRooms
from sglang_admin.disaggregation.tp_shards import FollowerShards, LeaderShards
from sglang_admin.disaggregation.zmq_backend import ZmqBackend
from sglang_admin.multinode import wire

LAYERS, SLOTS = 2, 32


def shard(fill: bool) -> list[torch.Tensor]:
    kv = torch.randn(LAYERS, 2, SLOTS, 1, 8) if fill else torch.zeros(LAYERS, 2, SLOTS, 1, 8)
    return [kv[i, j] for j in range(2) for i in range(LAYERS)]


class InProcessGroup:
    """Rank 0 and its followers in one process: a broadcast runs every follower's handler
    at once; a gather gives rank 0's object then the answers the followers gave."""

    def __init__(self, followers: list[FollowerShards]) -> None:
        self.followers = followers
        self.size = 1 + len(followers)
        self.answers: list[Any] = []

    def broadcast(self, obj: Any = None) -> Any:
        command = wire.decode(wire.encode(obj))
        self.answers = []
        for follower in self.followers:
            follower.handle(command, lambda x: self.answers.append(wire.decode(wire.encode(x))))
        return obj

    def gather(self, obj: Any) -> list[Any]:
        return [obj, *self.answers]


class Memory:
    def __init__(self) -> None:
        self.released: list[Any] = []

    def release(self, req: Any, keep: bool = True) -> None:
        self.released.append(req)


def request(rid: str, slots: list[int]) -> Any:
    logprob = SimpleNamespace(logprobs=[-0.5], top_logprobs=[], token_ids_logprobs=[])
    return SimpleNamespace(rid=rid, slots=slots, prompt_ids=list(range(len(slots))), req_idx=3,
                           output_ids=[42], logprob=logprob, cached_tokens=0)


@pytest.fixture()
def sides():
    """Prefill TP ranks 0 and 1 (rank 1 a FollowerShards), decode TP ranks 0 and 1
    (receivers), a PULL socket standing for decode's control inbox."""
    p0, d0, d1 = ZmqBackend(), ZmqBackend(), ZmqBackend()
    p0.register_buffers(shard(True))
    d0.register_buffers(shard(False))
    d1.register_buffers(shard(False))
    for b in (p0, d0, d1):
        b.start()
    p1_pool = shard(True)
    follower = FollowerShards(ZmqBackend(), lambda: p1_pool, 1)
    state = SimpleNamespace(memory=Memory(), pending_outputs=[])
    control = ControlSocket("127.0.0.1", "127.0.0.1")
    rooms = PrefillRooms(state, p0, control)
    rooms.shards = LeaderShards(InProcessGroup([follower]))
    rooms.transfer_timeout = 1.0
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    notify = f"127.0.0.1:{inbox.bind_to_random_port('tcp://127.0.0.1')}"
    yield SimpleNamespace(rooms=rooms, state=state, follower=follower, p0=p0, d0=d0, d1=d1,
                          inbox=inbox, notify=notify)
    rooms.close()
    follower.close()
    control.close()
    for b in (p0, d0, d1):
        b.close()
    inbox.close(linger=0)
    ctx.term()


def run_room(s: Any, room: int, peers: list[dict], slots: list[int]) -> tuple[Any, dict]:
    """One room through PrefillRooms: held, handshaken, polled until it ends; its output
    and the message decode was sent."""
    req = request(f"r{room}", slots)
    out = SimpleNamespace(finish_reason="length", error=None, error_code=None)
    assert s.rooms.track(req, room) is None
    assert s.rooms.hold(req, out)
    s.rooms._on_message({"kind": "handshake", "room": room, "peer": peers[0], "peers": peers,
                         "tp_size": 2, "dst_slots": slots, "notify": s.notify})
    deadline = time.monotonic() + 20
    while not s.state.pending_outputs:
        assert time.monotonic() < deadline, "the room never ended"
        s.rooms.poll()
        time.sleep(0.01)
    assert s.inbox.poll(5000)
    return s.state.pending_outputs.pop(), msgpack.unpackb(s.inbox.recv(), raw=False)


def test_both_shards_move_and_each_tp_rank_sends_its_checksum(sides: Any) -> None:
    s = sides
    slots = [4, 9, 5, 17]
    s.d0.expect(1, slots)
    s.d1.expect(1, slots)
    out, done = run_room(s, 1, [s.d0.descriptor().to_wire(), s.d1.descriptor().to_wire()], slots)
    assert out.error is None and done["ok"] is True, done
    assert s.d0.read_slots(slots) == s.p0.read_slots(slots)
    assert s.d1.read_slots(slots) == s.follower.backend.read_slots(slots)
    assert s.d1.read_slots(slots) != s.d0.read_slots(slots)  # two different shards
    assert done["checksums"] == [s.d0.checksum(slots), s.d1.checksum(slots)]
    assert done["checksum"] == done["checksums"][0]
    assert done["nbytes"] == 2 * len(slots) * LAYERS * 2 * 8 * 4  # both shards counted
    assert len(s.state.memory.released) == 1 and not s.rooms.rooms
    assert not s.follower.sends  # the follower's outcome was collected


def test_a_send_that_fails_on_the_follower_alone_fails_the_room(sides: Any) -> None:
    s = sides
    slots = [2, 3, 4]
    s.d0.expect(2, slots)
    dead = s.d1.descriptor().to_wire()
    s.d1.close()  # decode's TP rank 1 stops answering: only the follower's send fails
    t0 = time.monotonic()
    out, done = run_room(s, 2, [s.d0.descriptor().to_wire(), dead], slots)
    assert time.monotonic() - t0 < 10  # the transfer timeout (1 s), not a hang
    assert out.finish_reason == "abort" and out.error_code == "UNAVAILABLE"
    assert out.error.startswith("kv transfer failed") and "(TP rank 1)" in out.error, out.error
    assert done["ok"] is False and "(TP rank 1)" in done["error"]
    assert len(s.state.memory.released) == 1 and not s.rooms.rooms
    assert (s.rooms.failures.transfer, s.rooms.transfers_failed) == (1, 1)


def test_a_handshake_of_another_tp_size_is_refused_with_bootstrap(sides: Any) -> None:
    s = sides
    out, done = run_room(s, 3, [s.d0.descriptor().to_wire()], [1, 2])
    assert out.error_code == "UNAVAILABLE"
    assert out.error.startswith("bootstrap failed: the handshake for room 3") and (
        "--tp-size 1" in out.error and "--tp-size 2" in out.error), out.error
    assert done["ok"] is False and done["error"] == out.error
    assert len(s.state.memory.released) == 1 and s.rooms.failures.bootstrap == 1
    assert not s.follower.sends  # nothing was sent on any TP rank


def test_decode_names_the_tp_rank_whose_shard_differs() -> None:
    d1_pool = shard(True)
    follower = FollowerShards(ZmqBackend(), lambda: d1_pool, 1)
    rooms = DecodeRooms(SimpleNamespace(), ZmqBackend(), None)
    rooms.shards = LeaderShards(InProcessGroup([follower]))
    try:
        slots = [3, 1, 7]
        right = follower.backend.checksum(slots)
        assert rooms._shard_checksums(5, [11, right], slots) == ""
        why = rooms._shard_checksums(5, [11, right ^ 1], slots)
        assert why == ("kv transfer failed: checksum mismatch for room 5 on TP rank 1 "
                       "(corrupt or short transfer)")
        for bad in (None, [11], [11, right, 3], [11, "x"]):
            assert rooms._shard_checksums(5, bad, slots).startswith("kv transfer failed"), bad
        # the followers' backends expect a room with rank 0 and give their descriptors
        got = rooms.shards.expect(5, slots)
        assert got == [follower.backend.descriptor().to_wire()]
    finally:
        follower.close()
        rooms.close()


def test_mooncake_at_tp2_stages_each_shard_and_lands_it_before_the_checksums() -> None:
    """The mooncake backend on every side: decode's TP ranks each set a staging region
    aside for the room (rank 0's and the follower's descriptors carry one), prefill's TP
    ranks each write their shard there, and decode's checksum of every TP rank lands the
    shard first: the checksums match and the rows are in the slots."""
    pytest.importorskip("mooncake")
    from sglang_admin.disaggregation.mooncake_backend import MooncakeBackend

    p0, d0 = MooncakeBackend(), MooncakeBackend()
    p0.register_buffers(shard(True))
    d0.register_buffers(shard(False))
    p1_pool, d1_pool = shard(True), shard(False)
    for b in (p0, d0):
        b.start()
    p_follower = FollowerShards(MooncakeBackend(), lambda: p1_pool, 1)
    d_follower = FollowerShards(MooncakeBackend(), lambda: d1_pool, 1)
    state = SimpleNamespace(memory=Memory(), pending_outputs=[])
    control = ControlSocket("127.0.0.1", "127.0.0.1")
    rooms = PrefillRooms(state, p0, control)
    rooms.shards = LeaderShards(InProcessGroup([p_follower]))
    rooms.transfer_timeout = 10.0
    decode = DecodeRooms(SimpleNamespace(), d0, None)
    decode.shards = LeaderShards(InProcessGroup([d_follower]))
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    notify = f"127.0.0.1:{inbox.bind_to_random_port('tcp://127.0.0.1')}"
    s = SimpleNamespace(rooms=rooms, state=state, inbox=inbox, notify=notify)
    try:
        slots = [4, 9, 5, 17]
        d0.expect(6, slots)
        peers = [d0.descriptor(6).to_wire(), *decode.shards.expect(6, slots)]
        assert all("staging" in p for p in peers), peers
        out, done = run_room(s, 6, peers, slots)
        assert out.error is None and done["ok"] is True, done
        assert not any(d_follower.backend.read_slots(slots))  # staged, not landed yet
        d0.land(6)
        assert d0.checksum(slots) == done["checksums"][0]
        assert decode._shard_checksums(6, done["checksums"], slots) == ""
        assert d0.read_slots(slots) == p0.read_slots(slots)
        assert d_follower.backend.read_slots(slots) == p_follower.backend.read_slots(slots)
        decode.shards.release(6)
        d0.release(6)
        assert d0.descriptor(6).staging is None
    finally:
        rooms.close()
        decode.close()
        for f in (p_follower, d_follower):
            f.close()
        control.close()
        for b in (p0, d0):
            b.close()
        inbox.close(linger=0)
        ctx.term()
