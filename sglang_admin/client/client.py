"""The one source of the SglangScheduler client: :class:`AsyncClient` (grpc.aio).

Every RPC is written once, here, as an ``async`` method (the four that take weights from
a trainer's process group or shared memory in client/trainer_rpcs.py, a base of this class). The blocking
:class:`~sglang_admin.client.blocking.Client` is derived from this class (each coroutine
method becomes a blocking method, each async-generator method an iterator, run on the
client's own event loop thread), and :class:`~sglang_admin.client.fanout.FanOut` runs any
``AsyncClient`` call on many targets at once. The methods return the proto messages of
``sglang_admin.pb.common_pb2`` as they come off the wire; failed calls raise
``grpc.RpcError`` (``code()``/``details()``); a profile download whose bytes do not match
the server's digest raises :class:`~sglang_admin.client.errors.DownloadError`.

Adding an RPC (the client method and the CLI command included): the recipe and its worked
example are in CONTRIBUTING.md, the one place they are written.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.client.channel import bearer_metadata, channel_credentials
from sglang_admin.client.download import ProfileWriter
from sglang_admin.client.generate_result import GenerateResult, collect, collect_samples
from sglang_admin.client.reflection import list_services, offers
from sglang_admin.client.trainer_rpcs import TrainerWeightRPCs
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:30000"
# The server may send messages up to 64 MiB (its send limit); accept them.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 64 << 20)]
# Channels to one target with the same options share one connection (grpc's global
# subchannel pool); this option gives a channel a connection of its own, e.g. to spread a
# burst of thousands of streams over several connections (docs/bursts.md).
OWN_CONNECTION: tuple[str, Any] = ("grpc.use_local_subchannel_pool", 1)


class AsyncClient(TrainerWeightRPCs):
    """grpc.aio client of one worker. Create and use it inside one event loop.

    ``api_key`` is sent as ``authorization: Bearer KEY`` (use the admin key for the admin
    RPCs when the server has one); any of ``tls_ca``/``tls_cert``/``tls_key`` (PEM files)
    selects TLS; ``timeout`` is the per-call deadline in seconds (``None``: none).
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.metadata = bearer_metadata(api_key)
        self._creds = channel_credentials(tls_ca, tls_cert, tls_key)
        if self._creds is None:
            self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.secure_channel(target, self._creds, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self._services: dict[str, list[str]] | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (in-flight calls are cancelled)."""
        await self.channel.close()

    def _call_options(self) -> dict[str, Any]:
        """The deadline and metadata every call of this client carries."""
        return {"timeout": self.timeout, "metadata": self.metadata}

    # ------------------------------------------------------------------ info and health

    async def health(self) -> pb.HealthCheckResponse:
        """SglangScheduler.HealthCheck: a round trip to every scheduler rank."""
        return await self.stub.HealthCheck(pb.HealthCheckRequest(), **self._call_options())

    async def health_v1(self, service: str = "") -> str:
        """grpc.health.v1 status name (``SERVING``, ``NOT_SERVING``, ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        req = health_pb2.HealthCheckRequest(service=service)
        resp = await stub.Check(req, **self._call_options())
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def model_info(self) -> pb.GetModelInfoResponse:
        """GetModelInfo."""
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._call_options())

    async def server_info(self) -> pb.GetServerInfoResponse:
        """GetServerInfo."""
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), **self._call_options())

    async def loads(
        self, include: Sequence[str] = (), dp_rank: int | None = None
    ) -> pb.GetLoadsResponse:
        """GetLoads for the ``include`` sections (server default: core), one rank or all."""
        req = pb.GetLoadsRequest(include=list(include))
        if dp_rank is not None:
            req.dp_rank = dp_rank
        return await self.stub.GetLoads(req, **self._call_options())

    async def metrics(self) -> pb.GetMetricsResponse:
        """GetMetrics: the Prometheus text exposition (needs --enable-metrics)."""
        return await self.stub.GetMetrics(pb.GetMetricsRequest(), **self._call_options())

    # ------------------------------------------------------------------ admin

    async def flush_cache(self, timeout_s: float = 0.0) -> pb.FlushCacheResponse:
        """FlushCache; ``timeout_s`` > 0 waits that long for every rank to go idle."""
        req = pb.FlushCacheRequest(timeout_s=timeout_s)
        return await self.stub.FlushCache(req, **self._call_options())

    async def start_profile(
        self,
        *,
        output_dir: str | None = None,
        start_step: int | None = None,
        num_steps: int | None = None,
        activities: Sequence[str] = (),
        with_stack: bool | None = None,
        record_shapes: bool | None = None,
        profile_by_stage: bool = False,
        merge_profiles: bool | None = None,
        profile_prefix: str | None = None,
        profile_stages: Sequence[str] = (),
    ) -> pb.ProfileResponse:
        """StartProfile; an argument left at ``None`` leaves its optional field unset (the
        server's default)."""
        optional: dict[str, Any] = {
            "output_dir": output_dir,
            "start_step": start_step,
            "num_steps": num_steps,
            "with_stack": with_stack,
            "record_shapes": record_shapes,
            "merge_profiles": merge_profiles,
            "profile_prefix": profile_prefix,
        }
        req = pb.StartProfileRequest(
            activities=list(activities),
            profile_by_stage=profile_by_stage,
            profile_stages=list(profile_stages),
            **{k: v for k, v in optional.items() if v is not None},
        )
        return await self.stub.StartProfile(req, **self._call_options())

    async def stop_profile(self) -> pb.ProfileResponse:
        """StopProfile: answers once every rank has written its traces."""
        return await self.stub.StopProfile(pb.StopProfileRequest(), **self._call_options())

    async def download_profile(
        self, dest_dir: str | os.PathLike[str], *, profile_id: str = ""
    ) -> list[Path]:
        """DownloadProfile into ``dest_dir``; returns the files written, each verified
        against the sha256 on its last chunk (:class:`DownloadError` otherwise)."""
        writer = ProfileWriter(dest_dir)
        req = pb.DownloadProfileRequest(profile_id=profile_id)
        call = self.stub.DownloadProfile(req, **self._call_options())
        try:
            async for chunk in call:
                writer.add(chunk)
        finally:
            call.cancel()
        return writer.close()

    # ------------------------------------------------------------------ RL refit

    async def pause_generation(self, mode: str = "abort") -> pb.PauseGenerationResponse:
        """PauseGeneration on every rank. ``mode``: ``abort`` aborts every request in
        flight, ``retract`` moves running requests back to the queue and frees their KV (a
        flush then succeeds), ``in_place`` holds them with their KV. New Generate calls wait
        until :meth:`continue_generation`."""
        req = pb.PauseGenerationRequest(mode=mode)
        return await self.stub.PauseGeneration(req, **self._call_options())

    async def continue_generation(self, torch_empty_cache: bool = True) -> pb.AdminResponse:
        """ContinueGeneration: clear the pause; waiting and held requests go on."""
        req = pb.ContinueGenerationRequest(torch_empty_cache=torch_empty_cache)
        return await self.stub.ContinueGeneration(req, **self._call_options())

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str = "",
        abort_all_requests: bool = False,
        weight_version: str = "",
        flush_cache: bool = True,
        torch_empty_cache: bool = False,
        recapture_cuda_graph: bool = False,
    ) -> pb.UpdateWeightsResponse:
        """UpdateWeightsFromDisk: load the checkpoint directory ``model_path`` (the served
        architecture) into the live model on every rank. Unpaused, it waits for in-flight
        requests; a failed load keeps the old weights (``success`` false, ``message`` says
        why); ``weight_version`` (when not empty) is set on success; ``flush_cache`` flushes
        the prefix cache after the load."""
        req = pb.UpdateWeightsFromDiskRequest(
            model_path=model_path,
            load_format=load_format,
            abort_all_requests=abort_all_requests,
            weight_version=weight_version,
            flush_cache=flush_cache,
            torch_empty_cache=torch_empty_cache,
            recapture_cuda_graph=recapture_cuda_graph,
        )
        return await self.stub.UpdateWeightsFromDisk(req, **self._call_options())

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True
    ) -> pb.AdminResponse:
        """UpdateWeightVersion: set the label GetModelInfo reports (``weight_version``);
        ``abort_all_requests`` (SGLang's default) aborts every request in flight first."""
        req = pb.UpdateWeightVersionRequest(
            new_version=new_version, abort_all_requests=abort_all_requests
        )
        return await self.stub.UpdateWeightVersion(req, **self._call_options())

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, lora_id: str = "", pinned: bool = False
    ) -> pb.LoadLoRAAdapterResponse:
        """LoadLoRAAdapter: a PEFT adapter directory (as the server sees it) on every rank,
        under ``lora_id`` (default: the name); ``pinned`` adapters are never evicted."""
        req = pb.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path,
                                        lora_id=lora_id or lora_name, pinned=pinned)
        return await self.stub.LoadLoRAAdapter(req, **self._call_options())

    async def unload_lora_adapter(
        self, lora_id: str = "", lora_name: str = ""
    ) -> pb.UnloadLoRAAdapterResponse:
        """UnloadLoRAAdapter (by id, else by name); answers once no request uses it."""
        req = pb.UnloadLoRAAdapterRequest(lora_id=lora_id, lora_name=lora_name)
        return await self.stub.UnloadLoRAAdapter(req, **self._call_options())

    async def list_lora_adapters(self) -> pb.ListLoadedLoRAAdaptersResponse:
        """ListLoadedLoRAAdapters: the adapters loaded now."""
        return await self.stub.ListLoadedLoRAAdapters(
            pb.ListLoadedLoRAAdaptersRequest(), **self._call_options())

    async def get_weights_by_name(
        self, name: str, truncate_size: int = 100
    ) -> pb.GetWeightsByNameResponse:
        """GetWeightsByName: the shape and first ``truncate_size`` values of the parameter
        ``name`` (e.g. ``model.layers.0.mlp.up_proj.weight``); ``success`` says every rank
        holds the same values."""
        req = pb.GetWeightsByNameRequest(name=name, truncate_size=truncate_size)
        return await self.stub.GetWeightsByName(req, **self._call_options())

    async def check_weights(self, action: str = "checksum") -> pb.CheckWeightsResponse:
        """CheckWeights: each rank's digest over every parameter (``rank_results[].digest``);
        ``digest`` is set and ``success`` true when every rank has the same."""
        req = pb.CheckWeightsRequest(action=action)
        return await self.stub.CheckWeights(req, **self._call_options())

    async def release_memory_occupation(self, tags: Sequence[str] = ()) -> pb.AdminResponse:
        """ReleaseMemoryOccupation of an idle worker: ``tags`` among ``kv_cache`` and
        ``weights`` (empty: both). Generate waits until the memory is resumed."""
        req = pb.ReleaseMemoryOccupationRequest(tags=list(tags))
        return await self.stub.ReleaseMemoryOccupation(req, **self._call_options())

    async def resume_memory_occupation(self, tags: Sequence[str] = ()) -> pb.AdminResponse:
        """ResumeMemoryOccupation: allocate what was released again (``tags`` as for
        release; empty: both). Weights are reloaded from the checkpoint they came from;
        weights that came from no checkpoint leave Generate refused (FAILED_PRECONDITION)
        until :meth:`update_weights_from_disk` succeeds."""
        req = pb.ResumeMemoryOccupationRequest(tags=list(tags))
        return await self.stub.ResumeMemoryOccupation(req, **self._call_options())

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        stream: bool = False,
        *,
        request_id: str = "",
        ignore_eos: bool = False,
        data_parallel_rank: int | None = None,
        sampling_params: pb.SamplingParams | None = None,
        lora_id: str = "",
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Generate: the responses as they arrive (chunks when ``stream``, then one
        complete). ``sampling_params`` (when given) is the base that the other sampling
        arguments override. Leaving the loop early cancels the call (the server aborts it).
        """
        params = pb.SamplingParams()
        if sampling_params is not None:
            params.CopyFrom(sampling_params)
        params.temperature = temperature
        if max_new_tokens is not None:
            params.max_new_tokens = max_new_tokens
        if ignore_eos:
            params.ignore_eos = True
        req = pb.GenerateRequest(
            request_id=request_id,
            tokenized=pb.TokenizedInput(input_ids=list(input_ids)),
            sampling_params=params,
            stream=stream,
            lora_id=lora_id,
        )
        if data_parallel_rank is not None:
            req.data_parallel_rank = data_parallel_rank
        call = self.stub.Generate(req, **self._call_options())
        try:
            async for resp in call:
                yield resp
        finally:
            call.cancel()

    async def embed(self, input_ids: Sequence[int], *,
                    request_id: str = "") -> pb.EmbedResponse:
        """Embed: the model's vector for tokenized input (an embedding model's pooled,
        usually normalized hidden state; a classifier's score logits)."""
        req = pb.EmbedRequest(request_id=request_id,
                              tokenized=pb.TokenizedInput(input_ids=list(input_ids)))
        return await self.stub.Embed(req, **self._call_options())

    async def generate_tokens(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        stream: bool = False,
        *,
        request_id: str = "",
        ignore_eos: bool = False,
        data_parallel_rank: int | None = None,
        sampling_params: pb.SamplingParams | None = None,
        lora_id: str = "",
    ) -> GenerateResult:
        """Run :meth:`generate` to the end: the generated tokens and the GenerateComplete."""
        responses = [
            resp
            async for resp in self.generate(
                input_ids, max_new_tokens, temperature, stream,
                request_id=request_id, ignore_eos=ignore_eos,
                data_parallel_rank=data_parallel_rank, sampling_params=sampling_params,
                lora_id=lora_id,
            )
        ]
        return collect(responses, stream)

    async def generate_samples(
        self,
        input_ids: Sequence[int],
        n: int,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        stream: bool = False,
        *,
        request_id: str = "",
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        sampling_params: pb.SamplingParams | None = None,
    ) -> list[GenerateResult]:
        """Generate ``n`` parallel samples of one prompt (the worker prefills it once), with
        optional stop strings: one result per sample, in index order."""
        params = pb.SamplingParams()
        if sampling_params is not None:
            params.CopyFrom(sampling_params)
        params.n = n
        params.stop.extend(stop)
        responses = [
            resp
            async for resp in self.generate(
                input_ids, max_new_tokens, temperature, stream,
                request_id=request_id, ignore_eos=ignore_eos, sampling_params=params,
            )
        ]
        return collect_samples(responses, stream, max(n, 1))

    async def abort(
        self, request_id: str = "", reason: str = "", *, abort_all: bool = False
    ) -> pb.AbortResponse:
        """Abort an in-flight request by id; with ``abort_all``, every request in flight on
        every rank (``request_id`` is then ignored; an admin op: the admin key when the
        server has one)."""
        req = pb.AbortRequest(request_id=request_id, reason=reason, abort_all=abort_all)
        return await self.stub.Abort(req, **self._call_options())

    # ------------------------------------------------------------------ reflection

    async def services(self) -> dict[str, list[str]]:
        """Every service the server offers with its method names (server reflection, run
        in a worker thread over a short-lived blocking channel)."""

        def run() -> dict[str, list[str]]:
            if self._creds is None:
                channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.secure_channel(self.target, self._creds, options=CHANNEL_OPTIONS)
            with channel:
                return list_services(channel, self.timeout, self.metadata)

        return await asyncio.to_thread(run)

    async def offers(self, rpc: str) -> bool:
        """Whether the server offers ``Service/Method`` (reflection, cached per client)."""
        if self._services is None:
            self._services = await self.services()
        return offers(self._services, rpc)
