"""Turns one Generate call's rank outputs into its answer, sample by sample.

A request with n samples gets outputs tagged with each sample's ``index``. Streaming: a
chunk per ``stream_interval`` new tokens of a sample (the last one shorter), then that
sample's GenerateComplete carrying the tokens of its last chunk, as SGLang's servicer does.
Not streaming: one GenerateComplete per sample, with every output token (a matched stop
string's tokens dropped unless ``no_stop_trim``). The call ends when all n completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_admin.messages import GenerateReq, ReqOutput
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.scheduler.reasoning import count_reasoning
from sglang_admin.server.generate_codec.response import (
    hidden_states_proto,
    input_logprobs_proto,
    stop_trimmed,
    token_ids_logprobs_proto,
)

TopList = list[tuple[int, float]]


@dataclass
class _Part:
    """Tokens with what came along with them."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopList] = field(default_factory=list)
    by_ids: list[TopList] = field(default_factory=list)
    hidden: list[list[float]] = field(default_factory=list)

    def add(self, out: ReqOutput) -> None:
        self.ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs)
        self.tops.extend(out.top_logprobs)
        self.by_ids.extend(out.token_ids_logprobs)
        self.hidden.extend(out.hidden_states)

    def cut(self, keep: int) -> _Part:
        """The first ``keep`` tokens (a copy)."""
        return _Part(self.ids[:keep], self.logprobs[:keep], self.tops[:keep],
                     self.by_ids[:keep], self.hidden[:keep])

    def drop(self, count: int) -> None:
        """Forget the first ``count`` tokens."""
        for part in (self.ids, self.logprobs, self.tops, self.by_ids, self.hidden):
            del part[:count]


@dataclass
class _Sample:
    all: _Part = field(default_factory=_Part)  # not streaming: every token, for the answer
    tokens: int = 0  # output tokens received
    pending: _Part = field(default_factory=_Part)  # streaming: not sent in a chunk yet
    sent: int = 0  # output tokens already streamed
    done: bool = False
    reasoning: int = 0  # output tokens inside the think span (require_reasoning)
    thinking: bool = True  # the think span has not ended yet


