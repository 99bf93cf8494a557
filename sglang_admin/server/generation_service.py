"""The generation RPCs: Generate, Abort (one request or all), PauseGeneration and
ContinueGeneration."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import nullcontext

import grpc

from sglang_admin.config import ServerArgs
from sglang_admin.messages import AbortAllReq, ContinueReq, CountResult, PauseReq
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.admin import AdminCalls, FanOut
from sglang_admin.server.admission import GenerateAdmission
from sglang_admin.server.communicator import Communicator, RankUnavailable
from sglang_admin.server.embedding_service import refuse_generate
from sglang_admin.server.errors import ServiceError, invalid
from sglang_admin.server.generate_codec import (
    FeatureError,
    Limits,
    SampleStreams,
    generate_from_proto,
    stream_interval_of,
)
from sglang_admin.server.stream_buffer import StreamOverflow
from sglang_admin.server.tokenizer_bundle import tokenizer_dir
from sglang_admin.tracing import carrier_from_metadata, server_span

CONTROL_TIMEOUT_S = 30.0
PAUSE_MODES = ("abort", "retract", "in_place")


def _count(out: FanOut) -> int:
    return sum(r.count for r in (out.result(k) for k in out.replies) if isinstance(r, CountResult))


def _with_counts(out: FanOut) -> list[pb.RankResult]:
    results = out.rank_results()
    for res in results:
        found = out.result(res.dp_rank)
        if isinstance(found, CountResult):
            res.num_paused_requests = found.count
    return results


class Generation:
    """Generate and the ops that act on requests in flight."""

    def __init__(self, args: ServerArgs, comm: Communicator, admin: AdminCalls,
                 admission: GenerateAdmission | None = None) -> None:
        self.args = args
        self.comm = comm
        self.admin = admin
        # the calls admitted at once (None: every call, for a caller that admits itself)
        self.admission = admission

    @property
    def limits(self) -> Limits:
        info = self.comm.model_info
        assert info is not None
        return Limits(
            vocab_size=info.vocab_size,
            context_length=info.context_length,
            token_capacity=info.token_capacity,
            dp_size=self.args.dp_size,
            lora_enabled=self.args.enable_lora,
        )

    async def generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Generate's answer, a place held for the call in ``admission`` while it lasts."""
        with self.admission.admit() if self.admission is not None else nullcontext():
            self.admin.require_ready()
            refuse_generate(self.args, self.comm.model_info)  # an embedding model
            rid = request.request_id or uuid.uuid4().hex
            if self.comm.is_inflight(rid):
                raise ServiceError(
                    grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight"
                )
            req = generate_from_proto(request, rid, self.limits)
            try:
                interval = stream_interval_of(request)
            except FeatureError as exc:
                raise invalid(str(exc)) from None
            info = self.comm.model_info
            has_tokenizer = info and tokenizer_dir(self.args.tokenizer_path, info.tokenizer_path)
            if req.stop and not has_tokenizer:
                raise invalid(
                    "sampling_params.stop needs the model's tokenizer and this worker has none "
                    "(start it with --tokenizer-path); use stop_token_ids")
            if self.comm.buffered.spent:
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server is holding {self.comm.buffered.used} bytes of output for slow "
                    f"readers (--stream-buffer-bytes-total {self.comm.buffered.limit}); new "
                    f"Generate calls are refused until they read it: retry later")
            remaining = context.time_remaining()
            if remaining is not None:
                req.deadline = time.time() + remaining
            rank = self.comm.pick_rank(
                request.data_parallel_rank if request.HasField("data_parallel_rank") else None
            )
            carrier = carrier_from_metadata(context.invocation_metadata())
            with server_span("Generate", carrier, request_id=rid) as forward:
                req.trace = forward
                self.admin.log("generate", rid, carrier, rank=rank, prompt_tokens=len(req.input_ids))
                think_end = info.think_end_id if request.require_reasoning and info else -1
                answer = SampleStreams(rid, req, interval, think_end)
                try:
                    async for out in self.comm.metrics.observe(self.comm.generate(req, rank), rank):
                        if out.error:
                            code = getattr(grpc.StatusCode, out.error_code or "INTERNAL")
                            raise ServiceError(code, out.error)
                        messages = answer.feed(out)
                        del out  # not kept while gRPC writes (a stalled call holds one message)
                        while messages:
                            yield messages.pop(0)
                        if answer.finished:
                            break
                except RankUnavailable as exc:
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
                except StreamOverflow as exc:
                    raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
                self.admin.log("generate_done", rid, carrier,
                               completion_tokens=answer.completion_tokens)

    async def abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """One request by id; with ``abort_all``, every request on every rank."""
        reason = request.reason or "aborted by client"
        if request.abort_all:
            self.admin.require_admin_key(context)
            out = await self.admin.fan_out(
                context, "abort_all", lambda rid, deadline, trace: AbortAllReq(
                    rid, reason, deadline=deadline, trace=trace), CONTROL_TIMEOUT_S)
            return pb.AbortResponse(
                success=out.ok, message=out.message(f"{_count(out)} request(s) aborted"))
        if not request.request_id:
            raise invalid("request_id must not be empty (or set abort_all)")
        found = self.comm.abort(request.request_id, reason)
        return pb.AbortResponse(
            success=found,
            message="" if found else (
                f"request {request.request_id!r} is not in flight (or already aborted)"),
        )

    async def pause(
        self, request: pb.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PauseGenerationResponse:
        mode = request.mode or "abort"
        if mode not in PAUSE_MODES:
            raise invalid(f"mode {request.mode!r} is not one of {', '.join(PAUSE_MODES)}")
        out = await self.admin.fan_out(
            context, "pause_generation",
            lambda rid, deadline, trace: PauseReq(rid, mode, deadline=deadline, trace=trace),
            CONTROL_TIMEOUT_S, mode=mode,
        )
        count = _count(out)
        return pb.PauseGenerationResponse(
            success=out.ok, message=out.message(f"Generation paused ({mode}): {count} request(s)"),
            rank_results=_with_counts(out), num_paused_requests=count,
        )

    async def resume(
        self, request: pb.ContinueGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdminResponse:
        empty = request.torch_empty_cache if request.HasField("torch_empty_cache") else False
        out = await self.admin.fan_out(
            context, "continue_generation",
            lambda rid, deadline, trace: ContinueReq(rid, deadline=deadline, trace=trace,
                                                     torch_empty_cache=empty),
            CONTROL_TIMEOUT_S,
        )
        return pb.AdminResponse(success=out.ok, message=out.message("Generation continued"),
                                rank_results=out.rank_results())
