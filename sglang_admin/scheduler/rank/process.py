"""One scheduler rank as a process: the event loop around Scheduler and ModelRunner.

Loop: drain the inbox without blocking -> handle messages (each type's handler from
scheduler/ops/control.py's table) -> run the admin ops whose time came -> schedule a batch ->
forward + sample -> send outputs. It blocks on the inbox only when there is no work.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq

from sglang_admin.config import ServerArgs
from sglang_admin.logging_utils import setup_logging
from sglang_admin.messages import (
    AdminReply,
    BatchOutput,
    FailedMsg,
    KvEvents,
    ModelInfo,
    RankState,
    ReadyMsg,
    ReqOutput,
    StateUpdate,
    decode,
    encode,
)
from sglang_admin.scheduler import late_imports
from sglang_admin.scheduler.grammar import GrammarQueue, XGrammarBackend
from sglang_admin.scheduler.ops.control import Handler, op_name
from sglang_admin.scheduler.ops.quiesce import Quiesce
from sglang_admin.scheduler.profiling.step_timing import StepTimer
from sglang_admin.scheduler.rank.heartbeat import HeartbeatThread
from sglang_admin.scheduler.rank.lifetime import die_with_parent
from sglang_admin.scheduler.request import Batch
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig
from sglang_admin.scheduler.speculative.setup import install_draft_model, spec_config
from sglang_admin.scheduler.stop_strings import stop_string_detokenizer
from sglang_admin.tracing import child_span, trace_id_of

if TYPE_CHECKING:
    from sglang_admin.model.runner import SeqInput

logger = logging.getLogger(__name__)

STATE_PUBLISH_INTERVAL_S = 0.05
IDLE_POLL_MS = 500
# plain ints: pyzmq's enum constants cost an enum operation on every use
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_CLEARED = ["cleared"]  # the radix cache's event of a flush (scheduler/radix_cache.py)


def handler_table() -> dict[type, Handler]:
    """Message type -> handler, from scheduler/ops/control.py and every domain module."""
    from sglang_admin.scheduler.ops import (
        cache_control,
        control,
        generation_control,
        lora_control,
        weight_control,
        weight_sync_control,
    )
    from sglang_admin.scheduler.profiling import control as profile_control

    table: dict[type, Handler] = {}
    for module in (control, generation_control, cache_control, profile_control, weight_control,
                   lora_control, weight_sync_control):
        table.update(module.HANDLERS)
    return table


def grammar_queue_for(args: ServerArgs, info: ModelInfo) -> GrammarQueue:
    """The compile pool and cache of constrained decoding, against the served tokenizer."""
    directory = args.tokenizer_path or info.tokenizer_path
    tokenizer_file = os.path.join(directory, "tokenizer.json") if directory else None
    if tokenizer_file is not None and not os.path.isfile(tokenizer_file):
        tokenizer_file = None
    backend = XGrammarBackend(tokenizer_file, info.vocab_size, tuple(info.eos_token_ids))
    # xgrammar is imported by the rank's late-imports thread once it is ready
    # (scheduler/late_imports.py); a compile waits for it
    return GrammarQueue.for_backend(backend)


def run_scheduler(args: ServerArgs, rank: int, parent_pid: int) -> None:
    """Entry point of a scheduler process (spawned by the server)."""
    die_with_parent()
    # The server decides when we stop: a terminal's Ctrl-C (SIGINT to the process group) or
    # a supervisor that signals the whole group (systemd's KillMode=control-group sends
    # SIGTERM to every process) must not cut the streams the server is draining. The server
    # sends ShutdownReq; PR_SET_PDEATHSIG covers a server that dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(args.log_level, prefix=f"rank{rank}")
    ctx = zmq.Context(1)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(args.scheduler_addr(rank))
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(args.server_addr)
    try:
        loop = RankLoop(args, rank, inbox, outbox, parent_pid)
    except Exception as exc:  # report a one-line reason to the server, then exit
        logger.error("rank %d failed to start: %s: %s", rank, type(exc).__name__, exc)
        logger.debug("rank %d start-up traceback", rank, exc_info=True)
        outbox.send(encode(FailedMsg(rank, f"{type(exc).__name__}: {exc}")))
        outbox.close(linger=2000)
        sys.exit(1)
    heartbeat = HeartbeatThread(ctx, args, rank, loop)
    heartbeat.start()
    try:
        loop.run()
        if loop.tensor_parallel is not None:  # a clean stop: the TP followers stop too
            loop.runner.stop_followers()
    finally:
        heartbeat.stop()
        loop.weight_sync.close()  # leave the trainers' process groups
        if loop.scheduler.grammar_queue is not None:
            loop.scheduler.grammar_queue.shutdown()
    # The loop ends on ShutdownReq (sent as the server closes its inbox) or when the server
    # is gone: nobody is left to read pending outputs, so do not linger on them.
    outbox.close(linger=0)
    inbox.close(linger=0)
    ctx.term()


# RankState's fields after its timestamp (_state_figures' last ones)
_AFTER_TIMESTAMP = 6


def batch_inputs(batch: Batch) -> list[SeqInput]:
    """The model runner's inputs for a scheduled batch: one per span, in span order."""
    from sglang_admin.model.runner import SeqInput

    inputs = []
    for sp in batch.spans:
        req = sp.req
        start, end = sp.start, sp.end
        sampling, logprob = req.sampling, req.logprob
        draft = sp.draft
        inputs.append(SeqInput(
            req_idx=req.req_idx,
            prefix_len=start,
            # a verify span (speculative/plan.py): the last token, then the draft
            token_ids=req.tokens(start, end) if not draft else req.tokens(start, start + 1) + draft,
            table_start=sp.table_start,
            table_slots=req.slots[sp.table_start : end],
            sampling=sampling.params,
            prompt_ids=req.prompt_ids,
            output_ids=req.output_ids,
            sample=sp.sample,
            return_logprob=logprob.return_logprob,
            top_logprobs_num=logprob.top_logprobs_num,
            lora_slot=req.lora.slot,
            # prompt logprobs only while the span still covers prompt tokens
            logprob_start_len=logprob.logprob_start_len if start < len(req.prompt_ids) else -1,
            token_ids_logprob=logprob.token_ids_logprob,
            return_hidden_states=req.hidden.wanted,
            grammar=sampling.grammar,
            argmax_from=req.argmax_from,
            embed=req.embed,  # an Embed request's pooling progress
            draft=draft,
        ))
    return inputs


