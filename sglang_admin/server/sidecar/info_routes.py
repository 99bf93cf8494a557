"""SGLang's read-only routes: ``/metrics`` (GetMetrics), ``/health`` and
``/health_generate`` (HealthCheck), ``/get_server_info`` / ``/server_info``
(GetServerInfo), ``/get_model_info`` / ``/model_info`` and ``/get_weight_version``
(GetModelInfo), ``/get_load`` and ``/v1/loads`` (GetLoads), in SGLang's JSON shapes."""

from __future__ import annotations

import re
import time
from typing import Any

from aiohttp import web
from google.protobuf import json_format

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.sidecar.body import BadRequest
from sglang_admin.server.sidecar.edge import Edge, HttpCallContext, Route, json_answer, plain, rpc

METRICS_OFF = "metrics are off: start the server with --enable-metrics\n"
LOADS_QUERY = ("dp_rank", "include", "format")
_DP_RANK = re.compile(r"-?[0-9]{1,6}")


def _whole(value: Any) -> Any:
    """``value`` with every integral float made an int, through dicts and lists."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


def server_info_json(response: pb.GetServerInfoResponse) -> dict[str, Any]:
    """GetServerInfo in SGLang's /server_info shape: server_args and scheduler_info
    spread at the top, ``internal_states`` (one per rank), ``version``, then the rest."""
    out = json_format.MessageToDict(response, preserving_proto_field_name=True)
    # a protobuf Struct holds every number as a double: whole ones go back to integers
    found = _whole({**out.pop("server_args", {}), **out.pop("scheduler_info", {})})
    found["internal_states"] = out.pop("rank_states", [])
    found["version"] = out.pop("sglang_version", "")
    found.update(out)
    return found


def model_info_json(response: pb.GetModelInfoResponse) -> dict[str, Any]:
    """GetModelInfo in SGLang's /model_info shape (its keys, plus ours)."""
    out = json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    out.setdefault("preferred_sampling_params", None)
    out["has_image_understanding"] = False
    out["has_audio_understanding"] = False
    return out


def load_json(load: pb.SchedulerLoad) -> dict[str, Any]:
    """One rank's load as SGLang's ``GetLoadsReqOutput.to_dict``: the core fields, and the
    sections (memory, speculative, lora, disaggregation, queues) that were asked for."""
    return json_format.MessageToDict(
        load, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def loads_json(response: pb.GetLoadsResponse) -> dict[str, Any]:
    """GetLoads as SGLang's /v1/loads JSON: ``timestamp``, ``version``, ``loads`` (one per
    rank), plus this server's ``dp_rank_count`` and ``aggregate``."""
    return {
        "timestamp": response.timestamp, "version": response.version,
        "dp_rank_count": response.dp_rank_count,
        "loads": [load_json(load) for load in response.loads],
        "aggregate": json_format.MessageToDict(
            response.aggregate, preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True),
    }


_SECTION_PREFIX = {"speculative": "spec", "disaggregation": "disagg"}


def loads_prometheus(response: pb.GetLoadsResponse) -> str:
    """/v1/loads?format=prometheus as SGLang writes it: one gauge per numeric field,
    ``sglang_<field>`` (a section's fields ``sglang_<section>_<field>``), per dp_rank."""
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in response.loads:
        found = load_json(load)
        rank = found.pop("dp_rank", 0)
        for key, value in found.items():
            if isinstance(value, dict):
                prefix = _SECTION_PREFIX.get(key, key)
                for sub, sub_value in value.items():
                    if isinstance(sub_value, (int, float)) and not isinstance(sub_value, bool):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, sub_value))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return "\n".join(lines) + "\n"


def loads_request(query: Any) -> tuple[pb.GetLoadsRequest, str]:
    """The /v1/loads query (``dp_rank``, ``include`` comma-separated, ``format``) as the
    GetLoads request and the answer's format. No ``include``: every section (SGLang's
    default). Unknown parameters and a non-integer dp_rank are a BadRequest."""
    unknown = sorted(k for k in query if k not in LOADS_QUERY)
    if unknown:
        raise BadRequest(f"unknown query parameter(s) {', '.join(repr(k)[:40] for k in unknown[:8])}"
                         f"; /v1/loads takes: {', '.join(LOADS_QUERY)}")
    request = pb.GetLoadsRequest()
    rank = query.get("dp_rank")
    if rank is not None:
        if not _DP_RANK.fullmatch(rank.strip()):
            raise BadRequest("dp_rank: expected an integer")
        request.dp_rank = int(rank)
    include = query.get("include")
    sections = [s.strip() for s in include.split(",") if s.strip()] if include else []
    request.include.extend(sections or ["all"])
    form = query.get("format") or "json"
    if form not in ("json", "prometheus"):
        raise BadRequest(f"format: expected json or prometheus, got {form[:40]!r}")
    return request, form


