"""The HTTP sidecar: SGLang's HTTP routes beside the gRPC port (SGLang #22500), served by
aiohttp in the server's own event loop.

A thin edge: each route turns its HTTP request into the protobuf request of the RPC that
does the same thing and calls the same service method (so one code path reaches the ranks:
:class:`~sglang_admin.server.cache_profile_service.CacheAndProfile` and
:class:`~sglang_admin.server.info_service.Info`), then answers as SGLang's HTTP server does.

- ``POST|GET /start_profile`` (SGLang's HTTP-mode body, ``{}`` or no body at all, as
  ``bench_serving --profile`` sends) and ``POST|GET /stop_profile``: StartProfile /
  StopProfile. 200 "Start profiling." / "Stop profiling. This will take some time.";
  400 with the ranks' reason when they refuse (a profile already running, none running).
- ``GET|POST /flush_cache``: FlushCache with ``timeout_s`` 0 (one attempt, SGLang's HTTP
  semantics): 200 with SGLang's text when every rank flushed, 400 with the reason.
- ``GET /metrics``: the exposition GetMetrics serves, classic text format 0.0.4 (404 unless
  ``--enable-metrics``).
- ``GET /health``, ``/health_generate``: HealthCheck (every rank answers a state round
  trip; no generate is run): 200, or 503 with the reason. ``GET /get_server_info``
  (``/server_info``) and ``/get_model_info`` (``/model_info``): GetServerInfo and
  GetModelInfo as JSON in SGLang's shape.

Auth: each route follows the rule of its RPC (``AuthInterceptor.check`` on the RPC's path
with the request's ``Authorization`` header): the profile and flush routes are admin RPCs
(only ``--admin-api-key`` when set, else ``--api-key``), /metrics and the info routes need
``--api-key`` when set, the health routes are open. A refusal is 401. A body that is not a
JSON object, or a field of the wrong type, is a 400 naming the field; nothing of an
exception's text reaches the caller (500 says "see the server's log").

TLS as the gRPC port (``--tls-cert``/``--tls-key``; ``--tls-client-ca`` requires client
certificates), on ``--host``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from google.protobuf import json_format

from sglang_admin.config import ServerArgs
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.cache_profile_service import CacheAndProfile
from sglang_admin.server.convert import ServiceError
from sglang_admin.server.info_service import Info
from sglang_admin.server.interceptors import SERVICE
from sglang_admin.server.metrics import Metrics
from sglang_admin.tracing import carrier_from_metadata, trace_id_of

logger = logging.getLogger(__name__)

# SGLang's answers (python/sglang/srt/entrypoints/http_server.py)
START_TEXT = "Start profiling.\n"
STOP_TEXT = "Stop profiling. This will take some time.\n"
FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
METRICS_OFF = "metrics are off: start the server with --enable-metrics\n"
INTERNAL = "internal error: see the server's log\n"
MAX_BODY_BYTES = 1 << 20  # larger bodies: 413
INT32_MAX = (1 << 31) - 1

# the RPC whose auth rule each route follows (None: open, as grpc.health.v1)
START_PROFILE = f"/{SERVICE}/StartProfile"
STOP_PROFILE = f"/{SERVICE}/StopProfile"
FLUSH_CACHE = f"/{SERVICE}/FlushCache"
GET_METRICS = f"/{SERVICE}/GetMetrics"
GET_SERVER_INFO = f"/{SERVICE}/GetServerInfo"
GET_MODEL_INFO = f"/{SERVICE}/GetModelInfo"

# ServiceError's status -> HTTP status; anything else is a 500
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# call metadata -> None (allowed) or why not, for one RPC path: AuthInterceptor.check
AuthCheck = Callable[[str, Any], "str | None"]
_FORWARDED = ("authorization", "traceparent", "tracestate")
_INTEGER = re.compile(r"-?[0-9]{1,10}")


class BadRequest(Exception):
    """A request the edge refuses with 400; the message names the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class HttpCallContext:
    """The part of a grpc.aio ServicerContext that the service methods read
    (:class:`~sglang_admin.server.admin.CallContext`), for a call that came over HTTP:
    the headers gRPC would carry as metadata (``authorization``, ``traceparent``,
    ``tracestate``: the caller's trace continues into the ranks), and no deadline (SGLang's
    HTTP routes have none; each op's server default applies)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    @classmethod
    def of(cls, request: web.Request) -> HttpCallContext:
        return cls(call_metadata(request))

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None


def call_metadata(request: web.Request) -> tuple[tuple[str, str], ...]:
    """The request's headers that gRPC would carry as call metadata, lower-case keys."""
    return tuple((key, value) for key in _FORWARDED for value in request.headers.getall(key, ()))


# ---------------------------------------------------------------------- JSON -> protobuf


