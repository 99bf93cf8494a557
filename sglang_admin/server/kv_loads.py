"""EngineLoad records on the KV event stream (KvEventBatch.load), as smg-grpc-proto 0.4.28.

A subscriber of SubscribeKvEvents learns each rank's load from the stream instead of its
GetLoads poll: every batch carries the load of its rank when it is sent (the routing core:
running and waiting requests, uncached waiting tokens, KV usage, throughput, admission
window); and a ``load_only`` batch (no events, the rank's last sequence on this stream)
goes out when a rank's published state changed without a KV event and, while the rank is
quiet, every HEARTBEAT_S. A stream's first record of a rank and the load-only ones carry
the rest of GetLoads' figures too (memory, queues, speculative, LoRA, disaggregation).
With ``load_records_before_first_batch`` a rank's load-only records start at once,
numbered 0; without it a rank's first record rides its first batch.

The figures are the ones GetLoads answers with (server/info_service.py's ``_load_proto``
reads the same published RankState).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from sglang_admin.messages import RankState
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import Serialized
from sglang_admin.server.kv_events import KvSubscription

HEARTBEAT_S = 1.0  # a quiet rank's load-only record, at least this often
TICK_S = 0.1  # how often a stream looks for changed states between batches


def engine_load(state: RankState, age_s: float, sample: int, load_only: bool = False,
                full: bool = False, spec_on: bool = False) -> pb.EngineLoad:
    """The EngineLoad record of one rank's published state (``full``: with the telemetry
    beyond the routing core)."""
    capacity = max(state.token_capacity, 1)
    load = pb.EngineLoad(
        running_requests=state.num_running_reqs,
        waiting_requests=state.num_waiting_reqs,
        waiting_uncached_tokens=state.num_waiting_uncached_tokens,
        token_usage=state.num_used_tokens / capacity,
        gen_throughput=state.gen_throughput,
        max_running_requests=state.max_running_requests,
        age_ms=int(max(0.0, age_s) * 1000),
        sample=sample,
        load_only=load_only,
    )
    if full:
        load.cache_hit_rate = state.cache_hit_rate
        load.num_used_tokens = state.num_used_tokens
        load.max_total_num_tokens = state.token_capacity
        load.memory.CopyFrom(pb.EngineMemory(
            weight_gb=state.weight_gb, kv_cache_gb=state.kv_cache_gb, graph_gb=state.graph_gb,
            token_capacity=state.token_capacity))
        load.queues.CopyFrom(pb.EngineQueues(
            waiting=state.num_waiting_reqs, grammar=state.num_grammar_queue_reqs,
            paused=state.num_paused_reqs, retracted=state.num_retracted_reqs))
        load.disaggregation.CopyFrom(pb.EngineDisaggregation(mode="null"))
        if state.lora_slots_total:
            load.lora.CopyFrom(pb.EngineLora(
                slots_used=state.lora_slots_used, slots_total=state.lora_slots_total,
                utilization=state.lora_slots_used / state.lora_slots_total))
        if spec_on:
            load.speculative.CopyFrom(pb.EngineSpeculative(
                accept_length=state.spec_accept_length, accept_rate=state.spec_accept_rate))
    return load


class LoadFeed:
    """The load records of one stream: what each rank's last record was and when."""

    def __init__(self, states: Callable[[], list[RankState | None]],
                 age: Callable[[int], float], before_first_batch: bool,
                 spec_on: bool = False) -> None:
        self.states = states
        self.age = age
        self.before_first_batch = before_first_batch
        self.spec_on = spec_on
        self.sample = 0
        self.last_seq: dict[int, int] = {}  # rank -> last sequence sent on this stream
        self.recorded: dict[int, tuple[RankState, float]] = {}  # rank -> (state, monotonic)

    def _record(self, rank: int, state: RankState, load_only: bool) -> pb.EngineLoad:
        self.sample += 1
        full = load_only or rank not in self.recorded
        self.recorded[rank] = (state, time.monotonic())
        return engine_load(state, self.age(rank), self.sample, load_only, full, self.spec_on)

    def with_load(self, batch: pb.KvEventBatch) -> Serialized | pb.KvEventBatch:
        """``batch`` with its rank's load (the shared batch is not modified: the load is
        appended in wire form, which protobuf merges into the message)."""
        rank = batch.dp_rank
        self.last_seq[rank] = batch.sequence_number
        states = self.states()
        state = states[rank] if 0 <= rank < len(states) else None
        if state is None:
            return batch
        extra = pb.KvEventBatch(load=self._record(rank, state, load_only=False))
        return Serialized(batch.SerializeToString() + extra.SerializeToString())

    def load_only(self) -> list[pb.KvEventBatch]:
        """The load-only batches due now: a rank whose state changed since its last record,
        or that had none for HEARTBEAT_S."""
        out = []
        now = time.monotonic()
        for rank, state in enumerate(self.states()):
            if state is None or (rank not in self.last_seq and not self.before_first_batch):
                continue
            last = self.recorded.get(rank)
            if last is not None and last[0] is state and now - last[1] < HEARTBEAT_S:
                continue
            out.append(pb.KvEventBatch(
                sequence_number=self.last_seq.get(rank, 0), timestamp=time.time(),
                dp_rank=rank, load=self._record(rank, state, load_only=True)))
        return out


async def batches_with_loads(sub: KvSubscription, feed: LoadFeed
                             ) -> AsyncIterator[Serialized | pb.KvEventBatch]:
    """The subscription's batches, each with its rank's load, and load-only batches between
    them (see the module docstring)."""
    source = sub.batches().__aiter__()
    pending: asyncio.Future | None = None
    try:
        for record in feed.load_only():
            yield record
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=TICK_S)
            if done:
                future, pending = pending, None
                try:
                    batch = future.result()
                except StopAsyncIteration:
                    return
                yield feed.with_load(batch)
            for record in feed.load_only():
                yield record
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await source.aclose()