class InfoRoutes:
    """GetMetrics, HealthCheck, GetServerInfo, GetModelInfo and GetLoads over HTTP."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.info = edge.services.info
        self.metrics = edge.services.metrics

    def routes(self) -> list[Route]:
        get = ("GET",)
        return [
            Route(get, "/metrics", self.get_metrics, json_errors=False),
            Route(get, "/health", self.health, json_errors=False),
            Route(get, "/health_generate", self.health, json_errors=False),
            Route(get, "/get_server_info", self.server_info, json_errors=False),
            Route(get, "/server_info", self.server_info, json_errors=False),
            Route(get, "/get_model_info", self.model_info, json_errors=False),
            Route(get, "/model_info", self.model_info, json_errors=False),
            Route(get, "/get_weight_version", self.weight_version),
            Route(get, "/get_load", self.get_load),
            Route(get, "/v1/loads", self.v1_loads),
        ]

    async def get_metrics(self, request: web.Request) -> web.Response:
        """The exposition GetMetrics serves (404 unless --enable-metrics)."""
        self.edge.authorize(request, rpc("GetMetrics"))
        if not self.metrics.enabled:
            return plain(404, METRICS_OFF)
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": self.metrics.content_type})

    async def health(self, request: web.Request) -> web.Response:
        """HealthCheck: every rank answered a state round trip (200), else 503."""
        answer = await self.info.health(pb.HealthCheckRequest(), HttpCallContext.of(request))
        if not answer.healthy:
            return plain(503, answer.message)
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        """GetServerInfo as SGLang's /server_info JSON."""
        self.edge.authorize(request, rpc("GetServerInfo"))
        found = await self.info.server_info(pb.GetServerInfoRequest(),
                                            HttpCallContext.of(request))
        return json_answer(server_info_json(pb.GetServerInfoResponse.FromString(found.data)))

    async def model_info(self, request: web.Request) -> web.Response:
        """GetModelInfo as SGLang's /model_info JSON."""
        self.edge.authorize(request, rpc("GetModelInfo"))
        found = await self.info.model_info(pb.GetModelInfoRequest(),
                                           HttpCallContext.of(request))
        return json_answer(model_info_json(found))

    async def weight_version(self, request: web.Request) -> web.Response:
        """GetModelInfo's weight_version as SGLang's ``{"weight_version": ...}``."""
        self.edge.authorize(request, rpc("GetModelInfo"))
        found = await self.info.model_info(pb.GetModelInfoRequest(),
                                           HttpCallContext.of(request))
        return json_answer({"weight_version": found.weight_version})

    async def get_load(self, request: web.Request) -> web.Response:
        """GetLoads (core) as SGLang's legacy /get_load list: per rank ``dp_rank``,
        ``num_reqs`` (running + waiting), ``num_waiting_reqs``, ``num_tokens`` (tokens in
        use plus the uncached prompt tokens waiting for prefill), ``num_pending_tokens``
        (those waiting ones) and ``ts_tic`` (the server's clock)."""
        self.edge.authorize(request, rpc("GetLoads"))
        if request.query:
            raise BadRequest("/get_load takes no query parameters")
        found = await self.info.loads(pb.GetLoadsRequest(include=["core"]),
                                      HttpCallContext.of(request))
        now = time.time()
        return json_answer([
            {"dp_rank": r.dp_rank, "num_reqs": r.num_running_reqs + r.num_waiting_reqs,
             "num_waiting_reqs": r.num_waiting_reqs,
             "num_tokens": r.num_used_tokens + r.num_waiting_uncached_tokens,
             "num_pending_tokens": r.num_waiting_uncached_tokens, "ts_tic": now}
            for r in found.loads
        ])

    async def v1_loads(self, request: web.Request) -> web.Response:
        """GetLoads as SGLang's /v1/loads (JSON, or ``format=prometheus``)."""
        self.edge.authorize(request, rpc("GetLoads"))
        rpc_request, form = loads_request(request.query)
        found = await self.info.loads(rpc_request, HttpCallContext.of(request))
        if form == "prometheus":
            return web.Response(body=loads_prometheus(found).encode(), headers={
                "Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        return json_answer(loads_json(found))
