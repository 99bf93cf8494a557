"""The rank's loop (scheduler/rank/loop.py) driven in-process over inproc ZMQ sockets: what it
sends, in which order, for messages that arrive while a step runs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from sglang_admin.config import ServerArgs
from sglang_admin.messages import (
    AdminReply,
    BatchOutput,
    FlushCacheReq,
    GenerateReq,
    KvEvents,
    RankState,
    ReadyMsg,
    SamplingParams,
    StateReq,
    StateUpdate,
    decode,
    encode,
)
from sglang_admin.scheduler.rank.loop import STATE_PUBLISH_INTERVAL_S, Rank
from sglang_admin.scheduler.rank.process import handler_table


class Wires:
    """A Rank between two inproc sockets of the test: ``to_rank`` and ``from_rank``."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        inbox = self.ctx.socket(zmq.PULL)
        inbox.bind("inproc://rank-in")
        self.to_rank = self.ctx.socket(zmq.PUSH)
        self.to_rank.connect("inproc://rank-in")
        self.from_rank = self.ctx.socket(zmq.PULL)
        self.from_rank.bind("inproc://rank-out")
        outbox = self.ctx.socket(zmq.PUSH)
        outbox.connect("inproc://rank-out")
        self.sockets = (inbox, self.to_rank, self.from_rank, outbox)
        self.loop = Rank(ServerArgs(), 0, inbox, outbox, os.getppid(), handler_table())

    def send(self, msg: Any) -> None:
        self.to_rank.send(encode(msg))

    def received(self) -> list[Any]:
        """Everything the rank has sent so far, in order."""
        out = []
        while self.from_rank.poll(0):
            out.append(decode(self.from_rank.recv()))
        return out

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def wires() -> Iterator[Wires]:
    w = Wires()
    yield w
    w.close()


def test_a_state_request_that_arrives_during_a_step_is_answered_before_its_outputs(
    wires: Wires,
) -> None:
    """The server writes a step's stream messages as soon as it reads them; an admin answer
    sent after them waits behind every one (GetServerInfo under load, bench_admin figure 4)."""
    loop = wires.loop
    assert isinstance(wires.received()[0], ReadyMsg)
    wires.send(GenerateReq("r1", list(range(1, 9)), SamplingParams(max_new_tokens=8,
                                                                   ignore_eos=True)))
    loop.drain_inbox(block=False)
    loop.step(loop.scheduler.schedule())  # the prefill step: first token
    wires.received()
    wires.send(StateReq("state-1"))  # arrives while the next step is being computed
    batch = loop.scheduler.schedule()
    assert batch is not None and batch.is_decode
    loop.step(batch)
    sent = [m for m in wires.received() if isinstance(m, (AdminReply, BatchOutput))]
    assert [type(m) for m in sent] == [AdminReply, BatchOutput]
    reply, output = sent
    assert reply.rid == "state-1" and reply.success
    state = reply.result
    assert state.forward_steps == 2  # the state after the step's forward pass
    assert state.num_running_reqs == 1
    assert [o.rid for o in output.outputs] == ["r1"] and len(output.outputs[0].new_token_ids) == 1


def test_messages_handled_during_a_step_are_not_counted_as_its_serving_time(
    wires: Wires,
) -> None:
    """The decode phase totals (non-model share of issue 16) cover the step's own work."""
    loop = wires.loop
    wires.send(GenerateReq("r1", list(range(1, 9)), SamplingParams(max_new_tokens=4,
                                                                   ignore_eos=True)))
    loop.drain_inbox(block=False)
    loop.step(loop.scheduler.schedule())
    slow = loop.handlers[StateReq]

    def handle_slowly(rank: Rank, msg: StateReq) -> None:
        import time

        time.sleep(0.2)
        slow(rank, msg)

    loop.handlers[StateReq] = handle_slowly
    wires.send(StateReq("state-1"))
    loop.step_timer.start()
    batch = loop.scheduler.schedule()
    loop.step(batch)
    loop.step_timer.commit(batch.is_decode)
    assert loop.step_timer.decode_steps == 1
    assert sum(loop.step_timer.totals.values()) < 0.2
    assert any(isinstance(m, AdminReply) for m in wires.received())