def _kind(value: Any) -> str:
    """A JSON value's type, as an error message names it (the value itself is not echoed)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def json_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; no body (or only whitespace) is ``{}``."""
    if not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("invalid JSON in the request body: not UTF-8 text") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"invalid JSON in the request body: {exc.msg} (line {exc.lineno}, column "
            f"{exc.colno})"
        ) from None
    except (ValueError, RecursionError):  # a number of thousands of digits, deep nesting
        raise BadRequest("invalid JSON in the request body: too large or too deeply nested") \
            from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_kind(body)}")
    return body


def _text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{name}: expected a string, got {_kind(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{name}: not valid Unicode text") from None
    return value


def _texts(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{name}: expected a list of strings, got {_kind(value)}"
                         + (" holding other values" if isinstance(value, list) else ""))
    for item in value:
        _text({name: item}, name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise BadRequest(f"{name}: expected true or false, got {_kind(value)}")


def _integer(body: dict[str, Any], name: str) -> int | None:
    """An integer field: a JSON integer, an integral number, or a string of decimal digits
    (``bench_serving`` sends ``"start_step": "5"``; SGLang's pydantic model takes it)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool):
        raise BadRequest(f"{name}: expected an integer, got a boolean")
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        value = int(value.strip())
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise BadRequest(f"{name}: expected an integer, got {_kind(value)}")
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise BadRequest(f"{name}: must be at most {INT32_MAX}")
    return value


def start_profile_request(body: dict[str, Any]) -> pb.StartProfileRequest:
    """SGLang's HTTP /start_profile body as the StartProfile RPC's request. ``null`` is
    "not given"; unknown fields are ignored (as SGLang's HTTP server ignores them), and so
    is ``profile_id`` (this server names its profiles: the answer's X-Profile-Id header).
    The RPC's own checks (activities, stages, prefix, output_dir) follow in the service."""
    request = pb.StartProfileRequest()
    for name in ("output_dir", "profile_prefix"):
        text = _text(body, name)
        if text is not None:
            setattr(request, name, text)
    _text(body, "profile_id")
    for name in ("start_step", "num_steps"):
        number = _integer(body, name)
        if number is not None:
            setattr(request, name, number)
    request.activities.extend(_texts(body, "activities"))
    request.profile_stages.extend(_texts(body, "profile_stages"))
    for name in ("with_stack", "record_shapes", "merge_profiles"):
        flag = _flag(body, name)
        if flag is not None:
            setattr(request, name, flag)
    request.profile_by_stage = bool(_flag(body, "profile_by_stage"))
    return request


# ---------------------------------------------------------------------- answers


def _plain(status: int, text: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=text if text.endswith("\n") else text + "\n",
                        headers=headers)


def _json(data: Any) -> web.Response:
    return web.Response(text=json.dumps(data), content_type="application/json")


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


def _whole(value: Any) -> Any:
    """``value`` with every integral float made an int, through dicts and lists."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


def model_info_json(response: pb.GetModelInfoResponse) -> dict[str, Any]:
    """GetModelInfo in SGLang's /model_info shape (its keys, plus ours)."""
    out = json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    out.setdefault("preferred_sampling_params", None)
    out["has_image_understanding"] = False
    out["has_audio_understanding"] = False
    return out


class _Unauthorized(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------- the server

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpSidecar:
    """The sidecar's routes over the server's services, and its listener."""

    def __init__(
        self, args: ServerArgs, cache: CacheAndProfile, info: Info, metrics: Metrics,
        check: AuthCheck | None = None,
    ) -> None:
        self.args = args
        self.cache = cache
        self.info = info
        self.metrics = metrics
        self.check = check
        self._runner: web.AppRunner | None = None
        self.app = self.build_app()

    def build_app(self) -> web.Application:
        """The routes as an aiohttp Application (one per event loop: it binds to the first)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._edge])
        add = app.router.add_route
        for method in ("POST", "GET"):
            add(method, "/start_profile", self.start_profile)
            add(method, "/stop_profile", self.stop_profile)
            add(method, "/flush_cache", self.flush_cache)
        for path, handler in (
            ("/metrics", self.get_metrics),
            ("/health", self.health), ("/health_generate", self.health),
            ("/get_server_info", self.server_info), ("/server_info", self.server_info),
            ("/get_model_info", self.model_info), ("/model_info", self.model_info),
        ):
            app.router.add_get(path, handler)
        return app

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        """Listen on --host at the sidecar port (TLS as the gRPC port); the port. Raises
        OSError when it cannot listen, ssl.SSLError when the certificate does not load."""
        runner = web.AppRunner(self.app, access_log=None,
                               shutdown_timeout=self.args.grace_period_s)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.args.host, self.args.http_sidecar_listen_port,
                               ssl_context=tls_context(self.args), reuse_port=False)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        return int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop listening; calls in flight get the grace period to finish."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ------------------------------------------------------------------ the edge

    @web.middleware
    async def _edge(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refusals to statuses (never an exception's text), and one log line per call
        with --log-requests."""
        t0 = time.perf_counter()
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # aiohttp's own: 404, 405, 413, ...
            self._log(request, exc.status, t0)
            raise
        except _Unauthorized as exc:
            response = _plain(401, f"unauthorized: {exc.reason}", {
                "WWW-Authenticate": 'Bearer realm="sglang-admin"'})
        except BadRequest as exc:
            response = _plain(400, exc.message)
        except ServiceError as exc:
            response = _plain(HTTP_STATUS.get(exc.code, 500), exc.message)
        except Exception:  # noqa: BLE001 - a bug: logged whole, the caller told nothing
            logger.exception("HTTP %s %s failed", request.method, request.path)
            response = _plain(500, INTERNAL)
        self._log(request, response.status, t0)
        return response

    def _log(self, request: web.Request, status: int, t0: float) -> None:
        if not self.args.log_requests:
            return
        trace_id = trace_id_of(carrier_from_metadata(call_metadata(request)))
        logger.info("http %s %s status=%d %.1fms%s", request.method, request.path, status,
                    (time.perf_counter() - t0) * 1e3,
                    f" trace_id={trace_id}" if trace_id else "")

    def _authorize(self, request: web.Request, method: str) -> None:
        """The auth rule of RPC ``method``, on the request's Authorization header."""
        if self.check is None:
            return
        reason = self.check(method, call_metadata(request))
        if reason is not None:
            logger.info("refused HTTP %s %s: %s", request.method, request.path, reason)
            raise _Unauthorized(reason.replace(" metadata", " header"))

    # ------------------------------------------------------------------ routes

    async def start_profile(self, request: web.Request) -> web.Response:
        """StartProfile: 200 "Start profiling.", or 400 with the ranks' reason."""
        self._authorize(request, START_PROFILE)
        rpc_request = start_profile_request(json_body(await request.read()))
        answer = await self.cache.start_profile(rpc_request, HttpCallContext.of(request))
        if not answer.success:
            return _plain(400, answer.message)
        return _plain(200, START_TEXT, {"X-Profile-Id": answer.profile_id})

    async def stop_profile(self, request: web.Request) -> web.Response:
        """StopProfile: 200 once every rank wrote its traces, or 400 with the reason."""
        self._authorize(request, STOP_PROFILE)
        answer = await self.cache.stop_profile(pb.StopProfileRequest(),
                                               HttpCallContext.of(request))
        if not answer.success:
            return _plain(400, answer.message)
        return _plain(200, STOP_TEXT, {"X-Profile-Id": answer.profile_id})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """FlushCache(timeout_s=0): 200 with SGLang's text, or 400 with the reason."""
        self._authorize(request, FLUSH_CACHE)
        answer = await self.cache.flush(pb.FlushCacheRequest(timeout_s=0),
                                        HttpCallContext.of(request))
        if not answer.success:
            return _plain(400, answer.message)
        return _plain(200, FLUSH_TEXT)

    async def get_metrics(self, request: web.Request) -> web.Response:
        """The exposition GetMetrics serves (404 unless --enable-metrics)."""
        self._authorize(request, GET_METRICS)
        if not self.metrics.enabled:
            return _plain(404, METRICS_OFF)
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": self.metrics.content_type})

    async def health(self, request: web.Request) -> web.Response:
        """HealthCheck: every rank answered a state round trip (200), else 503."""
        answer = await self.info.health(pb.HealthCheckRequest(), HttpCallContext.of(request))
        if not answer.healthy:
            return _plain(503, answer.message)
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        """GetServerInfo as SGLang's /server_info JSON."""
        self._authorize(request, GET_SERVER_INFO)
        found = await self.info.server_info(pb.GetServerInfoRequest(),
                                            HttpCallContext.of(request))
        return _json(server_info_json(pb.GetServerInfoResponse.FromString(found.data)))

    async def model_info(self, request: web.Request) -> web.Response:
        """GetModelInfo as SGLang's /model_info JSON."""
        self._authorize(request, GET_MODEL_INFO)
        found = await self.info.model_info(pb.GetModelInfoRequest(),
                                           HttpCallContext.of(request))
        return _json(model_info_json(found))


def tls_context(args: ServerArgs) -> ssl.SSLContext | None:
    """The gRPC port's TLS for HTTP: its certificate; client certificates required with
    --tls-client-ca. None without --tls-cert."""
    if not (args.tls_cert and args.tls_key):
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.tls_cert, args.tls_key)
    if args.tls_client_ca:
        ctx.load_verify_locations(args.tls_client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
