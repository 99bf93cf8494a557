"""SGLang's weight and memory routes over the weight RPCs: ``/update_weights_from_disk``,
``/update_weight_version``, ``/get_weights_by_name``, ``/release_memory_occupation``,
``/resume_memory_occupation`` (Weights), ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group`` (WeightSync), and
``/update_weights_from_tensor``, which is refused: SGLang's body is a pickled tensor handle.

Bodies are SGLang's (``io_struct.py``); answers ``{"success", "message", ...}`` with 200
on success and 400 otherwise, as SGLang's http_server.py.
"""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.sidecar.body import (
    FLAG,
    INTEGER,
    NULL,
    SHAPES,
    TEXT,
    TEXTS,
    BadRequest,
    Field,
    json_body,
    read_fields,
)
from sglang_admin.server.sidecar.edge import (
    Edge,
    HttpCallContext,
    Route,
    failure,
    json_answer,
    outcome,
    rpc,
)
from sglang_admin.server.weights_service import MAX_TRUNCATE

GROUP = "weight_update_group"  # SGLang's default group_name
RID = Field("rid", TEXT)  # SGLang's BaseReq id: accepted, this server mints its own ids

DISK_FIELDS = (
    Field("model_path", TEXT, required=True),
    Field("load_format", TEXT),
    Field("abort_all_requests", FLAG, default=False),
    Field("weight_version", TEXT),
    Field("is_async", FLAG, default=False, only=False,
          why="the update answers once every rank serves the new weights"),
    Field("torch_empty_cache", FLAG, default=False),
    Field("keep_pause", FLAG, default=False, only=False,
          why="call /pause_generation before and /continue_generation after instead"),
    Field("recapture_cuda_graph", FLAG, default=False),
    Field("token_step", INTEGER, default=0, only=0,
          why="this server labels weights with weight_version, not a trainer step"),
    Field("flush_cache", FLAG, default=True),
    Field("manifest", NULL, why="the checkpoint directory's own index names the tensors"),
    RID,
)
VERSION_FIELDS = (Field("new_version", TEXT, required=True),
                  Field("abort_all_requests", FLAG, default=True), RID)
GET_WEIGHTS_FIELDS = (Field("name", TEXT, required=True),
                      Field("truncate_size", INTEGER, default=100), RID)
MEMORY_FIELDS = (Field("tags", TEXTS, default=[]), RID)
INIT_GROUP_FIELDS = (
    Field("master_address", TEXT, required=True),
    Field("master_port", INTEGER, required=True),
    Field("rank_offset", INTEGER, required=True),
    Field("world_size", INTEGER, required=True),
    Field("group_name", TEXT, default=GROUP),
    Field("backend", TEXT, default="nccl"),
    RID,
)
DISTRIBUTED_FIELDS = (
    Field("names", TEXTS, required=True),
    Field("dtypes", TEXTS, required=True),
    Field("shapes", SHAPES, required=True),
    Field("group_name", TEXT, default=GROUP),
    Field("flush_cache", FLAG, default=True),
    Field("abort_all_requests", FLAG, default=False),
    Field("weight_version", TEXT),
    Field("load_format", TEXT),
    RID,
)
DESTROY_FIELDS = (Field("group_name", TEXT, default=GROUP), RID)
# route -> its body's fields (the fuzz test walks this)
BODIES: dict[str, tuple[Field, ...]] = {
    "/update_weights_from_disk": DISK_FIELDS,
    "/update_weight_version": VERSION_FIELDS,
    "/get_weights_by_name": GET_WEIGHTS_FIELDS,
    "/release_memory_occupation": MEMORY_FIELDS,
    "/resume_memory_occupation": MEMORY_FIELDS,
    "/init_weights_update_group": INIT_GROUP_FIELDS,
    "/update_weights_from_distributed": DISTRIBUTED_FIELDS,
    "/destroy_weights_update_group": DESTROY_FIELDS,
}
TENSOR_REFUSED = (
    "/update_weights_from_tensor is not served over HTTP: SGLang's body "
    "(serialized_named_tensors) is a pickled tensor handle, and this server never unpickles "
    "what a network sends. Use the UpdateWeightsFromTensor RPC instead: the tensors in a "
    "shared-memory segment (shm_name) and a manifest of names, dtypes, shapes and offsets "
    "(docs/rpc.md#updateweightsfromtensor)."
)