class SampleStreams:
    """The answer of one Generate call: feed it rank outputs, send what it returns."""

    def __init__(self, rid: str, req: GenerateReq, stream_interval: int,
                 think_end_id: int = -1) -> None:
        self.rid = rid
        self.req = req
        self.interval = stream_interval
        # require_reasoning with --reasoning-parser: the token that ends the think span (as
        # SGLang's scheduler, the tokens up to and including it are reasoning tokens)
        self.think_end_id = think_end_id
        # the prompt logprobs (built when they come), and whether a chunk carried them
        self.prompt_logprobs: pb.InputLogProbs | None = None
        self.input_logprobs_sent = False
        self.samples = [_Sample() for _ in range(max(req.n, 1))]
        self.done = 0  # samples completed
        # a chunk per output with its tokens alone (most calls): no pending bookkeeping
        self.tokens_only = (req.stream and stream_interval == 1 and not req.return_logprob
                            and not req.return_hidden_states)

    @property
    def finished(self) -> bool:
        return self.done == len(self.samples)

    @property
    def completion_tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    def feed(self, out: ReqOutput) -> list[pb.GenerateResponse]:
        """The messages this output produces (none, chunks and/or a complete)."""
        if not 0 <= out.index < len(self.samples):
            return []
        sample = self.samples[out.index]
        if out.input_logprobs:
            self._input_logprobs(out)
        if self.think_end_id >= 0 and sample.thinking and out.new_token_ids:
            count, ended = count_reasoning(out.new_token_ids, self.think_end_id)
            sample.reasoning += count
            sample.thinking = not ended
        if self.tokens_only and out.finish_reason is None and not sample.pending.ids:
            ids = out.new_token_ids  # what _due and _chunk make of it, without the copies
            sample.tokens += len(ids)
            sample.sent += len(ids)
            # filled in place: building the chunk apart and passing it copied it (2x the time)
            response = pb.GenerateResponse(request_id=self.rid)
            chunk = response.chunk
            chunk.token_ids.extend(ids)
            chunk.prompt_tokens = out.prompt_tokens
            chunk.completion_tokens = sample.sent
            chunk.cached_tokens = out.cached_tokens
            chunk.reasoning_tokens = sample.reasoning
            chunk.index = out.index
            return [response]
        sample.tokens += len(out.new_token_ids)
        answers: list[pb.GenerateResponse] = []
        if self.req.stream:  # streamed tokens are not kept once sent (a call's memory)
            sample.pending.add(out)
            final = out.finish_reason is not None
            last = _Part()
            for part in self._due(sample.pending, final, bool(out.new_token_ids)):
                answers.append(self._chunk(out, part, sample.sent, sample.reasoning))
                last, sample.sent = part, sample.sent + len(part.ids)
            if final:
                answers.append(self._complete(out, last, sample.sent - len(last.ids),
                                              sample.reasoning))
        else:
            sample.all.add(out)
        if not self.req.stream and out.finish_reason is not None:
            keep = stop_trimmed(out, sample.tokens)
            answers.append(self._complete(out, sample.all.cut(keep), 0, sample.reasoning))
        if out.finish_reason is not None and not sample.done:
            sample.done = True
            self.done += 1
        return answers

    def _due(self, pending: _Part, final: bool, new_tokens: bool) -> list[_Part]:
        """The chunks to send now, taken out of ``pending``. Interval 1: everything that
        piled up in one chunk (as without the field); N > 1: N tokens per chunk, and at
        the end what is left."""
        if self.interval == 1:
            if pending.ids or (not final and not new_tokens):
                taken = pending.cut(len(pending.ids))
                pending.drop(len(pending.ids))
                return [taken]
            return []
        parts: list[_Part] = []
        while len(pending.ids) >= self.interval or (final and pending.ids):
            size = min(self.interval, len(pending.ids))
            parts.append(pending.cut(size))
            pending.drop(size)
        return parts

    def _logprobs(self, part: _Part) -> pb.OutputLogProbs:
        lps = pb.OutputLogProbs(
            token_logprobs=part.logprobs,
            token_ids=part.ids,
            top_logprobs=token_ids_logprobs_proto(part.tops),
        )
        if part.by_ids:
            lps.token_ids_logprobs.extend(token_ids_logprobs_proto(part.by_ids))
        return lps

    def _input_logprobs(self, out: ReqOutput) -> pb.InputLogProbs | None:
        """The prompt logprobs (the rank sends them once, with the first output token), for
        the first streamed chunk and every complete, as SGLang's servicer; None when the
        request asked for none or they have not come yet."""
        if (self.prompt_logprobs is None and self.req.return_logprob and out.input_logprobs
                and self.req.logprob_start_len >= 0):
            self.prompt_logprobs = input_logprobs_proto(
                self.req.input_ids, self.req.logprob_start_len, out.input_logprobs,
                out.input_top_logprobs)
        return self.prompt_logprobs

    def _chunk(self, out: ReqOutput, part: _Part, first: int,
               reasoning: int = 0) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=self.rid)
        chunk = response.chunk  # filled in place, not built apart and copied in
        chunk.token_ids.extend(part.ids)
        chunk.prompt_tokens = out.prompt_tokens
        chunk.completion_tokens = first + len(part.ids)
        chunk.cached_tokens = out.cached_tokens
        chunk.reasoning_tokens = reasoning
        chunk.index = out.index
        if self.req.return_logprob:
            chunk.output_logprobs.CopyFrom(self._logprobs(part))
            if not self.input_logprobs_sent and out.index == 0:
                prompt = self._input_logprobs(out)
                if prompt is not None:
                    chunk.input_logprobs.CopyFrom(prompt)
                    self.input_logprobs_sent = True
        for row in part.hidden:
            chunk.hidden_states.extend(row)
        return response

    def _complete(self, out: ReqOutput, part: _Part, first: int,
                  reasoning: int = 0) -> pb.GenerateResponse:
        complete = pb.GenerateComplete(
            output_ids=part.ids,
            finish_reason=out.finish_reason or "stop",
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            reasoning_tokens=reasoning,
            index=out.index,
            spec_accepted_tokens=out.spec_accepted_tokens,
            spec_draft_tokens=out.spec_draft_tokens,
            spec_verify_ct=out.spec_verify_ct,
        )
        if out.matched_token_id is not None:
            complete.matched_token_id = out.matched_token_id
        elif out.matched_stop_str is not None:
            complete.matched_stop_str = out.matched_stop_str
        if self.req.return_logprob:
            complete.output_logprobs.CopyFrom(self._logprobs(part))
            prompt = self._input_logprobs(out) if out.index == 0 else None
            if prompt is not None:
                complete.input_logprobs.CopyFrom(prompt)
        if part.hidden:
            complete.all_hidden_states.extend(
                hidden_states_proto(part.hidden, out.prompt_tokens + first))
        return pb.GenerateResponse(request_id=self.rid, complete=complete)
