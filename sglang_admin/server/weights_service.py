"""The weight RPCs of the RL refit surface: UpdateWeightsFromDisk, UpdateWeightVersion,
GetWeightsByName, CheckWeights, ReleaseMemoryOccupation and ResumeMemoryOccupation.

Each fans out to every rank (scheduler/ops/weight_control.py does the work there). The worker's
model facts (model_path, weight_version) follow rank 0's answer when every rank succeeded,
so GetModelInfo and GetServerInfo report what the ranks serve.
"""

from __future__ import annotations

import asyncio
import os

import grpc

from sglang_admin.config import ServerArgs
from sglang_admin.constants import MEMORY_TAGS
from sglang_admin.messages import (
    CheckWeightsReq,
    DigestResult,
    GetWeightsReq,
    MemoryResult,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightVersionReq,
    WeightsResult,
    WeightValues,
)
from sglang_admin.model.gguf import GGUF_LOAD_FORMAT, GgufError, resolve_model_path
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.admin import AdminCalls, FanOut
from sglang_admin.server.communicator import Communicator
from sglang_admin.server.errors import ServiceError, invalid

UPDATE_TIMEOUT_S = 600.0  # waits for running requests, then reads the checkpoint
READ_TIMEOUT_S = 60.0
MEMORY_TIMEOUT_S = 120.0
LOAD_FORMATS = ("", "auto", "safetensors", GGUF_LOAD_FORMAT)
DEFAULT_TRUNCATE = 100
MAX_TRUNCATE = 1 << 20


def adopt(comm: Communicator, out: FanOut) -> None:
    """Every rank succeeded: the worker now serves what rank 0 reports."""
    found = out.result(0)
    if out.ok and isinstance(found, WeightsResult):
        comm.model_info = found.model_info  # a new object: cached answers rebuild


def weights_updated(comm: Communicator, out: FanOut, default: str) -> pb.UpdateWeightsResponse:
    """The answer of a weight update (from disk, a trainer's group or shared memory): adopt
    rank 0's model info when every rank succeeded, count the update, and report each rank."""
    adopt(comm, out)
    comm.metrics.weight_update(out.ok)
    results, paused = _weights_results(out)
    info = comm.model_info
    assert info is not None
    return pb.UpdateWeightsResponse(
        success=out.ok, message=out.message(default), rank_results=results,
        num_paused_requests=paused, model_path=info.model_path,
        weight_version=info.weight_version,
    )


def _weights_results(out: FanOut) -> tuple[list[pb.RankResult], int]:
    results = out.rank_results()
    paused = 0
    for res in results:
        found = out.result(res.dp_rank)
        if isinstance(found, WeightsResult):
            res.num_paused_requests = found.num_paused_requests
            paused += found.num_paused_requests
    return results, paused


