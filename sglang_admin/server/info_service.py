"""The read-only RPCs: HealthCheck, GetModelInfo, GetServerInfo, GetLoads, GetTokenizer and
SubscribeKvEvents."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import struct_pb2, timestamp_pb2

from sglang_admin import __version__
from sglang_admin.config import ServerArgs
from sglang_admin.messages import ModelInfo, RankState, StateReq
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.admin import (
    AdminCalls,
    CallContext,
    effective_timeout,
    rank_failure_text,
)
from sglang_admin.server.communicator import Communicator, RankFailure
from sglang_admin.server.errors import Serialized, ServiceError, invalid
from sglang_admin.server.kv_loads import LoadFeed, batches_with_loads
from sglang_admin.server.tokenizer_bundle import (
    NoTokenizerFiles,
    bundle_for,
    iter_chunks,
    tokenizer_dir,
)
from sglang_admin.tracing import carrier_from_metadata

# Server-side default deadlines (the caller's deadline wins when smaller).
INFO_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 3.0
# A rank whose main loop published or confirmed its state this recently is alive for
# HealthCheck (no round trip)
HEALTH_FRESH_S = 1.0
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
# The version GetServerInfo.sglang_version and GetLoads.version report: what answers, and
# the wire it speaks (this is not SGLang; its clients should not read an SGLang release here)
WIRE_PROTO = "smg-grpc-proto 0.4.28"
VERSION = f"sglang_admin {__version__} ({WIRE_PROTO} SglangScheduler wire)"


class Info:
    """What the worker says about itself."""

    def __init__(self, args: ServerArgs, comm: Communicator, admin: AdminCalls) -> None:
        self.args = args
        self.comm = comm
        self.admin = admin
        self.start_time = time.time()
        self._static: tuple[ModelInfo, bytes] | None = None  # see _static_info

    @property
    def model(self) -> ModelInfo:
        assert self.comm.model_info is not None, "called before require_ready"
        return self.comm.model_info

    async def rank_states(self, timeout: float) -> tuple[list[RankState], dict[int, RankFailure]]:
        """Every rank's live state (a round trip; concurrent callers share one)."""

        async def ask() -> tuple[dict, dict]:
            return await self.comm.call_ranks(lambda rid: StateReq(rid), timeout)

        replies, failures = await self.comm.shared(f"state:{timeout:.3f}", ask)
        return [replies[r].result for r in sorted(replies)], failures

    async def health(
        self, request: pb.HealthCheckRequest, context: CallContext
    ) -> pb.HealthCheckResponse:
        if not self.comm.healthy:
            reason = (
                "; ".join(f"rank {r} {why}" for r, why in self.comm.dead_ranks.items())
                or "model loading"
            )
            return pb.HealthCheckResponse(healthy=False, message=f"not ready: {reason}")
        if all(self.comm.rank_states[r] is not None
               and self.comm.state_age(r) <= HEALTH_FRESH_S for r in range(self.args.dp_size)):
            # Every rank's main loop published or confirmed its state within the last
            # HEALTH_FRESH_S: alive, shown without a round trip. A busy rank publishes as it
            # steps; a round trip would wait for its step to end (a burst of thousands of
            # calls made the answer late enough for a router to take the worker for dead).
            return pb.HealthCheckResponse(healthy=True, message="OK")
        _, failures = await self.rank_states(effective_timeout(context, HEALTH_TIMEOUT_S))
        if failures:
            return pb.HealthCheckResponse(
                healthy=False, message=rank_failure_text({r: f.message for r, f in failures.items()})
            )
        return pb.HealthCheckResponse(healthy=True, message="OK")

    async def model_info(
        self, request: pb.GetModelInfoRequest, context: CallContext
    ) -> pb.GetModelInfoResponse:
        self.admin.require_ready()
        info = self.model
        return pb.GetModelInfoResponse(
            model_path=info.model_path,
            tokenizer_path=tokenizer_dir(self.args.tokenizer_path, info.tokenizer_path) or "",
            is_generation=info.is_generation,
            num_labels=info.num_labels,
            id2label_json=json.dumps(info.id2label) if info.id2label else "",
            weight_version=info.weight_version,
            served_model_name=self.served_model_name,
            max_context_length=info.context_length,
            vocab_size=info.vocab_size,
            supports_vision=False,
            model_type=info.model_type,
            eos_token_ids=info.eos_token_ids,
            pad_token_id=info.pad_token_id or 0,
            bos_token_id=info.bos_token_id or 0,
            max_req_input_len=self.max_req_input_len,
            architectures=info.architectures,
            # the checkpoint's generation_config.json defaults: the router fills the sampling
            # fields a request leaves unset from them (SGLang's servicer sends the same)
            default_sampling_params_json=(
                json.dumps(info.sampling_defaults, separators=(",", ":"), sort_keys=True)
                if info.sampling_defaults else ""),
            preferred_sampling_params=self.args.preferred_sampling_params or "",
        )

    @property
    def max_req_input_len(self) -> int:
        """The longest prompt Generate takes: the context or the KV pool, whichever is
        smaller, less one (server/generate_codec/request.py's Limits)."""
        info = self.model
        return min(info.context_length, info.token_capacity) - 1

    @property
    def served_model_name(self) -> str:
        return self.args.served_model_name or self.model.model_path or "unknown"

    def server_args_dict(self) -> dict[str, Any]:
        info = self.model
        out = self.args.to_dict()
        out.update(
            model_path=info.model_path,
            served_model_name=self.served_model_name,
            tokenizer_path=tokenizer_dir(self.args.tokenizer_path, info.tokenizer_path) or "",
            tp_size=self.args.tp_size,
            pp_size=1,
            context_length=info.context_length,
            max_total_tokens=info.token_capacity,
            disaggregation_mode="null",
            is_embedding=not info.is_generation,
            vocab_size=info.vocab_size,
            weight_version=info.weight_version,
            device=info.device,
            dtype=info.dtype,
        )
        out.pop("ipc_dir", None)
        out.update(self._sglang_names())
        return out

    def _sglang_names(self) -> dict[str, Any]:
        """SGLang's server_args keys for the settings that have one here (SGLang's clients
        read these names); this worker's own names stay beside them."""
        a = self.args
        return {
            "random_seed": a.seed,
            "watchdog_timeout": a.watchdog_timeout_s,
            "chunked_prefill_size": a.max_prefill_tokens,
            "disable_cuda_graph": a.cuda_graph_max_bs == 0,
            "enable_trace": a.otlp_traces_endpoint is not None,
            "kv_cache_dtype": "auto",  # the KV pool holds the model's dtype
            "page_size": 1,  # the radix cache and KV pool are token-granular
            "chat_template": None,  # the tokenizer's own (the router applies it)
            "tool_call_parser": None,  # the router parses tool calls
            "reasoning_parser": a.reasoning_parser,
            "preferred_sampling_params": a.preferred_sampling_params,
            "sampling_defaults": "model",  # generation_config.json, through the router
            "skip_tokenizer_init": True,  # prompts arrive as token ids
            "grpc_mode": True,
            "enable_lora": a.enable_lora,
            "max_lora_rank": a.max_lora_rank if a.enable_lora else None,
        }

    def _static_info(self) -> bytes:
        """The part of GetServerInfo's answer that changes only with the model info the ranks
        report (a new object after every weight op): server_args, scheduler_info, start_time,
        the version and the token capacity, serialized once per model info (filling and then
        copying and serializing the Structs cost most of an answer)."""
        info = self.model
        if self._static is not None and self._static[0] is info:
            return self._static[1]
        server_args = struct_pb2.Struct()
        server_args.update(_jsonable(self.server_args_dict()))
        scheduler_info = struct_pb2.Struct()
        scheduler_info.update(
            _jsonable(
                {
                    "max_total_num_tokens": info.token_capacity,
                    "max_running_requests": self.args.max_running_requests,
                    "max_req_input_len": self.max_req_input_len,
                    "max_req_len": min(info.context_length, info.token_capacity),
                    "context_length": info.context_length,
                    "is_generation": info.is_generation,
                    "dp_size": self.args.dp_size,
                    "tp_size": self.args.tp_size,
                    "model": dataclasses.asdict(info),
                }
            )
        )
        start = timestamp_pb2.Timestamp()
        start.FromSeconds(int(self.start_time))
        static = pb.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            sglang_version=VERSION,
            server_type="grpc",
            start_time=start,
            max_total_num_tokens=info.token_capacity,
        ).SerializeToString()
        self._static = (info, static)
        return static

    async def server_info(
        self, request: pb.GetServerInfoRequest, context: CallContext
    ) -> Serialized:
        """GetServerInfo's answer, in wire form: the static part serialized once
        (:meth:`_static_info`), then what each call finds."""
        self.admin.require_ready()
        states, failures = await self.rank_states(effective_timeout(context, INFO_TIMEOUT_S))
        if failures:
            late = all(f.kind == "timeout" for f in failures.values())
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.UNAVAILABLE,
                rank_failure_text({r: f.message for r, f in failures.items()}),
            )
        static = self._static_info()
        now = time.time()
        live = pb.GetServerInfoResponse(
            active_requests=len(self.comm.streams),
            is_paused=any(s.flush_pending or s.paused for s in states),
            last_receive_timestamp=self.comm.last_receive_time,
            uptime_seconds=now - self.start_time,
        )
        for state in states:
            _add_rank_state(live.rank_states, state, now - state.timestamp)
        verify = sum(s.spec_verify_steps for s in states)
        if verify:  # over every rank's verify steps
            live.avg_spec_accept_length = sum(
                s.spec_accepted_tokens + s.spec_verify_steps for s in states) / verify
        return Serialized(static + live.SerializeToString())

    async def loads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        self.admin.require_ready()
        include = set(request.include) or {"all"}  # as SGLang: none named is every one
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
            loads.append(_load_proto(state, include, self.comm.state_age(rank),
                                     self.args.speculative_algorithm is not None))
        total_running = sum(x.num_running_reqs for x in loads)
        total_waiting = sum(x.num_waiting_reqs for x in loads)
        n = max(len(loads), 1)
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=VERSION,
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

    async def tokenizer(
        self, request: pb.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GetTokenizerChunk]:
        self.admin.require_ready()
        info = self.model
        directory = tokenizer_dir(self.args.tokenizer_path, info.tokenizer_path) or info.model_path
        if not directory:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION, "this worker has no tokenizer directory"
            )
        try:
            bundle = await bundle_for(directory).get()
        except NoTokenizerFiles as exc:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        carrier = carrier_from_metadata(context.invocation_metadata())
        self.admin.log("get_tokenizer", "-", carrier, files=len(bundle.names),
                       bytes=len(bundle.data))
        for data, digest in iter_chunks(bundle):
            yield pb.GetTokenizerChunk(data=data, sha256=digest)

    async def kv_events(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch | Serialized]:
        """The KV event stream (server/kv_events.py), each batch with its rank's load and
        load-only batches between them (server/kv_loads.py)."""
        hub = self.comm.kv_hub
        sub = hub.subscribe(int(request.start_sequence_number))
        try:
            carrier = carrier_from_metadata(context.invocation_metadata())
            self.admin.log(
                "subscribe_kv_events", "-", carrier,
                start=request.start_sequence_number, initial_batches=len(sub.initial),
            )
            await context.send_initial_metadata(())
            feed = LoadFeed(lambda: self.comm.rank_states, self.comm.state_age,
                            request.load_records_before_first_batch,
                            self.args.speculative_algorithm is not None)
            async for batch in batches_with_loads(sub, feed):
                yield batch
        finally:
            hub.unsubscribe(sub)


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