def test_an_op_waiting_for_a_drained_rank_answers_after_the_outputs_it_waited_for(
    wires: Wires,
) -> None:
    """A flush that arrives during the step that finishes the last request: the request's
    final output reaches the server first, then the flush's answer."""
    loop = wires.loop
    wires.send(GenerateReq("r1", list(range(1, 9)), SamplingParams(max_new_tokens=2,
                                                                   ignore_eos=True)))
    loop.drain_inbox(block=False)
    loop.step(loop.scheduler.schedule())  # prefill: the first of two tokens
    wires.received()
    wires.send(FlushCacheReq("flush-1", 5.0))
    loop.step(loop.scheduler.schedule())  # the second token: r1 finishes
    assert not loop.scheduler.running
    loop.drain_inbox(block=False)  # the loop's next iteration
    sent = [m for m in wires.received() if isinstance(m, (AdminReply, BatchOutput))]
    assert [type(m) for m in sent] == [BatchOutput, AdminReply]
    final = sent[0].outputs[0]
    assert (final.rid, final.finish_reason, final.completion_tokens) == ("r1", "length", 2)
    assert sent[1].rid == "flush-1" and sent[1].success


def test_a_flush_sends_cleared_the_freed_state_and_its_answer_and_no_state_that_did_not_change(
    wires: Wires,
) -> None:
    """An idle flush: "cleared", the state it freed (GetLoads shows it once FlushCache
    returned) and the answer, in that order; a flush of the empty cache sends no state (the
    server has it), and what it sends is what the rank's state() reports."""
    loop = wires.loop
    wires.send(GenerateReq("r1", list(range(1, 9)), SamplingParams(max_new_tokens=1,
                                                                   ignore_eos=True)))
    loop.drain_inbox(block=False)
    loop.step(loop.scheduler.schedule())
    loop.publish_state(force=True)
    assert loop.scheduler.cache.evictable_size > 0  # the prompt is cached
    wires.received()
    for rid in ("flush-1", "flush-2"):
        wires.send(FlushCacheReq(rid, 0.0))
        loop.drain_inbox(block=False)
        sent = wires.received()
        kinds = [type(m) for m in sent]
        if rid == "flush-1":
            assert kinds == [KvEvents, StateUpdate, AdminReply]
            state = sent[1].state
            assert state.num_evictable_tokens == 0
            assert state.num_free_tokens == state.token_capacity == loop.runner.token_capacity
            assert state == loop.last_state
        else:
            assert kinds == [KvEvents, AdminReply]
        assert sent[0].events == [["cleared"]] and sent[-1].rid == rid and sent[-1].success
    # every figure lands in its own field (state() fills RankState by position)
    state = loop.state()
    assert len(loop._state_figures()) == len(dataclasses.fields(RankState)) - 1
    assert (state.dp_rank, state.device, state.pid) == (0, str(loop.runner.device), os.getpid())
    assert state.max_running_requests == loop.args.max_running_requests
    assert state.forward_steps == loop.forward_steps == 1 and state.timestamp > 1e9
    assert state.decode_phase_s == loop.step_timer.totals and state.lora_slots_total == 0
    assert state.profiler_state == "idle" and state.paused == "" and not state.flush_pending