def _tags(tags: list[str]) -> list[str]:
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise invalid(f"unknown memory tag(s) {', '.join(unknown)}; valid: {', '.join(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags)) or list(MEMORY_TAGS)


def _per_tp_rank(out: FanOut, results: list[pb.RankResult]) -> list[pb.RankResult]:
    """CheckWeights at --tp-size > 1: one result per (dp, tp) rank, each with the digest of
    that TP rank's shard (a replica that did not answer keeps its one result)."""
    expanded: list[pb.RankResult] = []
    for res in results:
        found = out.result(res.dp_rank)
        if not isinstance(found, DigestResult) or not found.tp_digests:
            expanded.append(res)
            continue
        for tp_rank, digest in enumerate(found.tp_digests):
            expanded.append(pb.RankResult(dp_rank=res.dp_rank, tp_rank=tp_rank,
                                          success=res.success, message=res.message,
                                          digest=digest))
    return expanded


class Weights:
    """Refit, inspect and release the weights of every rank."""

    def __init__(self, args: ServerArgs, comm: Communicator, admin: AdminCalls) -> None:
        self.args = args
        self.comm = comm
        self.admin = admin

    async def update_from_disk(
        self, request: pb.UpdateWeightsFromDiskRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        if not request.model_path:
            raise invalid("model_path must name a checkpoint directory")
        if request.load_format not in LOAD_FORMATS:
            raise invalid(f"load_format {request.load_format!r} is not supported; "
                          "use auto, safetensors or gguf")
        path = os.path.abspath(request.model_path)  # noqa: ASYNC240 - no I/O; ranks check it
        try:  # a GGUF file is converted here, once, and the ranks load the converted copy
            path = await asyncio.to_thread(resolve_model_path, path, request.load_format)
        except GgufError as exc:
            raise ServiceError(getattr(grpc.StatusCode, exc.code), str(exc)) from None
        flush = request.flush_cache if request.HasField("flush_cache") else True
        out = await self.admin.fan_out(
            context, "update_weights_from_disk",
            lambda rid, deadline, trace: UpdateWeightsFromDiskReq(
                rid, path, request.abort_all_requests, request.weight_version, flush,
                deadline=deadline, trace=trace, torch_empty_cache=request.torch_empty_cache),
            UPDATE_TIMEOUT_S, model_path=path,
        )
        return weights_updated(self.comm, out, "Succeeded to update model weights.")

    async def update_version(
        self, request: pb.UpdateWeightVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdminResponse:
        if not request.new_version:
            raise invalid("new_version must not be empty")
        abort = request.abort_all_requests if request.HasField("abort_all_requests") else True
        out = await self.admin.fan_out(
            context, "update_weight_version",
            lambda rid, deadline, trace: UpdateWeightVersionReq(
                rid, request.new_version, abort, deadline=deadline, trace=trace),
            READ_TIMEOUT_S, new_version=request.new_version,
        )
        adopt(self.comm, out)
        results, _ = _weights_results(out)
        return pb.AdminResponse(
            success=out.ok, message=out.message(f"weight version set to {request.new_version!r}"),
            rank_results=results,
        )

    async def get_by_name(
        self, request: pb.GetWeightsByNameRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetWeightsByNameResponse:
        if not request.name:
            raise invalid("name must name a parameter")
        truncate = request.truncate_size if request.HasField("truncate_size") else DEFAULT_TRUNCATE
        if not 0 <= truncate <= MAX_TRUNCATE:
            raise invalid(f"truncate_size must be in [0, {MAX_TRUNCATE}], got {truncate}")
        out = await self.admin.fan_out(
            context, "get_weights_by_name",
            lambda rid, deadline, trace: GetWeightsReq(
                rid, request.name, truncate, deadline=deadline, trace=trace),
            READ_TIMEOUT_S, parameter=request.name,
        )
        values = [out.result(r) for r in sorted(out.replies)]
        first = values[0] if values and isinstance(values[0], WeightValues) else WeightValues()
        ok, message = out.ok, out.message("")
        if ok and any(v != first for v in values):
            ok, message = False, "the ranks hold different values for this parameter"
        return pb.GetWeightsByNameResponse(
            success=ok, message=message, rank_results=out.rank_results(),
            shape=first.shape, values=first.values,
        )

    async def check(
        self, request: pb.CheckWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckWeightsResponse:
        action = request.action or "checksum"
        if action != "checksum":
            raise invalid(f"action {request.action!r} is not supported; use checksum")
        out = await self.admin.fan_out(
            context, "check_weights",
            lambda rid, deadline, trace: CheckWeightsReq(rid, deadline=deadline, trace=trace),
            READ_TIMEOUT_S,
        )
        results = out.rank_results()
        for res in results:
            found = out.result(res.dp_rank)
            if isinstance(found, DigestResult):
                res.digest = found.digest
        digests = {r.digest for r in results}  # at tp > 1: each replica's digest of digests
        same = out.ok and len(digests) == 1
        message = out.message("every rank holds the same weights")
        if out.ok and not same:
            message = "the ranks hold different weights"
        return pb.CheckWeightsResponse(
            success=same, message=message, rank_results=_per_tp_rank(out, results),
            digest=results[0].digest if same else "",
        )

    async def release_memory(
        self, request: pb.ReleaseMemoryOccupationRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdminResponse:
        tags = _tags(list(request.tags))
        out = await self.admin.fan_out(
            context, "release_memory_occupation",
            lambda rid, deadline, trace: ReleaseMemoryReq(
                rid, tags, deadline=deadline, trace=trace),
            MEMORY_TIMEOUT_S, tags=",".join(tags),
        )
        results = out.rank_results()
        for res in results:
            found = out.result(res.dp_rank)
            if isinstance(found, MemoryResult):
                res.bytes_released = found.bytes_released
        return pb.AdminResponse(success=out.ok, message=out.message(f"released {', '.join(tags)}"),
                                rank_results=results)

    async def resume_memory(
        self, request: pb.ResumeMemoryOccupationRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdminResponse:
        tags = _tags(list(request.tags))
        out = await self.admin.fan_out(
            context, "resume_memory_occupation",
            lambda rid, deadline, trace: ResumeMemoryReq(rid, tags, deadline=deadline, trace=trace),
            MEMORY_TIMEOUT_S, tags=",".join(tags),
        )
        return pb.AdminResponse(success=out.ok, message=out.message(f"resumed {', '.join(tags)}"),
                                rank_results=out.rank_results())
