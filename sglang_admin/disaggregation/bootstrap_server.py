"""The prefill worker's bootstrap HTTP server (aiohttp, in the server process, on
--disaggregation-bootstrap-port): where decode workers learn how to reach the prefill rank
that holds a room's KV.

Routes (JSON):
- ``PUT /route`` / ``POST /register_dp_rank``: a prefill rank registers
  ``{"dp_rank": int, "rank_addr": "host:port"}`` (its control socket).
- ``GET /route``: ``{"dp_size": N, "tp_size": T, "ranks": {"0": "host:port", ...}}``
  (a decode worker refuses a prefill of another TP size before its handshake); with
  ``?dp_rank=k`` just ``{"dp_rank": k, "rank_addr": ...}``. 503 until every rank registered.
- ``GET /query_dp_ranks``: ``{"dp_size": N, "registered": [0, ...]}``.
- ``GET /health``: 200 once every rank registered, else 503.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)

MAX_ADDR_CHARS = 256


def _bad(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


class BootstrapServer:
    """Registry of this prefill worker's rank control addresses, served over HTTP."""

    def __init__(self, host: str, port: int, dp_size: int, tp_size: int = 1) -> None:
        self.host, self.port, self.dp_size, self.tp_size = host, port, dp_size, tp_size
        self.ranks: dict[int, str] = {}
        self._runner: web.AppRunner | None = None

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.dp_size

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 10)
        app.router.add_put("/route", self._register)
        app.router.add_post("/register_dp_rank", self._register)
        app.router.add_get("/route", self._route)
        app.router.add_get("/query_dp_ranks", self._query)
        app.router.add_get("/health", self._health)
        return app

    async def start(self) -> None:
        """Listen; OSError (port in use) propagates to the caller."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        logger.info("PD bootstrap server on %s:%d (%d prefill rank(s))", self.host, self.port,
                    self.dp_size)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _register(self, request: web.Request) -> web.Response:
        try:
            body: Any = await request.json()
        except Exception:  # noqa: BLE001 - any unparsable body
            return _bad("body must be a JSON object")
        if not isinstance(body, dict):
            return _bad("body must be a JSON object")
        dp_rank, addr = body.get("dp_rank"), body.get("rank_addr")
        if not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or not (
                0 <= dp_rank < self.dp_size):
            return _bad(f"dp_rank must be an integer in [0, {self.dp_size - 1}]")
        if not isinstance(addr, str) or not addr or len(addr) > MAX_ADDR_CHARS or ":" not in addr:
            return _bad("rank_addr must be 'host:port'")
        self.ranks[dp_rank] = addr
        logger.info("prefill rank %d registered at %s", dp_rank, addr)
        return web.json_response({"ok": True})

    async def _route(self, request: web.Request) -> web.Response:
        if not self.complete:
            return web.json_response(
                {"error": f"bootstrap: {len(self.ranks)} of {self.dp_size} prefill ranks "
                          "registered"}, status=503)
        raw = request.query.get("dp_rank")
        if raw is None:
            return web.json_response({"dp_size": self.dp_size, "tp_size": self.tp_size,
                                      "ranks": {str(k): v for k, v in self.ranks.items()}})
        try:
            dp_rank = int(raw)
        except ValueError:
            return _bad("dp_rank must be an integer")
        if dp_rank not in self.ranks:
            return web.json_response({"error": f"no prefill dp rank {dp_rank}"}, status=404)
        return web.json_response({"dp_rank": dp_rank, "rank_addr": self.ranks[dp_rank],
                                  "dp_size": self.dp_size})

    async def _query(self, request: web.Request) -> web.Response:
        return web.json_response({"dp_size": self.dp_size, "registered": sorted(self.ranks)})

    async def _health(self, request: web.Request) -> web.Response:
        if not self.complete:
            return web.Response(status=503, text="bootstrap: prefill ranks not all registered")
        return web.Response(text="OK")
