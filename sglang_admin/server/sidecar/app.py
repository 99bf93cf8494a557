"""The HTTP sidecar's aiohttp application and listener: the routes of every domain
module, one middleware that turns refusals into statuses (never an exception's text) and
writes one log line per call with --log-requests, and TLS as the gRPC port."""

from __future__ import annotations

import ssl
import time

from aiohttp import web

from sglang_admin.config import ServerArgs
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.sidecar.body import BadRequest
from sglang_admin.server.sidecar.control_routes import ControlRoutes
from sglang_admin.server.sidecar.edge import (
    INTERNAL,
    AuthCheck,
    Edge,
    Handler,
    Route,
    Services,
    Unauthorized,
    call_metadata,
    failure,
    logger,
    plain,
    status_of,
)
from sglang_admin.server.sidecar.info_routes import InfoRoutes
from sglang_admin.server.sidecar.profile_routes import ProfileRoutes
from sglang_admin.server.sidecar.weights_routes import WeightRoutes
from sglang_admin.tracing import carrier_from_metadata, trace_id_of

MAX_BODY_BYTES = 1 << 20  # larger bodies: 413
# refusals that SGLang's JSON admin routes answer with 400 (its handlers return 400 for
# every failure); the others keep their own status (auth, overload, unavailable, deadline)
_JSON_AS_400 = {404, 429, 500}


class HttpSidecar:
    """The sidecar's routes over the server's services, and its listener."""

    def __init__(self, args: ServerArgs, services: Services,
                 check: AuthCheck | None = None) -> None:
        self.args = args
        self.edge = Edge(args, services, check)
        self.routes: list[Route] = [
            *ProfileRoutes(self.edge).routes(), *InfoRoutes(self.edge).routes(),
            *WeightRoutes(self.edge).routes(), *ControlRoutes(self.edge).routes(),
        ]
        self._json_paths = {r.path for r in self.routes if r.json_errors}
        self._runner: web.AppRunner | None = None
        self.app = self.build_app()

    def build_app(self) -> web.Application:
        """The routes as an aiohttp Application (one per event loop: it binds to the first)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._edge])
        for route in self.routes:
            for method in route.methods:
                app.router.add_route(method, route.path, route.handler)
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
        with --log-requests. The JSON admin routes answer a refusal as SGLang's
        ``{"success": false, "message": ...}``; the others as text."""
        t0 = time.perf_counter()
        as_json = request.path in self._json_paths
        status, message = 0, ""
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # aiohttp's own: 404, 405, 413, ...
            self._log(request, exc.status, t0)
            raise
        except Unauthorized as exc:
            response = plain(401, f"unauthorized: {exc.reason}", {
                "WWW-Authenticate": 'Bearer realm="sglang-admin"'})
        except BadRequest as exc:
            status, message = 400, exc.message
        except ServiceError as exc:
            status, message = status_of(exc), exc.message
        except Exception:  # noqa: BLE001 - a bug: logged whole, the caller told nothing
            logger.exception("HTTP %s %s failed", request.method, request.path)
            status, message = 500, INTERNAL
        if status:
            if as_json:
                response = failure(400 if status in _JSON_AS_400 and message != INTERNAL
                                   else status, message)
            else:
                response = plain(status, message)
        self._log(request, response.status, t0)
        return response

    def _log(self, request: web.Request, status: int, t0: float) -> None:
        if not self.args.log_requests:
            return
        trace_id = trace_id_of(carrier_from_metadata(call_metadata(request)))
        logger.info("http %s %s status=%d %.1fms%s", request.method, request.path, status,
                    (time.perf_counter() - t0) * 1e3,
                    f" trace_id={trace_id}" if trace_id else "")


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
