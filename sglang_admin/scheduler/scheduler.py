"""The batching policy of one rank: continuous batching over a radix-cached KV pool.

No torch here. Two calls drive it, as in nano-vllm: :meth:`Scheduler.schedule` picks the
work of the next forward step (a :class:`Batch` of per-request token spans) and
:meth:`Scheduler.postprocess` takes the sampled tokens back, finishes requests and
returns what to send to the server. Everything about memory (slot allocation, prefix
reuse, eviction, retraction) happens here, so it can be tested with a fake model.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from sglang_admin.messages import GenerateReq, ReqOutput
from sglang_admin.scheduler import output_extras
from sglang_admin.scheduler.embedding import EmbedProgress, reusable_prefix
from sglang_admin.scheduler.grammar import GrammarQueue
from sglang_admin.scheduler.kv_pool import TokenAllocator
from sglang_admin.scheduler.lora_registry import LoraRegistry, LoraUnavailable, cache_key
from sglang_admin.scheduler.parallel_sampling import fork_ready, sample_key
from sglang_admin.scheduler.preemption import plan_turns
from sglang_admin.scheduler.radix_cache import RadixCache
from sglang_admin.scheduler.request import Batch, Req, Span
from sglang_admin.scheduler.stop_strings import Detokenize, find_stop

logger = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 5.0
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class SchedulerConfig:
    token_capacity: int
    max_running_requests: int
    max_prefill_tokens: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    disable_radix_cache: bool = False
    pools_every_token: bool = False  # an embedding model pooling CLS or MEAN (issue 32)
    # issue 33: a request waiting this long for a place preempts the longest-running
    # decode (preemption.py); 0: never (a full rank admits nothing until a request ends)
    preempt_wait_s: float = 0.0


class Scheduler:
    """Waiting queue, running set, radix cache and allocator of one rank."""

    def __init__(
        self, config: SchedulerConfig, on_kv_event=None,
        grammar_queue: GrammarQueue[Req] | None = None,
    ) -> None:
        self.config = config
        self.grammar_queue = grammar_queue  # constrained requests wait here for a compile
        self.allocator = TokenAllocator(config.token_capacity)
        self.cache = RadixCache(
            self.allocator, on_event=on_kv_event, disable=config.disable_radix_cache
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}
        self.free_rows: list[int] = list(range(config.max_running_requests - 1, -1, -1))
        self.eos = frozenset(config.eos_token_ids)
        self.admission_paused = False  # set while a flush waits for idle
        self.paused: str | None = None  # the PauseGeneration mode while paused
        self.pending_outputs: list[ReqOutput] = []  # made outside postprocess (abort, expiry)
        self.num_retracted = 0
        self.num_preempted = 0  # running requests that gave their place to a waiting one
        self.clock = time.monotonic  # the time preemption goes by (a test sets its own)
        self.lora: LoraRegistry | None = None  # set by the rank when LoRA is enabled
        self.groups: dict[str, list[Req]] = {}  # rid -> its samples, for n > 1
        self.detokenize: Detokenize | None = None  # for stop strings (set by the rank)
        self.reset_counters()

    # ------------------------------------------------------------------ state

    def reset_counters(self) -> None:
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated: deque[tuple[float, int]] = deque()

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def num_used_tokens(self) -> int:
        """KV slots held by requests (running, or forked samples waiting for their parent):
        the pool less what is free and what the prefix cache may evict, as SGLang's
        ``max_total_num_tokens - (available + evictable)``. 0 on an idle rank, however warm
        its cache."""
        return self.allocator.capacity - self.allocator.available - self.cache.evictable_size

    @property
    def num_free_tokens(self) -> int:
        """KV slots nobody holds: neither a request nor the prefix cache."""
        return self.allocator.available

    @property
    def cache_hit_rate(self) -> float:
        if not self.prompt_tokens_total:
            return 0.0
        return self.cached_tokens_total / self.prompt_tokens_total

    def gen_throughput(self, now: float | None = None) -> float:
        """Generated tokens per second over the recent window."""
        now = time.monotonic() if now is None else now
        while self.generated and self.generated[0][0] < now - THROUGHPUT_WINDOW_S:
            self.generated.popleft()
        if not self.generated:
            return 0.0
        span = max(now - self.generated[0][0], 1e-3)
        return sum(n for _, n in self.generated) / max(span, 1.0)

    def waiting_uncached_tokens(self) -> int:
        # a forked sample (n > 1) computes one token of the prompt its parent shares
        sharing = not self.cache.disable
        return sum(1 if r.fork_of is not None and sharing else r.seq_len - r.kv_len
                   for r in self.waiting)

    # ------------------------------------------------------------------ inputs

    def add_request(self, msg: GenerateReq, trace_id: str = "") -> None:
        """Queue a request (the server validated it); duplicates are refused."""
        if msg.rid in self.by_rid or msg.rid in self.groups:
            self.pending_outputs.append(
                _error(msg.rid, "ALREADY_EXISTS", f"request_id {msg.rid!r} is already in flight")
            )
            return
        if len(msg.input_ids) >= self.config.token_capacity:
            self.pending_outputs.append(
                _error(
                    msg.rid,
                    "INVALID_ARGUMENT",
                    f"prompt of {len(msg.input_ids)} tokens does not fit the KV pool "
                    f"of {self.config.token_capacity} tokens",
                )
            )
            return
        if msg.stop and self.detokenize is None:
            self.pending_outputs.append(_error(
                msg.rid, "FAILED_PRECONDITION",
                "stop strings need the model's tokenizer, and this rank could not load one"))
            return
        if msg.sampling.grammar_kind and self.grammar_queue is None:
            self.pending_outputs.append(_error(
                msg.rid, "FAILED_PRECONDITION", "this rank has no grammar backend"))
            return
        samples: list[Req] = []
        for index in range(max(msg.n, 1)):
            req = Req(
                rid=msg.rid,
                prompt_ids=list(msg.input_ids),
                sampling=msg.sampling,
                return_logprob=msg.return_logprob,
                top_logprobs_num=msg.top_logprobs_num,
                deadline=msg.deadline,
                trace_id=trace_id,
                index=index,
                key=sample_key(msg.rid, index),
                fork_of=samples[0] if samples else None,
                stop=msg.stop,
                no_stop_trim=msg.no_stop_trim,
                # prompt logprobs: computed by sample 0 alone (the others share its KV)
                logprob_start_len=msg.logprob_start_len if index == 0 else -1,
                token_ids_logprob=msg.token_ids_logprob,
                return_hidden_states=msg.return_hidden_states,
                embed=EmbedProgress() if msg.embed else None,
            )
            samples.append(req)
        if msg.lora_id and not self._acquire_lora(samples, msg.lora_id):
            return
        for req in samples:
            self.by_rid[req.key] = req
            req.waiting_since = self.clock()
            self._enqueue(req)
        if len(samples) > 1:
            self.groups[msg.rid] = samples

    def _acquire_lora(self, samples: list[Req], lora_id: str) -> bool:
        """Each sample holds the adapter until it ends; False (an error queued) if none."""
        if self.lora is None:
            self.refuse(samples[0].rid,
                        "lora_id is not supported: LoRA is not enabled (--enable-lora)",
                        "INVALID_ARGUMENT")
            return False
        for held, req in enumerate(samples):
            try:
                adapter = self.lora.acquire(lora_id)
            except LoraUnavailable as exc:
                for earlier in samples[:held]:
                    self.lora.release(lora_id)
                    earlier.lora_id = ""
                self.refuse(req.rid, str(exc), "INVALID_ARGUMENT")
                return False
            req.lora_id, req.lora_slot, req.lora_ns = lora_id, adapter.slot, adapter.namespace
        return True

    def _enqueue(self, req: Req) -> None:
        """The waiting queue; a constrained request waits in the grammar queue first."""
        sp = req.sampling
        if sp.grammar_kind and self.grammar_queue is not None:
            self.grammar_queue.submit(req, sp.grammar_kind, sp.grammar)
        else:
            self.waiting.append(req)

    def _dequeue(self, req: Req) -> bool:
        """Take a request out of the waiting or the grammar queue; False when in neither."""
        if req in self.waiting:
            self.waiting.remove(req)
            return True
        return self.grammar_queue is not None and self.grammar_queue.remove(req)

    @property
    def num_grammar_queue_reqs(self) -> int:
        """Requests waiting for their grammar to compile (GetLoads' queues.grammar)."""
        return len(self.grammar_queue) if self.grammar_queue is not None else 0

    def _take_compiled_grammars(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail the others."""
        if self.grammar_queue is None:
            return
        for done in self.grammar_queue.poll():
            req = done.req
            if req.key not in self.by_rid:
                continue
            if done.state is None:
                self._finish(req, "abort", error=done.error, code=done.code)
                continue
            req.grammar = done.state
            req.waiting_since = self.clock()
            self.waiting.append(req)

    def refuse(self, rid: str, message: str, code: str) -> None:
        """Answer a request that will not be queued with an error, at the next outputs."""
        self.pending_outputs.append(_error(rid, code, message))

    def abort(self, rid: str, reason: str = "aborted") -> None:
        """Abort a request; running ones release their KV at the next schedule()."""
        group = self.groups.get(rid)
        single = self.by_rid.get(rid)
        for req in group if group is not None else ([single] if single is not None else []):
            if req.key not in self.by_rid:
                continue  # this sample already finished
            if self._dequeue(req):
                self._finish(req, "abort", error=None)
            else:
                req.aborted = reason

    def fail_all(self, message: str, code: str) -> int:
        """End every running and waiting request with an error; how many there were."""
        reqs = [*self.running, *self.waiting, *self._drain_grammar_queue()]
        self.waiting.clear()
        for req in reqs:
            self.fail(req, message, code)
        return len(reqs)

    def abort_all(self, reason: str = "aborted") -> int:
        """Finish every running and waiting request with "abort" now; how many there were."""
        reqs = [*self.running, *self.waiting, *self._drain_grammar_queue()]
        self.waiting.clear()
        for req in reqs:
            self._finish(req, "abort", error=None)
        return len(reqs)

    def _drain_grammar_queue(self) -> list[Req]:
        return self.grammar_queue.drain() if self.grammar_queue is not None else []

    # ------------------------------------------------------------------ pause

    def pause(self, mode: str) -> int:
        """Stop generation as SGLang's pause_generation; the requests it touched.

        ``abort``: every request in flight ends with "abort". ``retract``: running
        requests go back to the head of the queue and their KV is freed (their prompt's
        prefix stays cached, unlocked, so a flush can run; they recompute the rest after
        :meth:`resume`). ``in_place``: running
        requests stay, KV and all, and simply take no step. In every mode nothing is
        admitted or stepped until :meth:`resume`; deadlines and aborts still apply.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; valid: {', '.join(PAUSE_MODES)}")
        if mode == "abort":
            touched = self.abort_all("paused")
        elif mode == "retract":
            touched = len(self.running)
            for req in reversed(list(self.running)):
                self._retract(req)
        else:
            touched = len(self.running)
        self.paused = mode
        return touched

    def resume(self) -> None:
        """End a pause: held and waiting requests go on at the next schedule()."""
        self.paused = None

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> Batch | None:
        """Pick the next step's work: every running request, then new admissions."""
        now = time.time()
        self._take_compiled_grammars()
        self._drop_aborted_and_expired(now)
        if self.paused is not None:
            return None
        self._take_turns()
        budget = self.config.max_prefill_tokens
        spans = self._decode_all()

        # Running requests first: decode (1 token) or the next chunk of their prefill.
        i = len(spans)  # all of them when _decode_all took the step
        while i < len(self.running):
            req = self.running[i]
            seq_len = len(req.prompt_ids) + len(req.output_ids)
            n = min(seq_len - req.kv_len, max(budget, 1))
            if not self._reserve(req, n):
                # Out of memory even after eviction: retract the newest running request,
                # then retry running[i] with the freed memory (the next request when the
                # victim was req itself).
                victim = self.running[-1]
                self._retract(victim)
                spans = [s for s in spans if s.req is not victim]
                continue
            spans.append(self._span(req, n, seq_len))
            budget -= n if n > 1 else 0
            i += 1

        # Admissions, in arrival order, while the step has room.
        while (
            self.waiting
            and not self.admission_paused
            and budget > 0
            and len(self.running) < self.config.max_running_requests
        ):
            pick = self._next_admissible()
            if pick is None:
                break
            req = self.waiting[pick]
            if not self._admit(req):
                break
            del self.waiting[pick]
            n = min(req.seq_len - req.kv_len, budget)
            if not self._reserve(req, n):
                self._release(req)
                self.waiting.insert(pick, req)
                break
            self.running.append(req)
            spans.append(self._span(req, n, req.seq_len))
            budget -= n
        return Batch(spans) if spans else None

    def _take_turns(self) -> None:
        """Preempt running decodes for requests that waited ``preempt_wait_s`` for a place
        (preemption.py): those go to the head of the queue, their victims to its tail."""
        wait_s = self.config.preempt_wait_s
        if wait_s <= 0 or not self.waiting or self.admission_paused:
            return
        now = self.clock()
        memory = (self.allocator.available + self.cache.evictable_size
                  - (len(self.running) + 1))
        turns = plan_turns(
            self.waiting, self.running, now, wait_s,
            rows_free=min(self.config.max_running_requests - len(self.running),
                          len(self.free_rows)),
            memory_free=memory, need=self._admission_need, sharing=not self.cache.disable,
        )
        if not turns.first:
            return
        for victim in turns.victims:
            self._preempt(victim, now)
        first = set(map(id, turns.first))
        rest = [r for r in self.waiting if id(r) not in first]
        self.waiting.clear()
        self.waiting.extend([*turns.first, *rest])

    def _admission_need(self, req: Req) -> int:
        """KV slots admitting ``req`` takes now: its sequence less the prefix cached."""
        seq = req.fill_ids
        cached = len(self.cache.match_prefix(cache_key(seq[:-1], req.lora_ns)).slots)
        return len(seq) - cached

    def _preempt(self, req: Req, now: float) -> None:
        """Give a running decode's place up: its computed KV goes to the radix cache
        (unlocked, so evictable; it matches it back when admitted again) and it waits at
        the tail of the queue."""
        logger.debug("preempting %s after %.1f s running, for a waiting request", req.rid,
                     now - req.running_since)
        self._release(req, keep=True)
        self.running.remove(req)
        self.num_preempted += 1
        req.waiting_since = now
        self.waiting.append(req)

    def _decode_all(self) -> list[Span]:
        """The spans of a step in which every running request decodes one token and the
        pool has a free slot for each (most steps): what the loop in :meth:`schedule` makes
        of them, with one allocation for all. Empty when that is not the case."""
        running = self.running
        if not running or self.allocator.available < len(running):
            return []
        for req in running:
            if len(req.prompt_ids) + len(req.output_ids) - req.kv_len != 1:
                return []
        slots = self.allocator.alloc(len(running))  # the order of one alloc(1) per request
        assert slots is not None
        spans = []
        for req, slot in zip(running, slots):
            req.slots.append(slot)
            start = req.kv_len
            spans.append(Span(req, start, start + 1, req.table_synced,
                              req.sampling.max_new_tokens > 0))
            req.table_synced = start + 1
        return spans

    def _next_admissible(self) -> int | None:
        """Queue position of the first request that may be admitted: in arrival order,
        skipping forked samples whose parent has not prefilled the shared prompt yet."""
        sharing = not self.cache.disable
        for pos, req in enumerate(self.waiting):
            if fork_ready(req, sharing):
                return pos
        return None

    def _admit(self, req: Req) -> bool:
        """Match the cached prefix, lock it and give the request a table row."""
        seq = req.fill_ids
        match = self.cache.match_prefix(cache_key(seq[:-1], req.lora_ns))
        reuse = reusable_prefix(req.embed, len(match.slots), self.config.pools_every_token)
        if req.logprob_start_len >= 0 and not req.output_ids:
            # prompt logprobs need the logits from position logprob_start_len - 1 on
            reuse = min(reuse, max(req.logprob_start_len - 1, 0))
        need = len(seq) - reuse
        # Keep one token of headroom per running request for their next decode step.
        headroom = len(self.running) + 1
        fits = self.allocator.available + self.cache.evictable_size - headroom >= need
        if not fits and self.running:  # wait for running requests to finish and free memory
            return False
        if not self.free_rows:
            return False
        self.cache.inc_lock_ref(match.node)
        req.last_node = match.node
        req.slots = list(match.slots[:reuse])
        req.kv_len = req.cached_len = reuse
        req.req_idx = self.free_rows.pop()
        req.table_synced = 0
        req.running_since = self.clock()
        if req.cached_tokens < 0:  # first admission: account the prompt
            req.cached_tokens = min(reuse, len(req.prompt_ids))
            req.queue_time_s = time.monotonic() - req.arrived
            self.prompt_tokens_total += len(req.prompt_ids)
            self.cached_tokens_total += req.cached_tokens
        return True

    def _reserve(self, req: Req, n: int) -> bool:
        """Allocate KV slots for the request's next n tokens, evicting cache if needed."""
        slots = self.allocator.alloc(n)
        if slots is None:
            self.cache.evict(n - self.allocator.available)
            slots = self.allocator.alloc(n)
            if slots is None:
                return False
        req.slots.extend(slots)
        return True

    def _span(self, req: Req, n: int, seq_len: int) -> Span:
        start, end = req.kv_len, req.kv_len + n
        table_start = req.table_synced
        req.table_synced = end
        # max_new_tokens = 0: prefill only, nothing sampled
        sample = end == seq_len and req.sampling.max_new_tokens > 0
        return Span(req, start, end, table_start, sample)

    # ------------------------------------------------------------------ postprocess

    def postprocess(
        self,
        batch: Batch,
        tokens: list[int | None],
        logprobs: list[float | None] | None = None,
        top_logprobs: list[list[tuple[int, float]] | None] | None = None,
        errors: list[tuple[str, str] | None] | None = None,
        extras: list[output_extras.StepExtras | None] | None = None,
    ) -> list[ReqOutput]:
        """Take the sampled tokens of a step; finish requests; return the outputs to send.

        ``errors[i]``, (message, gRPC code name), fails span i's request alone; so does an
        exception while post-processing one request (INTERNAL, with its reason).
        ``extras[i]``: span i's prompt logprobs, token-id logprobs and hidden state.
        """
        now = time.monotonic()
        new_tokens = 0
        for i, span in enumerate(batch.spans):
            req = span.req
            try:
                req.kv_len = span.end
                if (req.token_only and span.end - span.start == 1 and not req.aborted
                        and (errors is None or errors[i] is None)):
                    # most requests of most steps: what the steps below would do for them
                    token = tokens[i]
                    if token is not None:
                        req.output_ids.append(token)
                        new_tokens += 1
                        self._check_finished(req, token)
                    continue
                error = errors[i] if errors is not None else None
                if error is not None and not req.aborted:
                    self.fail(req, *error)
                    continue
                if span.end - span.start > 1 and not req.aborted:
                    self._cache_unfinished(req)
                extra = extras[i] if extras is not None else None
                output_extras.absorb_prompt(req, extra)
                if req.sampling.max_new_tokens == 0 and not req.aborted:
                    if span.end >= req.seq_len:  # prefill only: done once the prompt is in
                        self._finish(req, "length")
                    continue
                token = tokens[i]
                if token is None or req.aborted:
                    continue
                req.output_ids.append(token)
                new_tokens += 1
                if req.grammar is not None and not req.grammar.accept(token):
                    self.fail(req, f"token {token} violates the request's grammar", "INTERNAL")
                    continue
                if req.return_logprob and logprobs is not None:
                    req.logprobs.append(float(logprobs[i] or 0.0))
                    if req.top_logprobs_num and top_logprobs is not None:
                        req.top_logprobs.append(list(top_logprobs[i] or []))
                output_extras.absorb_token(req, extra)
                self._check_finished(req, token)
            except Exception as exc:  # noqa: BLE001 - one request's fault ends that request
                logger.exception("post-processing %s failed", req.rid)
                self.fail(req, f"post-processing failed: {type(exc).__name__}: {exc}",
                          "INTERNAL")
        if new_tokens:
            self.generated.append((now, new_tokens))
        outputs = self.pending_outputs
        self.pending_outputs = []
        for span in batch.spans:
            req = span.req
            if req.key in self.by_rid and len(req.output_ids) > req.sent_tokens:
                outputs.append(self._progress(req))
        return outputs

    def fail(self, req: Req, message: str, code: str) -> None:
        """End one request with an error (finish_reason abort) and free its KV.

        Should releasing its memory itself fail, the request is still dropped and its
        caller told (its slots may then stay allocated: logged)."""
        if req.key not in self.by_rid:
            return
        try:
            self._finish(req, "abort", error=message, code=code)
        except Exception:  # noqa: BLE001
            logger.exception("releasing %s failed; dropping it (its KV may leak)", req.rid)
            if req in self.running:
                self.running.remove(req)
            if req in self.waiting:
                self.waiting.remove(req)
            self.by_rid.pop(req.key, None)
            self._end_sample(req)
            out = _error(req.rid, code, message)
            out.index = req.index
            self.pending_outputs.append(out)

    def _check_finished(self, req: Req, token: int) -> None:
        sp = req.sampling
        n_out = len(req.output_ids)
        is_stop = token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos)
        if is_stop and n_out >= sp.min_new_tokens:
            self._finish(req, "stop", matched=token)
            return
        if req.stop and n_out >= sp.min_new_tokens and self.detokenize is not None:
            found = find_stop(req.output_ids, req.stop, self.detokenize)
            if found is not None:
                self._finish(req, "stop", matched_str=found.stop,
                             stop_trim=0 if req.no_stop_trim else found.trim)
                return
        if req.grammar is not None and req.grammar.finished:  # the constraint is complete
            self._finish(req, "stop", matched=token if token in self.eos else None)
            return
        seq_len = len(req.prompt_ids) + n_out
        if (
            n_out >= sp.max_new_tokens
            or seq_len >= self.config.context_length
            or seq_len >= self.config.token_capacity
        ):
            self._finish(req, "length")

    def _progress(self, req: Req, final: bool = False) -> ReqOutput:
        new = req.output_ids[req.sent_tokens :]
        req.sent_tokens = len(req.output_ids)
        lps = req.logprobs[req.sent_logprobs :]
        tops = req.top_logprobs[req.sent_logprobs :]
        req.sent_logprobs = len(req.logprobs)
        # positional, every field (a step builds one per running request): rid, tokens,
        # prompt/completion/cached counts, queue_time_s, index, logprobs, top logprobs,
        # finish_reason, matched_token_id, error, error_code, matched_stop_str, stop_trim,
        # then the extras' lists (filled by attach)
        out = ReqOutput(req.rid, new, len(req.prompt_ids), req.sent_tokens,
                        max(req.cached_tokens, 0), req.queue_time_s, req.index, lps, tops,
                        None, None, None, None, None, 0, [], [], [], [])
        if final or req.token_ids_logprobs or req.hidden_states:
            output_extras.attach(req, out, final)
        return out

    # ------------------------------------------------------------------ releasing

    def _finish(
        self, req: Req, reason: str, matched: int | None = None, error: str | None = None,
        code: str | None = None, matched_str: str | None = None, stop_trim: int = 0,
    ) -> None:
        """Release the request's memory and queue its final output."""
        if req.req_idx >= 0:
            self._release(req)
            if req in self.running:
                self.running.remove(req)
        self.by_rid.pop(req.key, None)
        self._end_sample(req)
        out = self._progress(req, final=True)
        out.finish_reason = reason
        out.matched_token_id = matched
        out.matched_stop_str = matched_str
        out.stop_trim = stop_trim
        out.error = error
        out.error_code = code
        self.pending_outputs.append(out)
        if req.lora_id and self.lora is not None:
            self.lora.release(req.lora_id)
            req.lora_id = ""

    def _end_sample(self, req: Req) -> None:
        """Mark a sample ended; forget its group once every sample of it ended."""
        req.done = True
        group = self.groups.get(req.rid)
        if group is not None and all(r.done for r in group):
            del self.groups[req.rid]

    def _release(self, req: Req, keep: bool = True) -> None:
        """Hand the computed KV to the radix cache (``keep``; else free it, as SGLang's
        ``release_kv_cache(is_insert=False)``), free the rest, unlock, free the row. What
        the tree held before (the prefix the request matched or shared) stays cached."""
        kv = req.kv_len
        seq = req.fill_ids[:kv]
        computed = req.slots[:kv]
        if self.cache.disable or not keep:
            self.allocator.free(req.slots[req.cached_len :])
        else:
            already = self.cache.insert(cache_key(seq, req.lora_ns), computed)
            if already > req.cached_len:
                self.allocator.free(computed[req.cached_len : already])
            self.allocator.free(req.slots[kv:])  # reserved but never computed
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
            req.last_node = None
        self.free_rows.append(req.req_idx)
        req.req_idx = -1
        req.slots = []
        req.cached_len = req.kv_len = req.table_synced = 0

    def _cache_unfinished(self, req: Req) -> None:
        """Share a prefilled prefix at once (as SGLang's cache_unfinished_req): insert the
        computed KV into the tree, adopt the tree's slots and move the lock down to it, so
        requests admitted in later steps reuse it while this one still runs."""
        if self.cache.disable:
            return
        kv = req.kv_len
        seq = cache_key(req.fill_ids[:kv], req.lora_ns)
        already = self.cache.insert(seq, req.slots[:kv])
        if already > req.cached_len:
            # Someone inserted part of this prefix meanwhile: free our duplicate slots and
            # use the tree's (same tokens at the same positions, so the same KV).
            self.allocator.free(req.slots[req.cached_len : already])
        match = self.cache.match_prefix(seq)
        self.cache.inc_lock_ref(match.node)
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        req.last_node = match.node
        if already > req.cached_len:
            req.table_synced = min(req.table_synced, req.cached_len)
        req.slots[:kv] = match.slots
        req.cached_len = kv

    def _retract(self, req: Req) -> None:
        """Put a running request back at the head of the queue and free its KV, as SGLang's
        retract: the slots only it held go back to the pool, and the prefix it shares with
        the tree (its prompt, once prefilled) is unlocked, so the cache may evict it. It
        recomputes the rest when it is admitted again."""
        logger.info("retracting %s to free KV memory", req.rid)
        self._release(req, keep=False)
        self.running.remove(req)
        req.retractions += 1
        self.num_retracted += 1
        req.waiting_since = self.clock()
        self.waiting.appendleft(req)

    def _drop_aborted_and_expired(self, now: float) -> None:
        ended = [r for r in self.running
                 if r.aborted or (r.deadline is not None and r.deadline < now)]
        for req in ended:
            if req.aborted:
                self._finish(req, "abort")
            else:
                self._finish(req, "abort", error="deadline exceeded", code="DEADLINE_EXCEEDED")
        expired = [r for r in self.waiting if r.deadline is not None and r.deadline < now]
        if self.grammar_queue is not None:
            compiling = self.grammar_queue.requests()
            expired += [r for r in compiling if r.deadline is not None and r.deadline < now]
        for req in expired:
            self._dequeue(req)
            self._finish(
                req, "abort", error="deadline exceeded while queued", code="DEADLINE_EXCEEDED"
            )

    def take_outputs(self) -> list[ReqOutput]:
        """Outputs produced outside a step (aborts, refusals, expiries)."""
        out, self.pending_outputs = self.pending_outputs, []
        return out

    # ------------------------------------------------------------------ flush

    def flush(self) -> int:
        """Reset the radix cache and the pool; tokens freed. Nothing may run; queued
        requests (never admitted, or retracted by a pause) hold no KV and stay queued."""
        assert not self.running, "flush needs a scheduler with nothing running"
        freed = self.cache.reset()
        self.allocator.reset()
        self.free_rows = list(range(self.config.max_running_requests - 1, -1, -1))
        self.reset_counters()
        return freed


def _error(rid: str, code: str, message: str) -> ReqOutput:
    return ReqOutput(
        rid=rid,
        new_token_ids=[],
        prompt_tokens=0,
        completion_tokens=0,
        cached_tokens=0,
        finish_reason="abort",
        error=message,
        error_code=code,
    )
