"""Resuming SubscribeKvEvents from a cursor on a worker with several data-parallel ranks.

The SMG gateway (1.13) keeps one cursor per rank, skips a batch at its rank's cursor as
stale, takes one below it for a restarted publisher (it clears the worker's index) and one
above cursor + 1 for a gap, and resumes with one number: the highest sequence it applied. ``Gateway`` below does the same, so the tests check what the
gateway's index ends up holding, not only what goes over the wire.
"""

from __future__ import annotations

import grpc
import pytest

from sglang_admin.messages import KvEvents
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.kv_events import KvEventHub
from tests.unit.test_kv_events import GatewayView

B = 4


class Gateway:
    """The gateway's side of one worker: a cursor per rank and one pooled index."""

    def __init__(self) -> None:
        self.cursor: dict[int, int] = {}
        self.view = GatewayView(B)
        self.applied: list[tuple[int, int]] = []  # (rank, sequence) of each batch applied
        self.stale = 0

    def take(self, batch: pb.KvEventBatch) -> None:
        last = self.cursor.get(batch.dp_rank)
        if last is not None and batch.sequence_number == last:
            self.stale += 1
            return
        assert last is None or batch.sequence_number > last, (
            f"rank {batch.dp_rank} went back from {last} to {batch.sequence_number}: "
            "the gateway would take it for a restart and clear the index")
        assert last is None or batch.HasField("snapshot") or batch.sequence_number == last + 1, (
            f"gap on rank {batch.dp_rank}: {last} then {batch.sequence_number}")
        for event in batch.events:
            self.view.apply(event)
        self.cursor[batch.dp_rank] = batch.sequence_number
        self.applied.append((batch.dp_rank, batch.sequence_number))

    def resume_from(self) -> int:
        return max(self.cursor.values())


def drain(sub) -> list[pb.KvEventBatch]:
    """What the stream sends now; it keeps the subscription's cursors as its sender does."""
    out = list(sub.initial)
    sub.initial = []
    while not sub.queue.empty():
        batch = sub.queue.get_nowait()
        if batch is not None:
            out.append(batch)
    for batch in out:
        sub.cursors[batch.dp_rank] = batch.sequence_number
    return out


def step(hub: KvEventHub, rank: int, node: int, parent: int | None) -> None:
    """One request's worth of KV events on ``rank``: a node of one block."""
    tokens = [rank * 100 + node] * B
    hub.publish(KvEvents(rank, [["stored", node, parent, tokens]]))


def test_two_ranks_resume_with_exactly_the_missed_batches() -> None:
    hub = KvEventHub(2, block_size=B, base=1000)
    always = Gateway()  # a subscriber that never dropped its stream: the reference
    always_sub = hub.subscribe(0)
    gw = Gateway()
    sub = hub.subscribe(0)
    # rank 0 runs ahead of rank 1, so their numbers overlap and differ
    for node in range(1, 6):
        step(hub, 0, node, node - 1 if node > 1 else None)
    step(hub, 1, 1, None)
    step(hub, 1, 2, 1)
    for batch in drain(sub):
        gw.take(batch)
    hub.unsubscribe(sub)  # the stream drops here
    emitted_before = hub.sent
    step(hub, 1, 3, 2)
    step(hub, 0, 6, 5)
    hub.publish(KvEvents(0, [["removed", [6]]]))
    step(hub, 1, 4, 3)
    missed = [(rank, b.sequence_number) for place, rank, b in sorted(
        (place, rank, b) for rank in (0, 1)
        for b, place in zip(hub.ranks[rank].history, hub.ranks[rank].history_order)
        if place >= emitted_before)]  # in the order they went out
    assert len(missed) == 4

    resumed = hub.subscribe(gw.resume_from())
    replay = drain(resumed)
    assert not any(b.HasField("snapshot") for b in replay)  # a replay, not a new snapshot
    for batch in replay:
        gw.take(batch)
    # exactly the missed batches came, in the order they went out; the gateway applied
    # them all, and its index is the one a subscriber that never dropped holds
    assert [(b.dp_rank, b.sequence_number) for b in replay] == missed
    assert gw.stale == 0 and gw.applied[-len(missed):] == missed
    for batch in drain(always_sub):
        always.take(batch)
    assert gw.view.blocks == always.view.blocks and gw.cursor == always.cursor
    # live batches follow the replay with no gap
    step(hub, 1, 5, 4)
    for batch in drain(resumed):
        gw.take(batch)
    assert gw.cursor[1] == hub.ranks[1].seq


