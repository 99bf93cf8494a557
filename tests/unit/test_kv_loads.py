"""EngineLoad records on the KV event stream (server/kv_loads.py): every batch carries its
rank's load, load-only batches follow a changed state or a quiet second, and a subscriber
that asks gets them before a rank's first batch."""

from __future__ import annotations

import asyncio

from sglang_admin.messages import KvEvents, RankState
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server import kv_loads
from sglang_admin.server.errors import Serialized
from sglang_admin.server.kv_events import KvEventHub
from sglang_admin.server.kv_loads import LoadFeed, batches_with_loads, engine_load

B = 4


def state(rank: int, running: int = 0, used: int = 0) -> RankState:
    return RankState(dp_rank=rank, num_running_reqs=running, num_waiting_reqs=1,
                     token_capacity=100, num_used_tokens=used, max_running_requests=8,
                     num_waiting_uncached_tokens=7, gen_throughput=12.5)


def decode(item: Serialized | pb.KvEventBatch) -> pb.KvEventBatch:
    return pb.KvEventBatch.FromString(item.data) if isinstance(item, Serialized) else item


def test_the_record_has_getloads_figures() -> None:
    load = engine_load(state(0, running=3, used=25), 0.25, sample=4, full=True)
    assert (load.running_requests, load.waiting_requests, load.waiting_uncached_tokens) == (3, 1, 7)
    assert load.token_usage == 0.25 and load.max_running_requests == 8 and load.age_ms == 250
    assert load.sample == 4 and load.memory.token_capacity == 100
    assert load.disaggregation.mode == "null" and not load.HasField("speculative")
    core = engine_load(state(0), 0.0, sample=5)
    assert not core.HasField("memory") and not core.HasField("num_used_tokens")


def test_stream_batches_carry_loads_and_load_only_records_follow() -> None:
    async def go() -> None:
        states = [state(0), state(1)]
        hub = KvEventHub(2, block_size=B, base=100)
        sub = hub.subscribe(0)  # an idle worker: one clear, from rank 0
        feed = LoadFeed(lambda: states, lambda rank: 0.0, before_first_batch=False)
        stream = batches_with_loads(sub, feed)
        first = decode(await stream.__anext__())
        assert first.dp_rank == 0 and first.load.running_requests == 0
        assert not first.load.load_only and first.load.HasField("memory")  # its first record
        hub.publish(KvEvents(dp_rank=0, events=[["stored", 1, None, [1] * B]]))
        live = decode(await stream.__anext__())
        assert live.sequence_number == 101 and live.load.sample == 2
        assert not live.load.HasField("memory")  # the routing core only on event batches
        states[0] = state(0, running=2)  # a state change without a KV event
        only = decode(await stream.__anext__())
        assert only.load.load_only and only.load.running_requests == 2
        assert only.sequence_number == 101 and not only.events and only.dp_rank == 0
        # rank 1 sent no batch on this stream: no record for it unless asked
        assert 1 not in feed.recorded
        await stream.aclose()

    asyncio.run(go())


def test_asked_for_records_come_before_a_ranks_first_batch(monkeypatch) -> None:
    monkeypatch.setattr(kv_loads, "HEARTBEAT_S", 0.05)

    async def go() -> None:
        states = [state(0), state(1)]
        hub = KvEventHub(2, block_size=B, base=100)
        sub = hub.subscribe(0)  # an idle worker: one clear, from rank 0
        feed = LoadFeed(lambda: states, lambda rank: 0.0, before_first_batch=True)
        stream = batches_with_loads(sub, feed)
        got = [decode(await stream.__anext__()) for _ in range(5)]
        # numbered 0 before any batch of the rank, then rank 0's clear with its load, then
        # heartbeats: rank 0 at its last sequence, rank 1 still at 0
        assert [(b.dp_rank, b.sequence_number, b.load.load_only) for b in got[:3]] == [
            (0, 0, True), (1, 0, True), (0, 100, False)]
        assert got[2].events[0].HasField("cleared")
        assert {(b.dp_rank, b.sequence_number, b.load.load_only) for b in got[3:]} == {
            (0, 100, True), (1, 0, True)}
        samples = [b.load.sample for b in got]
        assert samples == sorted(samples) and len(set(samples)) == 5
        await stream.aclose()

    asyncio.run(go())
