"""The RPCs of weights pushed by a trainer: InitWeightsUpdateGroup,
UpdateWeightsFromDistributed, DestroyWeightsUpdateGroup, UpdateWeightsFromTensor.

The request is checked here as far as it can be without the model; each rank checks the
manifest against its parameters (scheduler/ops/weight_sync_control.py) and refuses a bad one with a
:class:`RejectedResult`, which becomes this call's gRPC status (INVALID_ARGUMENT,
ALREADY_EXISTS, NOT_FOUND) with the rank's reason.
"""

from __future__ import annotations

import grpc

from sglang_admin.config import ServerArgs
from sglang_admin.messages import (
    DestroyWeightsGroupReq,
    InitWeightsGroupReq,
    RejectedResult,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
)
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.admin import AdminCalls, FanOut
from sglang_admin.server.communicator import Communicator
from sglang_admin.server.errors import ServiceError, invalid
from sglang_admin.server.weights_service import weights_updated

INIT_TIMEOUT_S = 300.0  # waits for the trainer and every other rank to join
UPDATE_TIMEOUT_S = 600.0  # waits for running requests, then for the trainer's broadcasts
DESTROY_TIMEOUT_S = 60.0
BACKENDS = ("", "gloo", "nccl")
LOAD_FORMATS = ("", "flattened_bucket")
DTYPES = ("float32", "float16", "bfloat16", "float64")


def _raise_rejected(out: FanOut) -> None:
    """A rank refused the request before doing anything: the call fails with its status."""
    for rank in sorted(out.replies):
        found = out.result(rank)
        if isinstance(found, RejectedResult):
            code = getattr(grpc.StatusCode, found.code, grpc.StatusCode.INVALID_ARGUMENT)
            raise ServiceError(code, found.reason)


def _check_manifest(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
    if not names:
        raise invalid("names must list at least one tensor")
    if not (len(names) == len(dtypes) == len(shapes)):
        raise invalid(f"names, dtypes and shapes must have one entry per tensor; got "
                      f"{len(names)}, {len(dtypes)} and {len(shapes)}")
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not name:
            raise invalid("a tensor name is empty")
        if dtype.removeprefix("torch.") not in DTYPES:
            raise invalid(f"dtype {dtype!r} of {name!r} is not supported; use one of "
                          f"{', '.join(DTYPES)}")
        if any(d < 0 for d in shape):
            raise invalid(f"shape {shape} of {name!r} has a negative dimension")


class WeightSync:
    """Join trainers' process groups and take the weights they push, on every rank."""

    def __init__(self, args: ServerArgs, comm: Communicator, admin: AdminCalls) -> None:
        self.args = args
        self.comm = comm
        self.admin = admin

    def _updated(self, out: FanOut, default: str) -> pb.UpdateWeightsResponse:
        _raise_rejected(out)
        return weights_updated(self.comm, out, default)

    async def init_group(
        self, request: pb.InitWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdminResponse:
        if not request.master_address:
            raise invalid("master_address must name the trainer's host")
        if not 0 < request.master_port < 65536:
            raise invalid(f"master_port must be in [1, 65535], got {request.master_port}")
        if not request.group_name:
            raise invalid("group_name must not be empty")
        if request.backend not in BACKENDS:
            raise invalid(f"backend {request.backend!r} is not supported; use gloo or nccl")
        ranks = self.args.dp_size * self.args.tp_size  # each TP rank joins at its own rank
        if request.rank_offset < 1:
            raise invalid(f"rank_offset must be at least 1 (rank 0 is the trainer), got "
                          f"{request.rank_offset}")
        if request.rank_offset + ranks > request.world_size:
            raise invalid(
                f"world_size {request.world_size} cannot hold this worker's {ranks} rank(s) at "
                f"ranks {request.rank_offset}..{request.rank_offset + ranks - 1}")
        out = await self.admin.fan_out(
            context, "init_weights_update_group",
            lambda rid, deadline, trace: InitWeightsGroupReq(
                rid, request.master_address, request.master_port, request.rank_offset,
                request.world_size, request.group_name, request.backend,
                deadline=deadline, trace=trace),
            INIT_TIMEOUT_S, group_name=request.group_name,
        )
        _raise_rejected(out)
        return pb.AdminResponse(
            success=out.ok, message=out.message(
                f"every rank joined group {request.group_name!r} (world_size "
                f"{request.world_size})"),
            rank_results=out.rank_results(),
        )

    async def destroy_group(
        self, request: pb.DestroyWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdminResponse:
        if not request.group_name:
            raise invalid("group_name must not be empty")
        out = await self.admin.fan_out(
            context, "destroy_weights_update_group",
            lambda rid, deadline, trace: DestroyWeightsGroupReq(
                rid, request.group_name, deadline=deadline, trace=trace),
            DESTROY_TIMEOUT_S, group_name=request.group_name,
        )
        _raise_rejected(out)
        return pb.AdminResponse(
            success=out.ok, message=out.message(f"group {request.group_name!r} destroyed"),
            rank_results=out.rank_results(),
        )

    async def update_from_distributed(
        self, request: pb.UpdateWeightsFromDistributedRequest,
        context: grpc.aio.ServicerContext,
    ) -> pb.UpdateWeightsResponse:
        shapes = [list(s.dims) for s in request.shapes]
        _check_manifest(list(request.names), list(request.dtypes), shapes)
        if not request.group_name:
            raise invalid("group_name must name a group joined with InitWeightsUpdateGroup")
        if request.load_format not in LOAD_FORMATS:
            raise invalid(f"load_format {request.load_format!r} is not supported; use "
                          "flattened_bucket or leave it empty")
        flush = request.flush_cache if request.HasField("flush_cache") else True
        out = await self.admin.fan_out(
            context, "update_weights_from_distributed",
            lambda rid, deadline, trace: UpdateWeightsFromDistributedReq(
                rid, list(request.names), list(request.dtypes), shapes, request.group_name,
                flush, request.abort_all_requests, request.weight_version,
                request.load_format, deadline=deadline, trace=trace),
            UPDATE_TIMEOUT_S, group_name=request.group_name, tensors=len(request.names),
        )
        return self._updated(out, "Succeeded to update parameter online.")

    async def update_from_tensor(
        self, request: pb.UpdateWeightsFromTensorRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        if not request.shm_name:
            raise invalid("shm_name must name a shared-memory segment (/dev/shm/<name>)")
        tensors = list(request.tensors)
        names = [t.name for t in tensors]
        dtypes = [t.dtype for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        _check_manifest(names, dtypes, shapes)
        offsets = [t.offset for t in tensors]
        if any(o < 0 for o in offsets):
            raise invalid("tensor offsets must not be negative")
        flush = request.flush_cache if request.HasField("flush_cache") else True
        out = await self.admin.fan_out(
            context, "update_weights_from_tensor",
            lambda rid, deadline, trace: UpdateWeightsFromTensorReq(
                rid, request.shm_name, names, dtypes, shapes, offsets, flush,
                request.abort_all_requests, request.weight_version,
                deadline=deadline, trace=trace),
            UPDATE_TIMEOUT_S, shm_name=request.shm_name, tensors=len(tensors),
        )
        return self._updated(out, "Succeeded to update parameter online.")
