"""The metrics exporter over HTTP: prometheus_client's WSGI app and threading server, with
the two things its ``start_http_server`` lacks.

- Always the classic text format (0.0.4): prometheus_client 0.26's OpenMetrics output,
  which Prometheus asks for first, rewrites the colon of every sample name
  (``sglang:num_running_reqs`` arrives as ``sglang_num_running_reqs``), and dashboards
  read SGLang's names.
- The server's auth rule: with ``--api-key``, a scrape needs ``Authorization: Bearer KEY``
  (as the GetMetrics RPC does; a Prometheus scrape config sets it with ``authorization:``),
  else 401. With ``--tls-cert`` it serves HTTPS with the server's certificate; with
  ``--tls-client-ca`` it requires client certificates.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from sglang_admin.config import ServerArgs

TEXT_FORMAT = "text/plain; version=0.0.4"
# call metadata -> None (allowed) or why not: the gRPC auth rule for GetMetrics
AuthCheck = Callable[[Any], "str | None"]
WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Scrapes are not logged (one a second per Prometheus)."""


def exporter_app(registry: CollectorRegistry, check: AuthCheck | None) -> WsgiApp:
    """prometheus_client's WSGI app, in the text format, behind the server's auth rule."""
    app = make_wsgi_app(registry)

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if check is not None:
            header = environ.get("HTTP_AUTHORIZATION")
            why = check([("authorization", header)] if header is not None else [])
            if why is not None:
                start_response("401 Unauthorized", [
                    ("Content-Type", "text/plain; charset=utf-8"),
                    ("WWW-Authenticate", 'Bearer realm="sglang-admin metrics"'),
                ])
                return [f"unauthorized: {why}\n".encode()]
        environ["HTTP_ACCEPT"] = TEXT_FORMAT
        return app(environ, start_response)

    return guarded


def _tls_context(args: ServerArgs) -> ssl.SSLContext | None:
    if not (args.tls_cert and args.tls_key):
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.tls_cert, args.tls_key)
    if args.tls_client_ca:
        ctx.load_verify_locations(args.tls_client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def start_exporter(
    args: ServerArgs, registry: CollectorRegistry, check: AuthCheck | None
) -> WSGIServer:
    """Serve ``/metrics`` on --host at the metrics port in a daemon thread; raises OSError
    when it cannot listen. Stop it with ``shutdown()`` then ``server_close()``."""
    httpd = make_server(args.host, args.metrics_listen_port, exporter_app(registry, check),
                        ThreadingWSGIServer, handler_class=_QuietHandler)
    tls = _tls_context(args)
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
