"""The HTTP side of a node past the first, on its sidecar port (``--port + 1`` or
``--grpc-http-sidecar-port``, off with ``--disable-http-sidecar``): ``/health`` (200 once
node 0 reports the replica ready, else 503) and, with ``--enable-metrics``, its own
``/metrics`` in the Prometheus text format: its ranks alive, each rank's heartbeat age,
whether node 0's link is up. The scheduler's figures (queues, cache, tokens) are node 0's.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from sglang_admin.config import ServerArgs


class _NodeCollector:
    """Reads the node's state at each scrape."""

    def __init__(self, node: int, state: Callable[[], dict]) -> None:
        self.node = node
        self.state = state

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        now = self.state()
        labels = {"node_rank": str(self.node)}
        alive = GaugeMetricFamily("sglang_admin_node_rank_alive",
                                  "1 while the TP rank's process runs", labels=[
                                      "node_rank", "dp_rank", "tp_rank"])
        age = GaugeMetricFamily("sglang_admin_node_rank_heartbeat_age_seconds",
                                "seconds since the TP rank's last heartbeat", labels=[
                                    "node_rank", "dp_rank", "tp_rank"])
        for (dp, tp), (is_alive, beat_age) in sorted(now["ranks"].items()):
            key = [str(self.node), str(dp), str(tp)]
            alive.add_metric(key, 1.0 if is_alive else 0.0)
            if beat_age is not None:
                age.add_metric(key, beat_age)
        link = GaugeMetricFamily("sglang_admin_node_link_up",
                                 "1 while node 0's link is up", labels=["node_rank"])
        link.add_metric([labels["node_rank"]], 1.0 if now["link_up"] else 0.0)
        ready = GaugeMetricFamily("sglang_admin_node_ready",
                                  "1 once node 0 reported the replica ready", labels=["node_rank"])
        ready.add_metric([labels["node_rank"]], 1.0 if now["ready"] else 0.0)
        yield from (alive, age, link, ready)


async def start_node_http(args: ServerArgs, state: Callable[[], dict]) -> web.AppRunner:
    """Serve /health and /metrics; OSError when the port cannot be listened on."""
    registry = CollectorRegistry()
    registry.register(_NodeCollector(args.node_rank, state))

    async def health(_request: web.Request) -> web.Response:
        ok = state()["ready"]
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "not ready\n")

    async def metrics(_request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    app = web.Application()
    app.router.add_get("/health", health)
    if args.enable_metrics:
        app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.http_sidecar_listen_port).start()
    return runner