class RankLoop:
    """State and event loop of one rank."""

    def __init__(
        self,
        args: ServerArgs,
        rank: int,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
        parent_pid: int,
    ) -> None:
        import torch

        from sglang_admin.model.runner import keep_freed_cpu_memory
        from sglang_admin.scheduler.ops.weight_groups import WeightGroups
        from sglang_admin.scheduler.profiling.profiler import Profiler
        from sglang_admin.scheduler.tp.worker import build_runner

        self.args, self.rank, self.inbox, self.outbox = args, rank, inbox, outbox
        self.parent_pid = parent_pid
        # encoded messages held to leave together (see together()); None: each goes at once
        self.held: list[bytes] | None = None
        self._recv_timeout = -1  # the inbox's RCVTIMEO (ms) as last set by _wait
        self._together = _Together(self)
        self._cleared: bytes | None = None  # KvEvents(rank, [["cleared"]]), encoded once
        if args.otlp_traces_endpoint:
            from sglang_admin.otel import configure_otlp

            configure_otlp(args.otlp_traces_endpoint)
        # A core is left to the server by default: threads that share cores with it (or with
        # each other) spin-wait on one another and make every step many times slower.
        torch.set_num_threads(args.rank_threads)
        keep_freed_cpu_memory()
        torch.manual_seed(args.seed + rank)
        self.tensor_parallel = None  # --tp-size > 1: this rank is TP rank 0 of its replica
        if args.tp_size > 1:
            from sglang_admin.scheduler.tp.worker import join_replica

            self.tensor_parallel = join_replica(args, rank, 0)
        self.runner = build_runner(args, rank, 0, self.tensor_parallel)  # TP rank 0's
        target = self.runner
        if self.tensor_parallel is not None:
            from sglang_admin.scheduler.tp.worker import LeaderRunner

            self.tensor_parallel.barrier()  # every TP rank's shard is loaded
            self.runner = LeaderRunner(self.runner, self.tensor_parallel)  # type: ignore[assignment]
        info = self.runner.info
        # what every state reports and never changes, made once (not on every GetServerInfo)
        self._device, self._pid = str(self.runner.device), os.getpid()
        self.kv_events: list[list[Any]] = []
        self.trace_ids: dict[str, str] = {}  # rid -> caller's trace id (for --log-requests)
        self.scheduler = Scheduler(
            SchedulerConfig(
                token_capacity=self.runner.token_capacity,
                max_running_requests=args.max_running_requests,
                max_prefill_tokens=args.max_prefill_tokens,
                context_length=info.context_length,
                eos_token_ids=tuple(info.eos_token_ids),
                pools_every_token=info.pooling in ("CLS", "MEAN"),
                preempt_wait_s=args.preempt_wait_s,
                speculative=spec_config(args),
            ),
            on_kv_event=self.kv_events.append,
            grammar_queue=grammar_queue_for(args, info),
        )
        self.draft_runner = install_draft_model(args, target, self.scheduler)
        self.scheduler.detokenize = stop_string_detokenizer(
            args.tokenizer_path, info.tokenizer_path)
        self.profiler = Profiler(rank, str(self.runner.device), args.profile_max_steps)
        self.quiesce = Quiesce(self.scheduler)
        self.handlers = handler_table()
        from sglang_admin.scheduler.ops.lora_control import setup_lora

        self.lora = setup_lora(self)  # None unless --enable-lora
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
        late_imports.start_in_background()
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
        )

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
                   self.quiesce.pending, s.paused, s.num_grammar_queue_reqs)
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
        from sglang_admin.model.runner import InvalidSequence

        seqs = batch_inputs(batch)
        stage = "decode" if batch.is_decode else "prefill"
        self.profiler.before_step(stage)
        t0 = time.perf_counter()
        self.step_started = time.time()
        while True:
            try:
                results = self.runner.forward_step(seqs)
                break
            except InvalidSequence as exc:  # checked before any device work: drop, rerun
                span = batch.spans.pop(exc.index)
                seqs.pop(exc.index)
                logger.error("rank %d: request %s has an invalid sequence: %s",
                             self.rank, span.req.rid, exc)
                self.scheduler.fail(span.req, f"invalid sequence: {exc}", "INTERNAL")
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
            self.reply(msg, ok, text, result)
        self.deferred = still


class _Together:
    """The context of :meth:`RankLoop.together` (a plain class: it runs on every loop
    iteration, where a generator-based context manager cost several times more)."""

    __slots__ = ("loop", "outer")

    def __init__(self, loop: RankLoop) -> None:
        self.loop = loop
        self.outer: list[bool] = []  # per open block: whether it is the one that sends

    def __enter__(self) -> None:
        self.outer.append(self.loop._hold())

    def __exit__(self, *exc: object) -> None:
        if self.outer.pop():
            self.loop._send_held()