def test_two_ranks_resume_right_after_a_snapshot() -> None:
    hub = KvEventHub(2, block_size=B, base=50)
    step(hub, 0, 1, None)
    step(hub, 1, 1, None)
    step(hub, 1, 2, 1)
    gw = Gateway()
    sub = hub.subscribe(0)
    for batch in drain(sub):
        gw.take(batch)
    hub.unsubscribe(sub)
    step(hub, 0, 2, 1)
    resumed = hub.subscribe(gw.resume_from())
    for batch in drain(resumed):
        gw.take(batch)
    assert gw.cursor == {0: hub.ranks[0].seq, 1: hub.ranks[1].seq}
    assert (0, hub.ranks[0].seq) in gw.applied
    assert len(gw.view.blocks) == 4


def test_idle_ranks_resume_from_their_base() -> None:
    hub = KvEventHub(2, block_size=B, base=7)
    gw = Gateway()
    sub = hub.subscribe(0)  # an idle worker: rank 0's snapshot is one clear at the base
    for batch in drain(sub):
        gw.take(batch)
    hub.unsubscribe(sub)
    step(hub, 1, 1, None)
    step(hub, 0, 1, None)
    replay = drain(hub.subscribe(gw.resume_from()))
    assert [(b.dp_rank, b.sequence_number) for b in replay] == [(1, 8), (0, 8)]
    for batch in replay:
        gw.take(batch)


def test_two_ranks_cursor_older_than_the_history_is_out_of_range(monkeypatch) -> None:
    import sglang_admin.server.kv_events as kv

    monkeypatch.setattr(kv, "HISTORY_BATCHES", 2)
    hub = KvEventHub(2, block_size=B, base=0)
    gw = Gateway()
    sub = hub.subscribe(0)
    step(hub, 0, 1, None)
    step(hub, 1, 1, None)
    for batch in drain(sub):
        gw.take(batch)
    hub.unsubscribe(sub)
    for node in range(2, 6):  # rank 0 goes on; its history keeps its last two batches
        step(hub, 0, node, node - 1)
    with pytest.raises(ServiceError) as err:
        hub.subscribe(gw.resume_from())
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert "rank 0 no longer reaches back to sequence 2" in str(err.value)


def test_two_ranks_cursor_of_no_ended_stream_is_out_of_range() -> None:
    hub = KvEventHub(2, block_size=B, base=0)
    step(hub, 0, 1, None)
    step(hub, 1, 1, None)
    for bad in (1, 9, 2 ** 40):  # no stream ended there, ahead of every rank, another run
        with pytest.raises(ServiceError) as err:
            hub.subscribe(bad)
        assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
        assert "names no stream this worker ended lately" in str(err.value)


def test_fuzzed_cursors_resume_or_are_out_of_range() -> None:
    import random

    rng = random.Random(7)
    hub = KvEventHub(2, block_size=B, base=1 << 40)
    gw = Gateway()
    sub = hub.subscribe(0)
    for node in range(1, 30):
        step(hub, node % 2, node, None)
        if node % 7 == 0:
            for batch in drain(sub):
                gw.take(batch)
            hub.unsubscribe(sub)
            sub = hub.subscribe(gw.resume_from())
    for batch in drain(sub):
        gw.take(batch)
    hub.unsubscribe(sub)
    good = gw.resume_from()
    cursors = [good, good - 1, good + 1, 1, 2 ** 64 - 1, 2 ** 63, hub.ranks[0].base]
    cursors += [rng.randrange(1, 2 ** 64) for _ in range(200)]
    cursors += [good + rng.randrange(-40, 40) for _ in range(200)]
    for cursor in cursors:
        if cursor <= 0:
            continue
        try:
            resumed = hub.subscribe(cursor)
        except ServiceError as err:
            assert err.code == grpc.StatusCode.OUT_OF_RANGE and str(err), cursor
            continue
        # the highest of a stream that ended (this one's or an earlier): each rank's batches
        # after that stream's cursor, consecutive, up to the rank's current sequence
        assert cursor in {max(c.values()) for c in hub.ended}, cursor
        for r, rank in enumerate(hub.ranks):
            seqs = [b.sequence_number for b in resumed.initial if b.dp_rank == r]
            assert seqs == list(range(resumed.cursors[r] + 1, rank.seq + 1)), (cursor, r)
        assert cursor != good or resumed.initial == []  # the gateway's own: up to date
        hub.subscribers.discard(resumed)
    assert gw.cursor == {0: hub.ranks[0].seq, 1: hub.ranks[1].seq}