def test_the_state_is_published_when_it_changed_at_most_every_interval_unless_forced(
    wires: Wires,
) -> None:
    """publish_state: a forced call sends a changed state at once and nothing when it did
    not change; an unforced one sends a change of a key figure once STATE_PUBLISH_INTERVAL_S
    went by since the last send, and an unchanged state never."""
    loop = wires.loop
    wires.received()

    def states() -> list[Any]:
        return [m.state for m in wires.received() if isinstance(m, StateUpdate)]

    loop.publish_state(force=True)
    assert states() == []  # the server has it (the ready message carried it)
    loop.scheduler.paused = "retract"  # a key figure changes
    loop.publish_state()
    assert states() == []  # within the interval of the last send
    loop.last_state_sent -= STATE_PUBLISH_INTERVAL_S
    loop.publish_state()
    assert [st.paused for st in states()] == ["retract"]
    loop.last_state_sent -= 2.0  # a second went by: figures compared, nothing changed
    loop.publish_state()
    assert states() == []
    loop.scheduler.paused = None
    loop.publish_state(force=True)  # forced: at once
    assert [st.paused for st in states()] == [""]
    loop.publish_state(force=True)
    assert states() == []


@pytest.mark.parametrize("req", [
    GenerateReq("plain", [1, 2, 3], SamplingParams()),
    GenerateReq("min-new", [1, 2, 3], SamplingParams(min_new_tokens=2)),
    GenerateReq("sampled", [1, 2, 3], SamplingParams(temperature=0.8)),
    GenerateReq("logprobs", [1, 2, 3], SamplingParams(), return_logprob=True),
    GenerateReq("top", [1, 2, 3], SamplingParams(), top_logprobs_num=2),
    GenerateReq("hidden", [1, 2, 3], SamplingParams(), return_hidden_states=True),
    GenerateReq("prompt-lps", [1, 2, 3], SamplingParams(), return_logprob=True,
                logprob_start_len=0),
])
def test_the_scheduler_never_claims_a_plain_argmax_the_fields_do_not(req: GenerateReq) -> None:
    """batch_inputs passes each request's argmax_from, worked out once; it must be at least
    what the runner works out from the sequence's own fields (the runner takes the argmax
    alone from there on)."""
    import dataclasses

    from sglang_admin.scheduler.rank.model_step import batch_inputs
    from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(token_capacity=64, max_running_requests=4,
                                      max_prefill_tokens=64, context_length=64,
                                      eos_token_ids=(0,)))
    sched.add_request(req)
    (seq,) = batch_inputs(sched.schedule())
    from_fields = dataclasses.replace(seq, argmax_from=None).argmax_from
    assert seq.argmax_from >= from_fields
    if req.rid in ("plain", "min-new"):
        assert seq.argmax_from == from_fields == req.sampling.min_new_tokens


def test_batch_inputs_fills_every_field_of_the_sequence_with_its_request_s_value() -> None:
    """batch_inputs gives every field of SeqInput its request's own value (the request's
    state sits in groups: sampling, LoRA, logprobs, hidden states), compared here with the
    same sequence built by keyword from the request."""
    from sglang_admin.model.step_io import SeqInput
    from sglang_admin.scheduler.rank.model_step import batch_inputs
    from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(token_capacity=64, max_running_requests=4,
                                      max_prefill_tokens=64, context_length=64,
                                      eos_token_ids=(0,)))
    sched.add_request(GenerateReq("all", [1, 2, 3], SamplingParams(temperature=0.5),
                                  return_logprob=True, top_logprobs_num=3,
                                  logprob_start_len=1, token_ids_logprob=[5, 6]))
    batch = sched.schedule()
    (seq,) = batch_inputs(batch)
    (span,) = batch.spans
    req = span.req
    assert seq == SeqInput(
        req_idx=req.req_idx, prefix_len=0, token_ids=[1, 2, 3], table_start=span.table_start,
        table_slots=req.slots[span.table_start : 3], sampling=req.sampling.params,
        prompt_ids=[1, 2, 3], output_ids=[], sample=True, return_logprob=True,
        top_logprobs_num=3, lora_slot=-1, logprob_start_len=1, token_ids_logprob=[5, 6],
        return_hidden_states=False, grammar=None, argmax_from=req.argmax_from)
    assert seq.prompt_ids is req.prompt_ids and seq.output_ids is req.output_ids  # not copied
