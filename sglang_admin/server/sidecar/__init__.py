"""The HTTP sidecar: SGLang's HTTP routes beside the gRPC port (SGLang #22500), served by
aiohttp in the server's own event loop.

A thin edge: each route authorizes the request with the rule of the RPC that does the
same thing, turns its body into that RPC's protobuf request, calls the same service method
(one code path to the ranks), then answers as SGLang's HTTP server does. One module per
domain: ``profile_routes`` (profile, flush), ``info_routes`` (metrics, health, server and
model info, weight version, loads), ``weights_routes`` (weights from disk or a trainer's
group, weight version, memory release), ``control_routes`` (pause, continue, abort, LoRA);
``body`` checks JSON bodies, ``edge`` holds the call context, auth and answers, ``app`` the
application, its middleware and listener. docs/operations.md lists every route.
"""

from sglang_admin.server.sidecar.app import HttpSidecar, tls_context
from sglang_admin.server.sidecar.edge import HttpCallContext
from sglang_admin.server.sidecar.profile_routes import FLUSH_TEXT, START_TEXT, STOP_TEXT

__all__ = ["FLUSH_TEXT", "START_TEXT", "STOP_TEXT", "HttpCallContext", "HttpSidecar",
           "tls_context"]
