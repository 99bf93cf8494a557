"""The batching policy of one rank: continuous batching over a radix-cached KV pool.

No torch here. Two calls drive it, as in nano-vllm: :meth:`Scheduler.schedule` picks the
work of the next forward step (a :class:`Batch` of per-request token spans, step_plan.py)
and :meth:`Scheduler.postprocess` takes the step's results back, finishes requests and
returns what to send to the server (postprocess.py). This module is the policy's face:
requests in (admission to the queues), aborts, pause and flush; the state it keeps is
state.py's, a request's memory kv_memory.py's, and how a request ends request_end.py's.
Everything about memory happens below it, so it can be tested with a fake model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from sglang_admin.messages import GenerateReq, ReqOutput
from sglang_admin.scheduler import postprocess as step_results
from sglang_admin.scheduler import preemption, request_end, step_plan
from sglang_admin.scheduler.lora_registry import LoraUnavailable
from sglang_admin.scheduler.output_extras import StepResult
from sglang_admin.scheduler.reasoning import ThinkingGate
from sglang_admin.scheduler.request import Batch, Req, samples_of
from sglang_admin.scheduler.speculative.policy import SpecProgress
from sglang_admin.scheduler.state import SchedulerConfig, SchedulerState

__all__ = ["PAUSE_MODES", "Scheduler", "SchedulerConfig"]

PAUSE_MODES = ("abort", "retract", "in_place")


class Scheduler(SchedulerState):
    """Waiting queue, running set, radix cache and allocator of one rank, and the calls
    that move requests through them."""

    # ------------------------------------------------------------------ requests in

    def add_request(self, msg: GenerateReq, trace_id: str = "") -> None:
        """Queue a request (the server validated it); duplicates are refused."""
        refusal = self._refusal(msg)
        if refusal is not None:
            self.refuse(msg.rid, *refusal)
            return
        samples = samples_of(msg, trace_id)
        if msg.lora_id and not self._acquire_lora(samples, msg.lora_id):
            return
        spec = self.config.speculative
        for req in samples:
            if spec is not None:
                req.spec = SpecProgress(spec.num_draft_tokens)
            self.by_rid[req.key] = req
            req.waiting_since = self.clock()
            self._enqueue(req)
        if len(samples) > 1:
            self.groups[msg.rid] = samples

    def _refusal(self, msg: GenerateReq) -> tuple[str, str] | None:
        """Why this rank cannot take the request: (message, gRPC code name); None: it can."""
        if msg.rid in self.by_rid or msg.rid in self.groups:
            return f"request_id {msg.rid!r} is already in flight", "ALREADY_EXISTS"
        if len(msg.input_ids) >= self.config.token_capacity:
            return (f"prompt of {len(msg.input_ids)} tokens does not fit the KV pool "
                    f"of {self.config.token_capacity} tokens", "INVALID_ARGUMENT")
        if msg.stop and self.detokenize is None:
            return ("stop strings need the model's tokenizer, and this rank could not load "
                    "one", "FAILED_PRECONDITION")
        if msg.sampling.grammar_kind and self.grammar_queue is None:
            return "this rank has no grammar backend", "FAILED_PRECONDITION"
        return None

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
                    earlier.lora.lora_id = ""
                self.refuse(req.rid, str(exc), "INVALID_ARGUMENT")
                return False
            req.lora.lora_id, req.lora.slot = lora_id, adapter.slot
            req.lora.namespace = adapter.namespace
        return True

    def _enqueue(self, req: Req) -> None:
        """The waiting queue; a constrained request waits in the grammar queue first."""
        sp = req.sampling.params
        if sp.grammar_kind and self.grammar_queue is not None:
            self.grammar_queue.submit(req, sp.grammar_kind, sp.grammar)
        else:
            self.waiting.append(req)

    def _take_compiled_grammars(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail the others."""
        if self.grammar_queue is None:
            return
        for done in self.grammar_queue.poll():
            req = done.req
            if req.key not in self.by_rid:
                continue
            if done.state is None:
                request_end.finish(self, req, "abort", error=done.error, code=done.code)
                continue
            req.sampling.grammar = (
                ThinkingGate(done.state, self.think_end_id)
                if req.sampling.params.require_reasoning and self.think_end_id >= 0
                else done.state)
            req.waiting_since = self.clock()
            self.waiting.append(req)

    def refuse(self, rid: str, message: str, code: str) -> None:
        """Answer a request that will not be queued with an error, at the next outputs."""
        self.pending_outputs.append(request_end.error_output(rid, code, message))

    # ------------------------------------------------------------------ ending requests

    def abort(self, rid: str, reason: str = "aborted") -> None:
        """Abort a request; running ones release their KV at the next schedule()."""
        request_end.abort(self, rid, reason)

    def fail(self, req: Req, message: str, code: str) -> None:
        """End one request with an error (finish_reason abort) and free its KV."""
        request_end.fail(self, req, message, code)

    def fail_all(self, message: str, code: str) -> int:
        """End every running and waiting request with an error; how many there were."""
        reqs = request_end.take_every_request(self)
        for req in reqs:
            request_end.fail(self, req, message, code)
        return len(reqs)

    def abort_all(self, reason: str = "aborted") -> int:
        """Finish every running and waiting request with "abort" now; how many there were."""
        reqs = request_end.take_every_request(self)
        for req in reqs:
            request_end.finish(self, req, "abort")
        return len(reqs)

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
                step_plan.retract(self, req)
        else:
            touched = len(self.running)
        self.paused = mode
        return touched

    def resume(self) -> None:
        """End a pause: held and waiting requests go on at the next schedule()."""
        self.paused = None

    # ------------------------------------------------------------------ the step

    def schedule(self) -> Batch | None:
        """Pick the next step's work: every running request, then new admissions; None
        when there is none (or generation is paused). Ends aborted and expired requests
        first, and lets requests that waited too long for a place take one (preemption.py)."""
        self._take_compiled_grammars()
        request_end.drop_aborted_and_expired(self, time.time())
        if self.paused is not None:
            return None
        preemption.take_turns(self)
        return step_plan.plan_step(self)

    def postprocess(
        self, batch: Batch, results: Sequence[StepResult | None]
    ) -> list[ReqOutput]:
        """Take the step's results (one per span, in span order: the runner's
        ``SeqOutput``s); finish requests; return the outputs to send."""
        return step_results.postprocess(self, batch, results)

    # ------------------------------------------------------------------ flush

    def flush(self) -> int:
        """Reset the radix cache and the pool; tokens freed. Nothing may run; queued
        requests (never admitted, or retracted by a pause) hold no KV and stay queued."""
        assert not self.running, "flush needs a scheduler with nothing running"
        freed = self.memory.reset()
        self.reset_counters()
        if self.drafter is not None:  # a draft model's KV goes too (STANDALONE)
            self.drafter.reset()
        return freed
