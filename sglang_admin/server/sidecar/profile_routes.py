"""SGLang's profile and cache routes: ``/start_profile``, ``/stop_profile`` (StartProfile,
StopProfile) and ``/flush_cache`` (FlushCache), answered in SGLang's text."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.sidecar.body import flag, integer, json_body, text, texts
from sglang_admin.server.sidecar.edge import Edge, HttpCallContext, Route, plain, rpc

# SGLang's answers (python/sglang/srt/entrypoints/http_server.py)
START_TEXT = "Start profiling.\n"
STOP_TEXT = "Stop profiling. This will take some time.\n"
FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def start_profile_request(body: dict[str, Any]) -> pb.StartProfileRequest:
    """SGLang's HTTP /start_profile body as the StartProfile RPC's request. ``null`` is
    "not given"; unknown fields are ignored (as SGLang's HTTP server ignores them), and so
    is ``profile_id`` (this server names its profiles: the answer's X-Profile-Id header).
    The RPC's own checks (activities, stages, prefix, output_dir) follow in the service."""
    request = pb.StartProfileRequest()
    for name in ("output_dir", "profile_prefix"):
        value = text(body, name)
        if value is not None:
            setattr(request, name, value)
    text(body, "profile_id")
    for name in ("start_step", "num_steps"):
        number = integer(body, name)
        if number is not None:
            setattr(request, name, number)
    request.activities.extend(texts(body, "activities"))
    request.profile_stages.extend(texts(body, "profile_stages"))
    for name in ("with_stack", "record_shapes", "merge_profiles"):
        value = flag(body, name)
        if value is not None:
            setattr(request, name, value)
    request.profile_by_stage = bool(flag(body, "profile_by_stage"))
    return request


class ProfileRoutes:
    """StartProfile / StopProfile / FlushCache over HTTP."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.cache = edge.services.cache

    def routes(self) -> list[Route]:
        both = ("POST", "GET")
        return [Route(both, "/start_profile", self.start_profile, json_errors=False),
                Route(both, "/stop_profile", self.stop_profile, json_errors=False),
                Route(both, "/flush_cache", self.flush_cache, json_errors=False)]

    async def start_profile(self, request: web.Request) -> web.Response:
        """StartProfile: 200 "Start profiling.", or 400 with the ranks' reason."""
        self.edge.authorize(request, rpc("StartProfile"))
        rpc_request = start_profile_request(json_body(await request.read()))
        answer = await self.cache.start_profile(rpc_request, HttpCallContext.of(request))
        if not answer.success:
            return plain(400, answer.message)
        return plain(200, START_TEXT, {"X-Profile-Id": answer.profile_id})

    async def stop_profile(self, request: web.Request) -> web.Response:
        """StopProfile: 200 once every rank wrote its traces, or 400 with the reason."""
        self.edge.authorize(request, rpc("StopProfile"))
        answer = await self.cache.stop_profile(pb.StopProfileRequest(),
                                               HttpCallContext.of(request))
        if not answer.success:
            return plain(400, answer.message)
        return plain(200, STOP_TEXT, {"X-Profile-Id": answer.profile_id})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """FlushCache(timeout_s=0): 200 with SGLang's text, or 400 with the reason."""
        self.edge.authorize(request, rpc("FlushCache"))
        answer = await self.cache.flush(pb.FlushCacheRequest(timeout_s=0),
                                        HttpCallContext.of(request))
        if not answer.success:
            return plain(400, answer.message)
        return plain(200, FLUSH_TEXT)
