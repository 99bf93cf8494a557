"""The SglangScheduler servicer: a map of the RPCs onto the modules of their domain.

Each RPC is a few lines that hand the call to its domain: generation (Generate, Abort,
pause), info (health, model, server, loads, tokenizer, KV events), cache and profile,
weights (from disk), weight sync (from a trainer's process group or shared memory), LoRA
adapters, metrics, embedding (Embed). Admin RPCs are marked
:func:`~sglang_admin.server.admin.admin_rpc`; the auth interceptor reads the mark (with ``--admin-api-key`` only that key opens them).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from sglang_admin.config import ServerArgs
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from sglang_admin.server.admin import AdminCalls, admin_rpc
from sglang_admin.server.admission import GenerateAdmission
from sglang_admin.server.cache_profile_service import CacheAndProfile
from sglang_admin.server.communicator import Communicator
from sglang_admin.server.embedding_service import Embedding
from sglang_admin.server.errors import Serialized
from sglang_admin.server.generation_service import Generation
from sglang_admin.server.info_service import Info
from sglang_admin.server.lora_service import Lora
from sglang_admin.server.weight_sync_service import WeightSync
from sglang_admin.server.weights_service import Weights

Context = grpc.aio.ServicerContext


class SglangSchedulerServicer(pb_grpc.SglangSchedulerServicer):
    """Serves the SglangScheduler service on top of a :class:`Communicator`."""

    def __init__(self, args: ServerArgs, comm: Communicator) -> None:
        self.admin = AdminCalls(args, comm)
        self.admission = GenerateAdmission(
            args, lambda: comm.model_info.token_capacity if comm.model_info else 0)
        self.generation = Generation(args, comm, self.admin, self.admission)
        self.embedding = Embedding(args, comm, self.admin)
        self.info = Info(args, comm, self.admin)
        self.cache = CacheAndProfile(args, comm, self.admin)
        self.weights = Weights(args, comm, self.admin)
        self.lora = Lora(args, self.admin)
        self.weight_sync = WeightSync(args, comm, self.admin)
        self.metrics = comm.metrics

    # ------------------------------------------------------------------ generation

    def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream a chunk per step when `stream` is set, then one GenerateComplete (or
        RESOURCE_EXHAUSTED at once when the worker holds as many calls as it admits).
        Generation's own stream, handed to gRPC as it is (a generator less per message)."""
        return self.generation.generate(request, context)

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        """Abort one request by id (or, with abort_all, every request: an admin op)."""
        return await self.generation.abort(request, context)

    @admin_rpc
    async def PauseGeneration(
        self, request: pb.PauseGenerationRequest, context: Context
    ) -> pb.PauseGenerationResponse:
        return await self.generation.pause(request, context)

    @admin_rpc
    async def ContinueGeneration(
        self, request: pb.ContinueGenerationRequest, context: Context
    ) -> pb.AdminResponse:
        return await self.generation.resume(request, context)

    # ------------------------------------------------------------------ info

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: Context
    ) -> pb.HealthCheckResponse:
        return await self.info.health(request, context)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        return await self.info.model_info(request, context)

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> Serialized:
        """A GetServerInfoResponse, in wire form (see :class:`Serialized`)."""
        return await self.info.server_info(request, context)

    async def GetLoads(self, request: pb.GetLoadsRequest, context: Context) -> pb.GetLoadsResponse:
        return await self.info.loads(request, context)

    async def GetTokenizer(
        self, request: pb.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[pb.GetTokenizerChunk]:
        """A zip of the tokenizer files (server/tokenizer_bundle.py); sha256 on the last chunk."""
        async for chunk in self.info.tokenizer(request, context):
            yield chunk

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.KvEventBatch | Serialized]:
        """Radix cache events as fixed-size KV blocks (server/kv_events.py), with each
        rank's load (server/kv_loads.py)."""
        async for batch in self.info.kv_events(request, context):
            yield batch

    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: Context
    ) -> pb.GetMetricsResponse:
        """Prometheus text exposition (server/metrics.py), as the HTTP sidecar's /metrics
        serves it."""
        return self.metrics.get_metrics(request)

    # ------------------------------------------------------------------ cache and profile

    @admin_rpc
    async def FlushCache(
        self, request: pb.FlushCacheRequest, context: Context
    ) -> pb.FlushCacheResponse:
        return await self.cache.flush(request, context)

    @admin_rpc
    async def StartProfile(
        self, request: pb.StartProfileRequest, context: Context
    ) -> pb.ProfileResponse:
        return await self.cache.start_profile(request, context)

    @admin_rpc
    async def StopProfile(
        self, request: pb.StopProfileRequest, context: Context
    ) -> pb.ProfileResponse:
        return await self.cache.stop_profile(request, context)

    @admin_rpc
    async def DownloadProfile(
        self, request: pb.DownloadProfileRequest, context: Context
    ) -> AsyncIterator[pb.ProfileFileChunk]:
        async for chunk in self.cache.download_profile(request, context):
            yield chunk

    # ------------------------------------------------------------------ weights

    @admin_rpc
    async def UpdateWeightsFromDisk(
        self, request: pb.UpdateWeightsFromDiskRequest, context: Context
    ) -> pb.UpdateWeightsResponse:
        return await self.weights.update_from_disk(request, context)

    @admin_rpc
    async def UpdateWeightVersion(
        self, request: pb.UpdateWeightVersionRequest, context: Context
    ) -> pb.AdminResponse:
        return await self.weights.update_version(request, context)

    @admin_rpc
    async def GetWeightsByName(
        self, request: pb.GetWeightsByNameRequest, context: Context
    ) -> pb.GetWeightsByNameResponse:
        return await self.weights.get_by_name(request, context)

    @admin_rpc
    async def CheckWeights(
        self, request: pb.CheckWeightsRequest, context: Context
    ) -> pb.CheckWeightsResponse:
        return await self.weights.check(request, context)

    @admin_rpc
    async def ReleaseMemoryOccupation(
        self, request: pb.ReleaseMemoryOccupationRequest, context: Context
    ) -> pb.AdminResponse:
        return await self.weights.release_memory(request, context)

    @admin_rpc
    async def ResumeMemoryOccupation(
        self, request: pb.ResumeMemoryOccupationRequest, context: Context
    ) -> pb.AdminResponse:
        return await self.weights.resume_memory(request, context)

    # ------------------------------------------------------------------ weights from a trainer

    @admin_rpc
    async def InitWeightsUpdateGroup(
        self, request: pb.InitWeightsUpdateGroupRequest, context: Context
    ) -> pb.AdminResponse:
        return await self.weight_sync.init_group(request, context)

    @admin_rpc
    async def UpdateWeightsFromDistributed(
        self, request: pb.UpdateWeightsFromDistributedRequest, context: Context
    ) -> pb.UpdateWeightsResponse:
        return await self.weight_sync.update_from_distributed(request, context)

    @admin_rpc
    async def DestroyWeightsUpdateGroup(
        self, request: pb.DestroyWeightsUpdateGroupRequest, context: Context
    ) -> pb.AdminResponse:
        return await self.weight_sync.destroy_group(request, context)

    @admin_rpc
    async def UpdateWeightsFromTensor(
        self, request: pb.UpdateWeightsFromTensorRequest, context: Context
    ) -> pb.UpdateWeightsResponse:
        return await self.weight_sync.update_from_tensor(request, context)

    # ------------------------------------------------------------------ embedding

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        """One vector (embedding model) or score logits (classifier) for tokenized input."""
        return await self.embedding.embed(request, context)

    # ------------------------------------------------------------------ LoRA adapters

    @admin_rpc
    async def LoadLoRAAdapter(
        self, request: pb.LoadLoRAAdapterRequest, context: Context
    ) -> pb.LoadLoRAAdapterResponse:
        return await self.lora.load(request, context)

    @admin_rpc
    async def UnloadLoRAAdapter(
        self, request: pb.UnloadLoRAAdapterRequest, context: Context
    ) -> pb.UnloadLoRAAdapterResponse:
        return await self.lora.unload(request, context)

    async def ListLoadedLoRAAdapters(
        self, request: pb.ListLoadedLoRAAdaptersRequest, context: Context
    ) -> pb.ListLoadedLoRAAdaptersResponse:
        return await self.lora.list(request, context)
