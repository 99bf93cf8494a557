"""SGLang's generation-control and LoRA routes: ``/pause_generation``,
``/continue_generation``, ``/abort_request`` (Generation) and ``/load_lora_adapter``,
``/unload_lora_adapter`` (Lora), with SGLang's bodies and answers."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.sidecar.body import FLAG, NULL, TEXT, Field, json_body, read_fields
from sglang_admin.server.sidecar.edge import (
    Edge,
    HttpCallContext,
    Route,
    failure,
    json_answer,
    rpc,
    status_of,
)

RID = Field("rid", TEXT)
PAUSE_FIELDS = (Field("mode", TEXT, default="abort"), RID)
CONTINUE_FIELDS = (Field("torch_empty_cache", FLAG), RID)
ABORT_FIELDS = (
    Field("rid", TEXT, default=""),
    Field("abort_all", FLAG, default=False),
    Field("finished_reason", NULL,
          why="an aborted request finishes with reason abort and abort_message"),
    Field("abort_message", TEXT),
)
LOAD_LORA_FIELDS = (
    Field("lora_name", TEXT, required=True),
    Field("lora_path", TEXT, required=True),
    Field("pinned", FLAG, default=False),
    Field("lora_id", TEXT),
    RID,
)
UNLOAD_LORA_FIELDS = (Field("lora_name", TEXT, required=True), Field("lora_id", TEXT), RID)
BODIES: dict[str, tuple[Field, ...]] = {
    "/pause_generation": PAUSE_FIELDS,
    "/continue_generation": CONTINUE_FIELDS,
    "/abort_request": ABORT_FIELDS,
    "/load_lora_adapter": LOAD_LORA_FIELDS,
    "/unload_lora_adapter": UNLOAD_LORA_FIELDS,
}
PAUSED = "Generation paused successfully."
CONTINUED = "Generation continued successfully."


async def _fields(request: web.Request, fields: tuple[Field, ...]) -> dict[str, Any]:
    return read_fields(json_body(await request.read()), fields)


class ControlRoutes:
    """PauseGeneration, ContinueGeneration, Abort and the LoRA load/unload over HTTP."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.generation = edge.services.generation
        self.lora = edge.services.lora

    def routes(self) -> list[Route]:
        post = ("POST",)
        return [
            Route(post, "/pause_generation", self.pause),
            Route(post, "/continue_generation", self.resume),
            Route(post, "/abort_request", self.abort),
            Route(post, "/load_lora_adapter", self.load_lora),
            Route(post, "/unload_lora_adapter", self.unload_lora),
        ]

    async def pause(self, request: web.Request) -> web.Response:
        """PauseGeneration (``mode``: abort, retract, in_place): SGLang's
        ``{"message": "Generation paused successfully.", "status": "ok"}``, with
        ``success`` and ``num_paused_requests``."""
        self.edge.authorize(request, rpc("PauseGeneration"))
        f = await _fields(request, PAUSE_FIELDS)
        answer = await self.generation.pause(pb.PauseGenerationRequest(mode=f["mode"]),
                                             HttpCallContext.of(request))
        if not answer.success:
            return failure(400, answer.message, status="error")
        return json_answer({"message": PAUSED, "status": "ok", "success": True,
                            "num_paused_requests": answer.num_paused_requests})

    async def resume(self, request: web.Request) -> web.Response:
        """ContinueGeneration: SGLang's ``{"message": ..., "status": "ok"}``."""
        self.edge.authorize(request, rpc("ContinueGeneration"))
        f = await _fields(request, CONTINUE_FIELDS)
        rpc_request = pb.ContinueGenerationRequest()
        if f["torch_empty_cache"] is not None:
            rpc_request.torch_empty_cache = f["torch_empty_cache"]
        answer = await self.generation.resume(rpc_request, HttpCallContext.of(request))
        if not answer.success:
            return failure(400, answer.message, status="error")
        return json_answer({"message": CONTINUED, "status": "ok", "success": True})

    async def abort(self, request: web.Request) -> web.Response:
        """Abort: one request by ``rid`` (the API key, or the admin key), or with
        ``abort_all`` every request (the admin key: the service checks it, as for the RPC).
        200 as SGLang (also for a rid not in flight), with ``{"success", "message"}`` saying
        whether it was found."""
        self.edge.authorize(request, rpc("Abort"))
        f = await _fields(request, ABORT_FIELDS)
        answer = await self.generation.abort(pb.AbortRequest(
            request_id=f["rid"], reason=f["abort_message"] or "", abort_all=f["abort_all"]),
            HttpCallContext.of(request))
        return json_answer({"success": answer.success, "message": answer.message})

    async def _loaded(self, request: web.Request) -> dict[str, str]:
        listed = await self.lora.list(pb.ListLoadedLoRAAdaptersRequest(),
                                      HttpCallContext.of(request))
        return {a.lora_name: a.lora_path for a in listed.loaded_adapters}

    async def _lora_answer(self, request: web.Request, call: Any) -> web.Response:
        """SGLang's LoRAUpdateOutput: ``success``, ``error_message``, ``loaded_adapters``
        (name -> path), plus ``message``; 400 when it failed."""
        try:
            answer = await call
        except ServiceError as exc:
            return failure(status_of(exc) if status_of(exc) in (401, 403, 503, 504) else 400,
                           exc.message, error_message=exc.message)
        if not answer.success:
            return failure(400, answer.message, error_message=answer.message)
        return json_answer({"success": True, "error_message": None, "message": answer.message,
                            "loaded_adapters": await self._loaded(request)})

    async def load_lora(self, request: web.Request) -> web.Response:
        """LoadLoRAAdapter. Without ``lora_id`` the adapter's id is its name (SGLang mints
        one; the router and GenerateRequest.lora_id then select it by name)."""
        self.edge.authorize(request, rpc("LoadLoRAAdapter"))
        f = await _fields(request, LOAD_LORA_FIELDS)
        return await self._lora_answer(request, self.lora.load(pb.LoadLoRAAdapterRequest(
            lora_name=f["lora_name"], lora_path=f["lora_path"], pinned=f["pinned"],
            lora_id=f["lora_id"] or f["lora_name"]), HttpCallContext.of(request)))

    async def unload_lora(self, request: web.Request) -> web.Response:
        """UnloadLoRAAdapter by ``lora_name`` (or ``lora_id``)."""
        self.edge.authorize(request, rpc("UnloadLoRAAdapter"))
        f = await _fields(request, UNLOAD_LORA_FIELDS)
        return await self._lora_answer(request, self.lora.unload(pb.UnloadLoRAAdapterRequest(
            lora_name=f["lora_name"], lora_id=f["lora_id"] or ""), HttpCallContext.of(request)))
