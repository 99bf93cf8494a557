"""The SglangScheduler servicer: proto in, typed messages to the ranks, proto out."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import struct_pb2, timestamp_pb2

from sglang_admin import __version__
from sglang_admin.config import ServerArgs
from sglang_admin.messages import FlushCacheReq, RankState, StateReq, StopProfileReq
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from sglang_admin.server import profiles
from sglang_admin.server.communicator import Communicator, RankUnavailable
from sglang_admin.server.convert import (
    Limits,
    ServiceError,
    chunk_to_proto,
    complete_to_proto,
    flush_timeout_from_proto,
    generate_from_proto,
    invalid,
)
from sglang_admin.server.stream_buffer import StreamOverflow
from sglang_admin.server.tokenizer_bundle import (
    NoTokenizerFiles,
    bundle_for,
    iter_chunks,
    tokenizer_dir,
)
from sglang_admin.tracing import carrier_from_metadata, server_span, trace_id_of

logger = logging.getLogger(__name__)

# Server-side default deadlines per op (the caller's deadline wins when smaller).
INFO_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 3.0
FLUSH_MARGIN_S = 30.0
PROFILE_TIMEOUT_S = 600.0
DEADLINE_MARGIN_S = 0.25
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def effective_timeout(context: grpc.aio.ServicerContext, server_default: float) -> float:
    """The smaller of the op's server default and the caller's remaining deadline, less a
    margin so that the server's answer (naming the ranks that did not answer) reaches the
    caller before its own deadline fires."""
    remaining = context.time_remaining()
    if remaining is None:
        return server_default
    margin = min(DEADLINE_MARGIN_S, remaining * 0.1)
    return max(0.0, min(remaining - margin, server_default))


class SglangSchedulerServicer(pb_grpc.SglangSchedulerServicer):
    """Serves the SglangScheduler service on top of a :class:`Communicator`."""

    def __init__(self, args: ServerArgs, comm: Communicator) -> None:
        self.args = args
        self.comm = comm
        self.start_time = time.time()
        self._static: tuple[dict, tuple] | None = None  # see _static_info
        self.profiles = profiles.ProfileRegistry()  # the profiles this server started

    # ------------------------------------------------------------------ helpers

    def _require_ready(self) -> None:
        if self.comm.dead_ranks:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "scheduler unavailable: "
                + "; ".join(f"rank {r} {why}" for r, why in self.comm.dead_ranks.items()),
            )
        if not self.comm.ready.is_set():
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "server is starting: model loading")

    @property
    def limits(self) -> Limits:
        info = self.comm.model_info
        return Limits(
            vocab_size=int(info["vocab_size"]),
            context_length=int(info["context_length"]),
            token_capacity=int(info["token_capacity"]),
            dp_size=self.args.dp_size,
        )

    def _log(self, op: str, rid: str, carrier: dict[str, str], **fields: Any) -> None:
        if not self.args.log_requests:
            return
        trace_id = trace_id_of(carrier)
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        logger.info(
            "%s rid=%s%s%s", op, rid, f" {extra}" if extra else "",
            f" trace_id={trace_id}" if trace_id else "",
        )

    # ------------------------------------------------------------------ generate

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._require_ready()
        rid = request.request_id or uuid.uuid4().hex
        if self.comm.is_inflight(rid):
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight"
            )
        req = generate_from_proto(request, rid, self.limits)
        remaining = context.time_remaining()
        if remaining is not None:
            req.deadline = time.time() + remaining
        rank = self.comm.pick_rank(
            request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        )
        carrier = carrier_from_metadata(context.invocation_metadata())
        with server_span("Generate", carrier, request_id=rid) as forward:
            req.trace = forward
            self._log("generate", rid, carrier, rank=rank, prompt_tokens=len(req.input_ids))
            output_ids: list[int] = []
            logprobs: list[float] = []
            tops: list = []
            try:
                async for out in self.comm.generate(req, rank):
                    if out.error:
                        code = getattr(grpc.StatusCode, out.error_code or "INTERNAL")
                        raise ServiceError(code, out.error)
                    output_ids.extend(out.new_token_ids)
                    logprobs.extend(out.logprobs)
                    tops.extend(out.top_logprobs)
                    if req.stream:
                        if out.new_token_ids or out.finish_reason is None:
                            yield chunk_to_proto(rid, out, req.return_logprob)
                        if out.finish_reason is not None:
                            # As SGLang's servicer: in streaming mode the final message
                            # carries the last step's tokens (the chunks carried the rest).
                            yield complete_to_proto(
                                rid, out, out.new_token_ids, out.logprobs, out.top_logprobs,
                                req.return_logprob,
                            )
                    elif out.finish_reason is not None:
                        yield complete_to_proto(
                            rid, out, output_ids, logprobs, tops, req.return_logprob
                        )
            except RankUnavailable as exc:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            except StreamOverflow as exc:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
            self._log("generate_done", rid, carrier, completion_tokens=len(output_ids))

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        if not request.request_id:
            raise invalid("request_id must not be empty")
        found = self.comm.abort(request.request_id, request.reason or "aborted by client")
        return pb.AbortResponse(
            success=found,
            message="" if found else f"request {request.request_id!r} is not in flight",
        )

    # ------------------------------------------------------------------ health and info

    async def _rank_states(self, timeout: float) -> tuple[list[RankState], dict[int, str]]:
        async def ask() -> tuple[dict, dict]:
            return await self.comm.call_ranks(lambda rid: StateReq(rid), timeout)

        replies, failures = await self.comm.shared(f"state:{timeout:.3f}", ask)
        states = [replies[r].data["state"] for r in sorted(replies)]
        return states, failures

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        if not self.comm.healthy:
            reason = (
                "; ".join(f"rank {r} {why}" for r, why in self.comm.dead_ranks.items())
                or "model loading"
            )
            return pb.HealthCheckResponse(healthy=False, message=f"not ready: {reason}")
        _, failures = await self._rank_states(effective_timeout(context, HEALTH_TIMEOUT_S))
        if failures:
            return pb.HealthCheckResponse(
                healthy=False, message="; ".join(failures[r] for r in sorted(failures))
            )
        return pb.HealthCheckResponse(healthy=True, message="OK")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        self._require_ready()
        info = self.comm.model_info
        return pb.GetModelInfoResponse(
            model_path=info["model_path"],
            tokenizer_path=tokenizer_dir(self.args.tokenizer_path, info) or "",
            is_generation=True,
            weight_version="default",
            served_model_name=self.served_model_name,
            max_context_length=int(info["context_length"]),
            vocab_size=int(info["vocab_size"]),
            supports_vision=False,
            model_type=info.get("model_type") or "",
            eos_token_ids=list(info.get("eos_token_ids") or []),
            pad_token_id=int(info.get("pad_token_id") or 0),
            bos_token_id=int(info.get("bos_token_id") or 0),
            max_req_input_len=int(info["context_length"]) - 1,
            architectures=list(info.get("architectures") or []),
        )

    @property
    def served_model_name(self) -> str:
        return self.args.served_model_name or self.comm.model_info.get("model_path") or "unknown"

    def server_args_dict(self) -> dict[str, Any]:
        info = self.comm.model_info
        out = self.args.to_dict()
        out.update(
            model_path=info.get("model_path") or self.args.model_path,
            served_model_name=self.served_model_name,
            tokenizer_path=tokenizer_dir(self.args.tokenizer_path, info) or "",
            tp_size=1,
            pp_size=1,
            context_length=int(info.get("context_length") or 0),
            max_total_tokens=int(info.get("token_capacity") or 0),
            disaggregation_mode="null",
            is_embedding=False,
            vocab_size=int(info.get("vocab_size") or 0),
            weight_version="default",
            device=info.get("device") or self.args.device,
            dtype=info.get("dtype") or self.args.dtype,
        )
        out.pop("ipc_dir", None)
        return out

    def _static_info(
        self,
    ) -> tuple[struct_pb2.Struct, struct_pb2.Struct, timestamp_pb2.Timestamp]:
        """server_args, scheduler_info and start_time of GetServerInfo. They change only with
        the model info the ranks report, so they are built once per model info (filling the
        Structs cost most of an answer: 60 us of 70)."""
        info = self.comm.model_info
        if self._static is not None and self._static[0] is info:
            return self._static[1]
        server_args = struct_pb2.Struct()
        server_args.update(_jsonable(self.server_args_dict()))
        scheduler_info = struct_pb2.Struct()
        scheduler_info.update(
            _jsonable(
                {
                    "max_total_num_tokens": int(info.get("token_capacity") or 0),
                    "max_running_requests": self.args.max_running_requests,
                    "max_req_input_len": int(info.get("context_length") or 1) - 1,
                    "context_length": int(info.get("context_length") or 0),
                    "is_generation": True,
                    "dp_size": self.args.dp_size,
                    "model": {k: v for k, v in info.items() if not isinstance(v, dict)},
                }
            )
        )
        start = timestamp_pb2.Timestamp()
        start.FromSeconds(int(self.start_time))
        self._static = (info, (server_args, scheduler_info, start))
        return self._static[1]

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        self._require_ready()
        states, failures = await self._rank_states(effective_timeout(context, INFO_TIMEOUT_S))
        if failures:
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED
                if all("did not answer" in f for f in failures.values())
                else grpc.StatusCode.UNAVAILABLE,
                "; ".join(failures[r] for r in sorted(failures)),
            )
        info = self.comm.model_info
        server_args, scheduler_info, start = self._static_info()
        return pb.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=len(self.comm.streams),
            is_paused=any(s.flush_pending for s in states),
            last_receive_timestamp=self.comm.last_receive_time,
            uptime_seconds=time.time() - self.start_time,
            sglang_version=__version__,
            server_type="grpc",
            start_time=start,
            max_total_num_tokens=int(info.get("token_capacity") or 0),
            rank_states=[_rank_state_proto(s) for s in states],
        )

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        self._require_ready()
        include = set(request.include) or {"core"}
        unknown = sorted(include - set(LOAD_SECTIONS))
        if unknown:
            raise invalid(
                f"unknown include section(s) {', '.join(unknown)}; "
                f"valid: {', '.join(LOAD_SECTIONS)}"
            )
        if "all" in include:
            include = set(LOAD_SECTIONS)
        ranks = range(self.args.dp_size)
        if request.HasField("dp_rank"):
            if not 0 <= request.dp_rank < self.args.dp_size:
                raise invalid(
                    f"dp_rank = {request.dp_rank} is out of range [0, {self.args.dp_size - 1}]"
                )
            ranks = [request.dp_rank]
        loads = []
        for rank in ranks:
            state = self.comm.rank_states[rank] or RankState(dp_rank=rank)
            loads.append(_load_proto(state, include))
        total_running = sum(x.num_running_reqs for x in loads)
        total_waiting = sum(x.num_waiting_reqs for x in loads)
        n = max(len(loads), 1)
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=__version__,
            dp_rank_count=self.args.dp_size,
            loads=loads,
            aggregate=pb.AggregateMetrics(
                total_running_reqs=total_running,
                total_waiting_reqs=total_waiting,
                total_reqs=total_running + total_waiting,
                avg_token_usage=sum(x.token_usage for x in loads) / n,
                avg_throughput=sum(x.gen_throughput for x in loads) / n,
                avg_utilization=sum(x.utilization for x in loads) / n,
            ),
        )

    # ------------------------------------------------------------------ admin

    async def FlushCache(
        self, request: pb.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.FlushCacheResponse:
        self._require_ready()
        timeout_s = flush_timeout_from_proto(float(request.timeout_s))
        carrier = carrier_from_metadata(context.invocation_metadata())
        wait = effective_timeout(context, max(timeout_s, 0.0) + FLUSH_MARGIN_S)
        with server_span("FlushCache", carrier, timeout_s=timeout_s) as forward:
            admin_id = self.comm.new_admin_id()
            self._log("flush_cache", admin_id, carrier, timeout_s=timeout_s)
            replies, failures = await self.comm.call_ranks(
                lambda rid: FlushCacheReq(rid, timeout_s, time.time() + wait, forward), wait,
                rid=admin_id,
            )
        results = _rank_results(replies, failures, self.args.dp_size)
        for res in results:
            if res.success:
                res.tokens_freed = int(replies[res.dp_rank].data.get("tokens_freed", 0))
        _raise_if_no_answer(failures, replies)
        ok = all(r.success for r in results)
        message = "Cache flushed successfully" if ok else _failure_message(results)
        return pb.FlushCacheResponse(success=ok, message=message, rank_results=results)

    async def StartProfile(
        self, request: pb.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.ProfileResponse:
        """Start (or arm, with start_step) a torch.profiler session on every rank."""
        self._require_ready()
        registry = self.profiles
        plan = profiles.plan_start(
            request, self.args, str(self.comm.model_info.get("device") or "cpu"),
            registry.new_id(),
        )
        carrier = carrier_from_metadata(context.invocation_metadata())
        with server_span("StartProfile", carrier, profile_id=plan.profile_id) as forward:
            admin_id = self.comm.new_admin_id()
            self._log("start_profile", admin_id, carrier, profile_id=plan.profile_id,
                      output_dir=plan.output_dir)
            async with registry.lock:
                wait = effective_timeout(context, PROFILE_TIMEOUT_S)
                replies, failures = await self.comm.call_ranks(
                    lambda rid: plan.message(rid, time.time() + wait, forward), wait,
                    rid=admin_id,
                )
        results = _rank_results(replies, failures, self.args.dp_size)
        if any(r.success for r in results):
            registry.add(plan.record())
        _raise_if_no_answer(failures, replies)
        ok = all(r.success for r in results)
        message = plan.started_message() if ok else profiles.failure_message(results)
        return pb.ProfileResponse(
            success=ok, message=message, rank_results=results, profile_id=plan.profile_id
        )

    async def StopProfile(
        self, request: pb.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.ProfileResponse:
        """Stop every rank's profiler; answers once every rank has written its files."""
        self._require_ready()
        carrier = carrier_from_metadata(context.invocation_metadata())
        registry = self.profiles
        with server_span("StopProfile", carrier) as forward:
            admin_id = self.comm.new_admin_id()
            self._log("stop_profile", admin_id, carrier)
            async with registry.lock:
                wait = effective_timeout(context, PROFILE_TIMEOUT_S)
                replies, failures = await self.comm.call_ranks(
                    lambda rid: StopProfileReq(rid, time.time() + wait, forward), wait,
                    rid=admin_id,
                )
        results = _rank_results(replies, failures, self.args.dp_size)
        files: list[str] = []
        profile_id = ""
        for res in results:
            reply = replies.get(res.dp_rank)
            if reply is not None:
                res.files.extend(reply.data.get("files") or [])
                files.extend(res.files)
                profile_id = profile_id or reply.data.get("profile_id") or ""
        record = registry.get(profile_id)
        notes: list[str] = []
        if record is not None:
            record.finished = True
            record.files = list(files)
            if record.merge and files:
                merged, note = await profiles.merge_once(record, files)
                merged = [f for f in merged if f not in files]
                files.extend(merged)
                notes += [note] if note else []
        _raise_if_no_answer(failures, replies)
        ok = all(r.success for r in results)
        if ok and not files:
            message = "Stop profiling. No file written: " + " | ".join(
                f"rank {r.dp_rank}: {r.message}" for r in results
            )
        elif ok:
            where = f" to {record.output_dir}" if record is not None else ""
            message = f"Stop profiling. {len(files)} file(s) written{where}"
        else:
            message = profiles.failure_message(results)
        message += "".join(f"; {n}" for n in notes)
        return pb.ProfileResponse(
            success=ok, message=message, rank_results=results, files=files, profile_id=profile_id
        )

    # ------------------------------------------------------------------ not served

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> Any:
        raise ServiceError(grpc.StatusCode.UNIMPLEMENTED, "Embed: this worker serves a generation model only")

    async def LoadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise ServiceError(grpc.StatusCode.UNIMPLEMENTED, "LoRA adapters are not supported by this worker")

    async def UnloadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise ServiceError(grpc.StatusCode.UNIMPLEMENTED, "LoRA adapters are not supported by this worker")

    async def ListLoadedLoRAAdapters(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise ServiceError(grpc.StatusCode.UNIMPLEMENTED, "LoRA adapters are not supported by this worker")

    async def GetTokenizer(
        self, request: pb.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GetTokenizerChunk]:
        """Stream a zip of the model's tokenizer files (server/tokenizer_bundle.py).

        Files at the zip root, at most 50 entries, built once in a thread and cached;
        chunks of at most 512 KiB, the last one carrying the hex SHA-256 of the whole zip
        (earlier ones an empty sha256). The directory is --tokenizer-path, else the
        model's tokenizer directory, else the model directory. FAILED_PRECONDITION when it
        holds no tokenizer files.
        """
        self._require_ready()
        info = self.comm.model_info
        directory = tokenizer_dir(self.args.tokenizer_path, info) or info.get("model_path")
        if not directory:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION, "this worker has no tokenizer directory"
            )
        try:
            bundle = await bundle_for(directory).get()
        except NoTokenizerFiles as exc:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        carrier = carrier_from_metadata(context.invocation_metadata())
        self._log("get_tokenizer", "-", carrier, files=len(bundle.names), bytes=len(bundle.data))
        for data, digest in iter_chunks(bundle):
            yield pb.GetTokenizerChunk(data=data, sha256=digest)

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch]:
        """Stream the ranks' radix cache events as fixed-size KV blocks (server/kv_events.py).

        Decision: the SMG gateway's event index is positional over fixed-size blocks (it
        cuts request tokens into block_size chunks from position 0 and learns block_size
        from the first stored block), while the radix cache is token-granular with
        variable-length nodes. The server maps node events onto aligned blocks of
        KV_BLOCK_SIZE tokens (16, the gateway's default; env SGLANG_ADMIN_KV_BLOCK_SIZE):
        a block belongs to the node it ends in and its hash chains the previous block's
        hash with its tokens, so a node split changes nothing and an eviction removes the
        blocks of the evicted leaves. A FlushCache resets the cache, which is forwarded as
        KvCacheCleared.

        Sequence numbers are per dp_rank (every batch carries dp_rank), one more per batch,
        from a clock-based base, as the gateway keeps one cursor per rank. Start 0: the
        stream opens with a snapshot of every live block (a KvCacheCleared, then the stored
        runs), numbered to end at each rank's current sequence, then goes live. A non-zero
        start resumes from the kept history (one rank only); otherwise OUT_OF_RANGE, which
        the gateway answers by clearing the worker and resubscribing from zero. A subscriber
        that falls far behind ends with DATA_LOSS. Response headers go out before the first
        wait, so the gateway's 2 s subscribe deadline never vetoes the worker.
        """
        hub = self.comm.kv_hub
        sub = hub.subscribe(int(request.start_sequence_number))
        try:
            carrier = carrier_from_metadata(context.invocation_metadata())
            self._log(
                "subscribe_kv_events", "-", carrier,
                start=request.start_sequence_number, initial_batches=len(sub.initial),
            )
            await context.send_initial_metadata(())
            async for batch in sub.batches():
                yield batch
        finally:
            hub.unsubscribe(sub)

    async def DownloadProfile(
        self, request: pb.DownloadProfileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProfileFileChunk]:
        """Stream the files of a finished profile (empty id: the newest finished one)."""
        registry = self.profiles
        record = await profiles.find_finished(
            registry, request.profile_id, self.comm, effective_timeout(context, INFO_TIMEOUT_S)
        )
        files = profiles.profile_files(record, self.args.profile_dir)
        merged_on_disk = any("-merged" in f for f in files)
        if record.merge and files and (record.merge_task is not None or not merged_on_disk):
            # One merge per profile, shared with StopProfile and concurrent downloads.
            await profiles.merge_once(record, [f for f in files if "-merged" not in f])
            files = profiles.profile_files(record, self.args.profile_dir)
        if not files:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"profile {record.profile_id} has no files in {record.output_dir}",
            )
        for path in files:
            async for chunk in profiles.file_chunks(path):
                yield chunk