def nested(values: list[float], shape: list[int]) -> Any:
    """Flat row-major ``values`` as nested lists of ``shape`` (a scalar for ``[]``)."""
    if not shape:
        return values[0] if values else None
    if len(shape) == 1:
        return list(values)
    step = math.prod(shape[1:])
    return [nested(values[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


async def _fields(request: web.Request, fields: tuple[Field, ...]) -> dict[str, Any]:
    return read_fields(json_body(await request.read()), fields)


class WeightRoutes:
    """Weights and WeightSync over HTTP, each route the RPC's service method."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.weights = edge.services.weights
        self.sync = edge.services.weight_sync

    def routes(self) -> list[Route]:
        post, both = ("POST",), ("GET", "POST")
        return [
            Route(post, "/update_weights_from_disk", self.update_from_disk),
            Route(post, "/update_weight_version", self.update_version),
            Route(both, "/get_weights_by_name", self.get_by_name),
            Route(both, "/release_memory_occupation", self.release_memory),
            Route(both, "/resume_memory_occupation", self.resume_memory),
            Route(post, "/init_weights_update_group", self.init_group),
            Route(post, "/update_weights_from_distributed", self.update_from_distributed),
            Route(post, "/destroy_weights_update_group", self.destroy_group),
            Route(post, "/update_weights_from_tensor", self.update_from_tensor),
        ]

    async def update_from_disk(self, request: web.Request) -> web.Response:
        """UpdateWeightsFromDisk: ``{"success", "message", "num_paused_requests"}``."""
        self.edge.authorize(request, rpc("UpdateWeightsFromDisk"))
        f = await _fields(request, DISK_FIELDS)
        rpc_request = pb.UpdateWeightsFromDiskRequest(
            model_path=f["model_path"], load_format=f["load_format"] or "",
            abort_all_requests=f["abort_all_requests"], weight_version=f["weight_version"] or "",
            flush_cache=f["flush_cache"], torch_empty_cache=f["torch_empty_cache"],
            recapture_cuda_graph=f["recapture_cuda_graph"])
        answer = await self.weights.update_from_disk(rpc_request, HttpCallContext.of(request))
        return outcome(answer.success, answer.message,
                       num_paused_requests=answer.num_paused_requests)

    async def update_version(self, request: web.Request) -> web.Response:
        """UpdateWeightVersion: ``{"success", "message", "new_version"}``."""
        self.edge.authorize(request, rpc("UpdateWeightVersion"))
        f = await _fields(request, VERSION_FIELDS)
        answer = await self.weights.update_version(
            pb.UpdateWeightVersionRequest(new_version=f["new_version"],
                                          abort_all_requests=f["abort_all_requests"]),
            HttpCallContext.of(request))
        if not answer.success:
            return failure(400, answer.message)
        return json_answer({"success": True,
                            "message": f"Weight version updated to {f['new_version']}",
                            "new_version": f["new_version"]})

    async def get_by_name(self, request: web.Request) -> web.Response:
        """GetWeightsByName as SGLang answers it: the parameter's first ``truncate_size``
        rows (along its first dimension) as nested JSON lists. Two calls of the service
        method: the shape, then the values of those rows."""
        self.edge.authorize(request, rpc("GetWeightsByName"))
        f = await _fields(request, GET_WEIGHTS_FIELDS)
        if f["truncate_size"] < 0:
            raise BadRequest("truncate_size: must be at least 0")
        ctx = HttpCallContext.of(request)
        probe = await self.weights.get_by_name(
            pb.GetWeightsByNameRequest(name=f["name"], truncate_size=0), ctx)
        if not probe.success:
            return failure(400, probe.message)
        shape = list(probe.shape)
        rows = min(f["truncate_size"], shape[0]) if shape else 1
        count = rows * math.prod(shape[1:]) if shape else 1
        if count > MAX_TRUNCATE:
            raise BadRequest(f"truncate_size: {rows} rows of this parameter are {count} values, "
                             f"more than {MAX_TRUNCATE} at once; ask for fewer rows")
        found = await self.weights.get_by_name(
            pb.GetWeightsByNameRequest(name=f["name"], truncate_size=count), ctx)
        if not found.success:
            return failure(400, found.message)
        return json_answer(nested(list(found.values), [rows, *shape[1:]] if shape else []))

    async def release_memory(self, request: web.Request) -> web.Response:
        """ReleaseMemoryOccupation: ``{"success", "message"}``."""
        self.edge.authorize(request, rpc("ReleaseMemoryOccupation"))
        f = await _fields(request, MEMORY_FIELDS)
        answer = await self.weights.release_memory(
            pb.ReleaseMemoryOccupationRequest(tags=f["tags"]), HttpCallContext.of(request))
        return outcome(answer.success, answer.message)

    async def resume_memory(self, request: web.Request) -> web.Response:
        """ResumeMemoryOccupation: ``{"success", "message"}``."""
        self.edge.authorize(request, rpc("ResumeMemoryOccupation"))
        f = await _fields(request, MEMORY_FIELDS)
        answer = await self.weights.resume_memory(
            pb.ResumeMemoryOccupationRequest(tags=f["tags"]), HttpCallContext.of(request))
        return outcome(answer.success, answer.message)

    async def init_group(self, request: web.Request) -> web.Response:
        """InitWeightsUpdateGroup: ``{"success", "message"}``."""
        self.edge.authorize(request, rpc("InitWeightsUpdateGroup"))
        f = await _fields(request, INIT_GROUP_FIELDS)
        answer = await self.sync.init_group(pb.InitWeightsUpdateGroupRequest(
            master_address=f["master_address"], master_port=f["master_port"],
            rank_offset=f["rank_offset"], world_size=f["world_size"],
            group_name=f["group_name"], backend=f["backend"]), HttpCallContext.of(request))
        return outcome(answer.success, answer.message)

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """UpdateWeightsFromDistributed: ``{"success", "message"}``."""
        self.edge.authorize(request, rpc("UpdateWeightsFromDistributed"))
        f = await _fields(request, DISTRIBUTED_FIELDS)
        answer = await self.sync.update_from_distributed(pb.UpdateWeightsFromDistributedRequest(
            names=f["names"], dtypes=f["dtypes"],
            shapes=[pb.TensorShape(dims=s) for s in f["shapes"]], group_name=f["group_name"],
            flush_cache=f["flush_cache"], abort_all_requests=f["abort_all_requests"],
            weight_version=f["weight_version"] or "", load_format=f["load_format"] or ""),
            HttpCallContext.of(request))
        return outcome(answer.success, answer.message)

    async def destroy_group(self, request: web.Request) -> web.Response:
        """DestroyWeightsUpdateGroup: ``{"success", "message"}``."""
        self.edge.authorize(request, rpc("DestroyWeightsUpdateGroup"))
        f = await _fields(request, DESTROY_FIELDS)
        answer = await self.sync.destroy_group(
            pb.DestroyWeightsUpdateGroupRequest(group_name=f["group_name"]),
            HttpCallContext.of(request))
        return outcome(answer.success, answer.message)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        """Refused (400): the body would have to be unpickled. The RPC takes shared memory."""
        self.edge.authorize(request, rpc("UpdateWeightsFromTensor"))
        return failure(400, TENSOR_REFUSED)
