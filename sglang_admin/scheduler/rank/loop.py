"""One scheduler rank's event loop, around its Scheduler and ModelRunner.

Loop: drain the inbox without blocking -> handle messages (each type's handler registered in
scheduler/ops/) -> run the admin ops whose time came -> schedule a batch -> forward + sample
(model_step.py) -> send outputs. It blocks on the inbox only when there is no work.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq

from sglang_admin.config import ServerArgs
from sglang_admin.messages import (
    AdminReply,
    BatchOutput,
    KvEvents,
    RankState,
    ReadyMsg,
    ReqOutput,
    StateUpdate,
    decode,
    encode,
)
from sglang_admin.scheduler import late_imports
from sglang_admin.scheduler.ops.quiesce import Quiesce
from sglang_admin.scheduler.ops.registry import op_name
from sglang_admin.scheduler.profiling.step_timing import StepTimer
from sglang_admin.scheduler.rank.model_step import batch_inputs, forward
from sglang_admin.scheduler.reasoning import think_end_id
from sglang_admin.scheduler.tp.profile import remote_trace_shipment
from sglang_admin.tracing import child_span, trace_id_of

if TYPE_CHECKING:
    from sglang_admin.scheduler.ops.registry import Handler
    from sglang_admin.scheduler.rank.builder import RankParts
    from sglang_admin.scheduler.request import Batch

logger = logging.getLogger(__name__)
STATE_PUBLISH_INTERVAL_S = 0.05
IDLE_POLL_MS = 500
# plain ints: pyzmq's enum constants cost an enum operation on every use
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_CLEARED = ["cleared"]  # the radix cache's event of a flush (scheduler/radix_cache.py)


# RankState's fields after its timestamp (_state_figures' last ones)
_AFTER_TIMESTAMP = 9


class Rank:
    """One scheduler rank: its state and its event loop. The handlers of the control
    messages (scheduler/ops/) get the Rank they run on."""

    def __init__(
        self,
        args: ServerArgs,
        rank: int,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
        parent_pid: int,
        handlers: dict[type, Handler],
        parts: RankParts,
    ) -> None:
        """``parts``: the model runner, scheduler, draft model and LoRA slots the rank runs on
        (scheduler/rank/builder.py's ``build_rank``)."""
        from sglang_admin.scheduler.ops.weight_groups import WeightGroups
        from sglang_admin.scheduler.profiling.profiler import Profiler

        self.args, self.rank, self.inbox, self.outbox = args, rank, inbox, outbox
        self.parent_pid = parent_pid
        # encoded messages held to leave together (see together()); None: each goes at once
        self.held: list[bytes] | None = None
        self._recv_timeout = -1  # the inbox's RCVTIMEO (ms) as last set by _wait
        self._together = _Together(self)
        self._cleared: bytes | None = None  # KvEvents(rank, [["cleared"]]), encoded once
        self.runner, self.tensor_parallel = parts.runner, parts.tensor_parallel
        info = self.runner.info
        # what every state reports and never changes, made once (not on every GetServerInfo)
        self._device, self._pid = str(self.runner.device), os.getpid()
        self.kv_events: list[list[Any]] = parts.kv_events  # the scheduler's radix cache fills it
        self.trace_ids: dict[str, str] = {}  # rid -> caller's trace id (for --log-requests)
        self.scheduler = parts.scheduler
        self.draft_runner = parts.draft_runner
        from sglang_admin.disaggregation.rank import attach_pd

        self.pd = attach_pd(args, rank, self.runner, self.scheduler,  # None: not PD
                            lambda: self.model_info.weight_version, self.tensor_parallel)
        self.profiler = Profiler(rank, str(self.runner.device), args.profile_max_steps)
        self.quiesce = Quiesce(self.scheduler)
        self.handlers = handlers
        self.lora = parts.lora  # None unless --enable-lora
        # admin messages answered when their future resolves (StopProfile's export)
        self.deferred: list[tuple[Any, Future]] = []
        self.forward_steps = 0
        self.step_started = 0.0  # wall time of the current step's start (the heartbeat's)
        self.state_confirmed = time.time()  # when the server's copy of the state was checked
        self.last_step_time = 0.0
        self.step_timer = StepTimer()  # decode steps' time by phase (step_timing.py)
        self.last_state_sent = 0.0
        self.last_state_key: tuple = ()
        self.last_state: RankState | None = None  # the last state the server was sent
        self._last_figures: tuple = ()  # its figures (_state_figures)
        self.running = True
        self.model_info = info
        info.token_capacity = self.runner.token_capacity
        info.kv_cache_bytes = self.runner.kv_cache_bytes
        info.device = str(self.runner.device)
        info.think_end_id = think_end_id(
            self.args.reasoning_parser, self.args.tokenizer_path or info.tokenizer_path)
        self.scheduler.think_end_id = info.think_end_id
        self.weights_source: str | None = info.model_path
        self.weights_valid = True
        self.released_digest: str | None = None
        self.weight_sync = WeightGroups()  # a trainer's process groups (scheduler/ops/weight_sync_control.py)
        self._last_figures = self._state_figures()
        self.last_state = self._state_of(self._last_figures)
        # torch._dynamo and xgrammar: off the path to READY unless the heartbeat probe is
        # too short for the GIL they hold (scheduler/late_imports.py)
        late_imports.import_before_ready(args.watchdog_probe_timeout_s)
        self.send(ReadyMsg(rank, os.getpid(), info, self.last_state))
        # a PD leg imports the grammar's at once: a router gives up on a leg silent for 3 s,
        # which a first grammar waiting for its imports can be on a loaded machine
        late_imports.start_in_background(
            grammar_at_once=args.disaggregation_mode != "null")
        logger.info(
            "rank %d ready: %s on %s, %d KV tokens",
            rank, info.model_path, self.runner.device, self.runner.token_capacity,
        )

    # ------------------------------------------------------------------ io

    def send(self, msg: Any) -> None:
        self.send_encoded(encode(msg))

    def send_encoded(self, data: bytes) -> None:
        """Send an encoded message (held while inside :meth:`together`)."""
        if self.held is not None:
            self.held.append(data)
        else:
            self.outbox.send(data, copy=False)

    def together(self) -> _Together:
        """Messages sent inside leave as the parts of one ZMQ message, in order: one write
        and one wake-up of the server instead of one each (a step's outputs, its KV events
        and its state; a flush's "cleared", state and answer). The server reads each part
        as a message of its own."""
        return self._together

    def _hold(self) -> bool:
        """Start holding what is sent; False when already holding (an outer block sends)."""
        if self.held is not None:
            return False
        self.held = []
        return True

    def _send_held(self) -> None:
        held, self.held = self.held, None
        if not held:
            return
        last = held.pop()
        for part in held:  # send_multipart's checks and enum flags cost more than the sends
            self.outbox.send(part, _SNDMORE, copy=False)
        self.outbox.send(last, 0, copy=False)

    def state(self) -> RankState:
        return self._state_of(self._state_figures())

    def _state_figures(self) -> tuple:
        """Every figure of :meth:`state` but its timestamp, in RankState's field order: a
        plain tuple, compared with the last one published before any RankState is made."""
        s = self.scheduler
        lora = self.lora
        return (
            self.rank, len(s.running), len(s.waiting), s.allocator.capacity,
            s.num_used_tokens, s.cache.evictable_size, s.num_free_tokens, s.cache_hit_rate,
            s.gen_throughput(), self.profiler.reported_state, self.last_step_time,
            self.forward_steps, self._device, self._pid, self.quiesce.waiting("flush_cache"),
            self.scheduler.paused or "", s.waiting_uncached_tokens(), s.num_retracted,
            s.config.max_running_requests, self.runner.weight_bytes / 2**30,
            self.runner.kv_cache_bytes / 2**30, self.step_timer.decode_steps,
            dict(self.step_timer.totals),
            # after the timestamp (filled in by _state_of):
            lora.used if lora is not None else 0, lora.slots if lora is not None else 0,
            s.num_grammar_queue_reqs, s.spec.verify_steps, s.spec.drafted, s.spec.accepted,
            self._graph_gb(), len(s.running) + len(s.waiting) if s.paused else 0,
            self.pd.figures() if self.pd is not None else {},
        )

    def _graph_gb(self) -> float:
        graphs = getattr(self.runner, "graphs", None)
        return graphs.graph_bytes / 2**30 if graphs is not None else 0.0

    @staticmethod
    def _state_of(figures: tuple) -> RankState:
        return RankState(*figures[:-_AFTER_TIMESTAMP], time.time(),
                         *figures[-_AFTER_TIMESTAMP:])

    def publish_state(self, force: bool = False) -> None:
        """Send the rank's state when it changed: at once when ``force``d, else when a key
        figure changed (at most every STATE_PUBLISH_INTERVAL_S) or a second went by."""
        now = time.monotonic()
        # The key fields are checked now (published below if they changed): the heartbeat
        # tells the server how old its copy of this rank's state is.
        self.state_confirmed = time.time()
        if force:
            # every figure is compared below; the key is taken again by the next check
            # (a flush answers sooner without it)
            self.last_state_key = ()
        else:
            s = self.scheduler
            key = (len(s.running), len(s.waiting), s.num_used_tokens, s.num_free_tokens,
                   self.profiler.reported_state,
                   self.quiesce.pending, s.paused, s.num_grammar_queue_reqs,
                   self.pd.queue_sizes() if self.pd is not None else ())
            since = now - self.last_state_sent
            if since < 1.0 and (key == self.last_state_key or since < STATE_PUBLISH_INTERVAL_S):
                return
            self.last_state_key = key
        self.last_state_sent = now
        figures = self._state_figures()
        if figures == self._last_figures:
            return  # the server has this state already (an idle rank's refresh, a flush
            # of an empty cache): one message less for both processes
        self._last_figures = figures
        self.last_state = state = self._state_of(figures)
        self.send(StateUpdate(state))

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        while self.running:
            busy = not self.scheduler.is_idle or self.quiesce.pending
            self.drain_inbox(block=not busy)
            if not self.running:
                break
            self.quiesce.poll()
            self.answer_deferred()
            self.step_timer.start()
            if self.pd is not None:
                self.pd.round()  # PD: control messages, transfers, timeouts
            batch = self.scheduler.schedule()
            self.step_timer.lap("schedule")
            if batch is not None:
                self.step(batch)
                self.step_timer.commit(batch.is_decode)
            outputs = self.scheduler.take_outputs()
            with self.together():
                self.send_outputs(outputs)
                self.flush_kv_events()
                self.publish_state(force=batch is None and bool(outputs))
            if batch is None and not outputs and self.pd is not None and self.pd.rooms.busy:
                self.pd.idle_wait(self.inbox, 5)  # rooms wait for a peer: do not spin
            if os.getppid() != self.parent_pid:
                logger.error("server process is gone; rank %d exits", self.rank)
                break

    def drain_inbox(self, block: bool) -> None:
        timeout = IDLE_POLL_MS if block else 0
        if block and (self.quiesce.pending or self.deferred
                      or self.scheduler.num_grammar_queue_reqs):
            timeout = 10  # come back soon to answer what is pending (or was compiled)
        while True:
            if timeout:
                data = self._wait(timeout)
                if data is None:
                    self.publish_state()
                    return
            else:
                data = self._take()
            if data is None:
                if block and self._nothing_to_do():
                    # e.g. an admin call on an idle rank: wait for the next message right
                    # here, not after a round of the loop that has nothing to do
                    self.publish_state()
                    timeout = IDLE_POLL_MS
                    continue
                return
            timeout = 0
            self.handle(decode(data))

    def _take(self) -> bytes | None:
        """The next queued message; None when there is none (asked first: most steps find
        the inbox empty, and a zmq.Again raised and caught costs more)."""
        if not self.inbox.get(_EVENTS) & _POLLIN:
            return None
        try:
            return self.inbox.recv(_NOBLOCK)
        except zmq.Again:
            return None

    def _wait(self, timeout_ms: int) -> bytes | None:
        """The next message, waiting up to ``timeout_ms`` for one (None: none came). One
        blocking receive: an idle rank that a message wakes has it in hand at once, instead
        of a poll (a Poller made and registered each time) and then a receive."""
        if self._recv_timeout != timeout_ms:
            self.inbox.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._recv_timeout = timeout_ms
        try:
            return self.inbox.recv()
        except zmq.Again:
            return None

    def _nothing_to_do(self) -> bool:
        """Idle, and the messages handled left nothing for the loop to send or run."""
        s = self.scheduler
        return (self.running and s.is_idle and not self.quiesce.pending
                and not s.num_grammar_queue_reqs
                and not self.deferred and not self.kv_events and not s.pending_outputs)

    def step(self, batch: Batch) -> None:
        """Run one forward step of the batch and send what it produced.

        A request that fails on its own (its sequence is invalid, its sampling raised or
        left no token, its post-processing raised) ends with its reason and frees its KV;
        the others go on. An exception of the forward pass itself ends the rank.
        """
        seqs = batch_inputs(batch)
        stage = "decode" if batch.is_decode else "prefill"
        self.profiler.before_step(stage)
        t0 = time.perf_counter()
        self.step_started = time.time()
        results = forward(self.runner, self.scheduler, batch, seqs, self.rank)
        self.step_started = 0.0
        self.last_step_time = time.perf_counter() - t0
        self.step_timer.forward(self.runner.last_times)
        self.forward_steps += 1
        outputs = self.scheduler.postprocess(batch, results)
        self.step_timer.lap("postprocess")
        # What arrived during the forward pass is handled before the step's outputs go out:
        # an admin call's answer then reaches the server ahead of the step's stream messages,
        # not behind them (the server writes those first). Not a serving phase of the step.
        # Only while requests still run: an op that waits for a drained rank (flush, weight
        # update) must not answer before the outputs of the requests it waited for.
        if self.scheduler.running:
            self.drain_inbox(block=False)
            self.step_timer.skip()
        self.flush_kv_events()  # the router's index learns the blocks before the answer
        self.send_outputs(outputs)
        self.step_timer.lap("output")
        # After the outputs went out: an auto-stop's trace export does not delay them.
        finished_profile = self.profiler.after_step(stage)
        if finished_profile is not None:
            finished_profile.add_done_callback(
                lambda fut: logger.info("profile finished by itself: %s", fut.result())
            )
            shipment = remote_trace_shipment(self.runner, finished_profile,
                                             self.profiler.export)
            if shipment is not None:  # --nnodes > 1
                self.deferred.append((None, shipment))

    def send_outputs(self, outputs: list[ReqOutput]) -> None:
        """One message for every request update of a step; log finishes when asked."""
        if not outputs:
            return
        self.send(BatchOutput(self.rank, outputs))
        if self.args.log_requests:
            for out in outputs:
                if out.finish_reason is not None:
                    trace_id = self.trace_ids.pop(out.rid, "")
                    logger.info(
                        "finished rid=%s reason=%s completion_tokens=%d cached_tokens=%d%s%s",
                        out.rid, out.finish_reason, out.completion_tokens, out.cached_tokens,
                        f" error={out.error!r}" if out.error else "",
                        f" trace_id={trace_id}" if trace_id else "",
                    )

    def flush_kv_events(self) -> None:
        events = self.kv_events
        if not events:
            return
        if len(events) == 1 and events[0] == _CLEARED:  # a flush's alone: encoded once
            events.clear()
            if self._cleared is None:
                self._cleared = encode(KvEvents(self.rank, [_CLEARED]))
            self.send_encoded(self._cleared)
            return
        events, self.kv_events[:] = list(events), []
        self.send(KvEvents(self.rank, events))

    # ------------------------------------------------------------------ messages

    def handle(self, msg: Any) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            logger.warning("rank %d ignores unexpected message %s", self.rank, type(msg).__name__)
            return
        handler(self, msg)

    def reply(self, msg: Any, ok: bool, text: str = "", result: Any = None) -> None:
        """Answer admin message ``msg`` (its rid and trace context) with a typed result."""
        op = op_name(msg)
        if self.args.log_requests:
            trace_id = trace_id_of(msg.trace)
            logger.info(
                "%s rid=%s success=%s%s%s", op, msg.rid, ok,
                f" message={text!r}" if text else "",
                f" trace_id={trace_id}" if trace_id else "",
            )
        with child_span(f"scheduler.{op}", msg.trace, dp_rank=self.rank, success=ok):
            self.send(AdminReply(msg.rid, self.rank, ok, text, result))

    def reply_when_done(self, msg: Any, future: Future) -> None:
        """Answer ``msg`` once ``future`` resolves to (success, message, result)."""
        self.deferred.append((msg, future))
        self.answer_deferred()

    def answer_deferred(self) -> None:
        if not self.deferred:
            return
        still: list[tuple[Any, Future]] = []
        for msg, fut in self.deferred:
            if not fut.done():
                still.append((msg, fut))
                continue
            try:
                ok, text, result = fut.result()
            except Exception as exc:  # noqa: BLE001 - a worker thread's failure, reported
                ok, text, result = False, f"{type(exc).__name__}: {exc}", None
            if msg is not None:
                self.reply(msg, ok, text, result)
        self.deferred = still


class _Together:
    """The context of :meth:`Rank.together` (a plain class: it runs on every loop
    iteration, where a generator-based context manager cost several times more)."""

    __slots__ = ("loop", "outer")

    def __init__(self, loop: Rank) -> None:
        self.loop = loop
        self.outer: list[bool] = []  # per open block: whether it is the one that sends

    def __enter__(self) -> None:
        self.outer.append(self.loop._hold())

    def __exit__(self, *exc: object) -> None:
        if self.outer.pop():
            self.loop._send_held()