# ---------------------------------------------------------------------- helpers


def _jsonable(obj: Any) -> Any:
    """Make a value fit google.protobuf.Struct (numbers as floats, None kept)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (int, float)):
        return float(obj)
    return str(obj)


def _rank_state_proto(s: RankState) -> pb.RankState:
    return pb.RankState(
        dp_rank=s.dp_rank,
        num_running_reqs=s.num_running_reqs,
        num_waiting_reqs=s.num_waiting_reqs,
        token_capacity=s.token_capacity,
        num_used_tokens=s.num_used_tokens,
        num_evictable_tokens=s.num_evictable_tokens,
        cache_hit_rate=s.cache_hit_rate,
        gen_throughput=s.gen_throughput,
        profiler_state=s.profiler_state,
        last_step_time_s=s.last_step_time_s,
        forward_steps=s.forward_steps,
        device=s.device,
        pid=s.pid,
        flush_pending=s.flush_pending,
    )


def _load_proto(s: RankState, include: set[str]) -> pb.SchedulerLoad:
    capacity = max(s.token_capacity, 1)
    active = s.num_used_tokens - s.num_evictable_tokens
    load = pb.SchedulerLoad(
        dp_rank=s.dp_rank,
        num_running_reqs=s.num_running_reqs,
        num_waiting_reqs=s.num_waiting_reqs,
        num_total_reqs=s.num_running_reqs + s.num_waiting_reqs,
        num_used_tokens=s.num_used_tokens,
        max_total_num_tokens=s.token_capacity,
        token_usage=s.num_used_tokens / capacity,
        gen_throughput=s.gen_throughput,
        cache_hit_rate=s.cache_hit_rate,
        utilization=max(active, 0) / capacity,
        max_running_requests=s.max_running_requests,
        num_waiting_uncached_tokens=s.num_waiting_uncached_tokens,
    )
    if "memory" in include:
        load.memory.CopyFrom(
            pb.MemoryMetrics(
                weight_gb=s.weight_gb, kv_cache_gb=s.kv_cache_gb, token_capacity=s.token_capacity
            )
        )
    if "queues" in include:
        load.queues.CopyFrom(
            pb.QueueMetrics(waiting=s.num_waiting_reqs, retracted=s.num_retracted_reqs)
        )
    if "disagg" in include:
        load.disaggregation.CopyFrom(pb.DisaggregationMetrics(mode="null"))
    if "spec" in include:
        load.speculative.CopyFrom(pb.SpeculativeMetrics())
    if "lora" in include:
        load.lora.CopyFrom(pb.LoRAMetrics())
    return load


def _rank_results(replies: dict, failures: dict[int, str], dp_size: int) -> list[pb.RankResult]:
    results = []
    for rank in range(dp_size):
        if rank in replies:
            r = replies[rank]
            results.append(pb.RankResult(dp_rank=rank, success=r.success, message=r.message))
        else:
            results.append(
                pb.RankResult(dp_rank=rank, success=False, message=failures.get(rank, "no answer"))
            )
    return results


def _failure_message(results: list[pb.RankResult]) -> str:
    return " | ".join(f"rank {r.dp_rank}: {r.message}" for r in results if not r.success)


def _raise_if_no_answer(failures: dict[int, str], replies: dict) -> None:
    """A rank that did not answer in time fails the whole call with DEADLINE_EXCEEDED."""
    late = {r: why for r, why in failures.items() if "did not answer" in why}
    if late:
        raise ServiceError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "; ".join(late[r] for r in sorted(late)),
        )
    dead = {r: why for r, why in failures.items() if r not in late}
    if dead and not replies:
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "; ".join(dead[r] for r in sorted(dead)))