def _add_rank_state(states: Any, s: RankState, age: float) -> None:
    """Append rank state ``s`` to a repeated RankState field (made in place, not copied)."""
    states.add(
        dp_rank=s.dp_rank,
        num_running_reqs=s.num_running_reqs,
        num_waiting_reqs=s.num_waiting_reqs,
        token_capacity=s.token_capacity,
        num_used_tokens=s.num_used_tokens,
        num_evictable_tokens=s.num_evictable_tokens,
        num_free_tokens=s.num_free_tokens,
        cache_hit_rate=s.cache_hit_rate,
        gen_throughput=s.gen_throughput,
        profiler_state=s.profiler_state,
        last_step_time_s=s.last_step_time_s,
        forward_steps=s.forward_steps,
        device=s.device,
        pid=s.pid,
        flush_pending=s.flush_pending,
        state_age_s=max(0.0, age),
        avg_spec_accept_length=s.spec_accept_length,
        spec_accept_rate=s.spec_accept_rate,
        spec_verify_steps=s.spec_verify_steps,
    )


def _load_proto(s: RankState, include: set[str], age: float,
                spec_on: bool = False) -> pb.SchedulerLoad:
    capacity = max(s.token_capacity, 1)
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
        utilization=s.num_used_tokens / capacity,
        max_running_requests=s.max_running_requests,
        num_waiting_uncached_tokens=s.num_waiting_uncached_tokens,
        state_age_s=age,
        num_evictable_tokens=s.num_evictable_tokens,
        num_free_tokens=s.num_free_tokens,
    )
    if "memory" in include:
        load.memory.CopyFrom(
            pb.MemoryMetrics(
                weight_gb=s.weight_gb, kv_cache_gb=s.kv_cache_gb, graph_gb=s.graph_gb,
                token_capacity=s.token_capacity,
            )
        )
    if "queues" in include:
        load.queues.CopyFrom(
            pb.QueueMetrics(waiting=s.num_waiting_reqs, grammar=s.num_grammar_queue_reqs,
                            paused=s.num_paused_reqs, retracted=s.num_retracted_reqs)
        )
    if "disagg" in include:
        load.disaggregation.CopyFrom(pb.DisaggregationMetrics(mode="null"))
    if "lora" in include and s.lora_slots_total:
        load.lora.CopyFrom(pb.LoRAMetrics(
            slots_used=s.lora_slots_used, slots_total=s.lora_slots_total,
            utilization=s.lora_slots_used / s.lora_slots_total,
        ))
    if "spec" in include and spec_on:  # speculative decoding
        load.speculative.CopyFrom(pb.SpeculativeMetrics(
            accept_length=s.spec_accept_length, accept_rate=s.spec_accept_rate))
    # "spec" without --speculative-algorithm, "lora" without --enable-lora: left out, as
    # SGLang does while the feature is off
    return load
