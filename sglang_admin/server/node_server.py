"""A node past the first (``--node-rank`` >= 1): its share of every replica's TP ranks, and
on ``--port`` grpc.health.v1 and GetServerInfo only (SGLang's native gRPC mode answers the
same). No tokenizer, no scheduler, no sidecar: requests reach these ranks only through TP
rank 0's per-step broadcast, on node 0.

Health is NOT_SERVING until node 0 says the replica is ready, then SERVING. The process
exits non-zero, its ranks killed first, when one of its ranks exits, when one is silent
(its heartbeats, which on node 0 reach the server's watchdog, reach this process here) for
``--watchdog-probe-timeout`` (stopped or frozen), or when node 0's link goes (node 0
stopped, crashed or is unreachable); it exits 0 when node 0 stops cleanly. Node 0 sees
this node's exit as its link closing.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal

import grpc
import zmq
import zmq.asyncio
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sglang_admin import __version__
from sglang_admin.config import ServerArgs
from sglang_admin.constants import rank_memory_environment, rank_openmp_environment
from sglang_admin.messages import Heartbeat, decode
from sglang_admin.multinode.link import LinkError, NodeLink
from sglang_admin.multinode.node_http import start_node_http
from sglang_admin.multinode.topology import local_tp_ranks, placement
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.scheduler.rank.entry import run_tp_follower

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
POLL_S = 0.2
STOP_WAIT_S = 10.0  # node 0's clean stop: the followers leave on rank 0's STOP by then


class NodeServer:
    """The serve process of node ``--node-rank`` >= 1."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.link = NodeLink(args)
        self.health = health.aio.HealthServicer()
        self.procs: list[tuple[int, int, mp.process.BaseProcess]] = []
        self.done = asyncio.Event()
        self.exit_code = 0
        self.clean_stop = False
        self.heard: dict[tuple[int, int], float] = {}  # (dp, tp) -> last heartbeat (monotonic)
        self.ready = False  # node 0 reported the replica ready
        self.link_up = False

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def _server_info(self, _request: bytes, _context: grpc.aio.ServicerContext
                           ) -> pb.GetServerInfoResponse:
        args = self.args
        server_args = struct_pb2.Struct()
        values = args.to_dict()
        values.pop("ipc_dir", None)
        server_args.update({k: v if isinstance(v, (str, int, float, bool)) or v is None
                            else str(v) for k, v in values.items()})
        info = struct_pb2.Struct()
        info.update({
            "nnodes": args.nnodes, "node_rank": args.node_rank, "tp_size": args.tp_size,
            "dp_size": args.dp_size, "tp_ranks": placement(args),
            "local_ranks": [{"dp_rank": d, "tp_rank": t, "pid": p.pid, "alive": p.is_alive()}
                            for d, t, p in self.procs],
        })
        return pb.GetServerInfoResponse(server_args=server_args, scheduler_info=info,
                                        sglang_version=__version__, server_type="grpc")

    def _grpc(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "GetServerInfo": grpc.unary_unary_rpc_method_handler(
                self._server_info, request_deserializer=pb.GetServerInfoRequest.FromString,
                response_serializer=pb.GetServerInfoResponse.SerializeToString)})
        server.add_generic_rpc_handlers((handler,))
        return server

    def _start_ranks(self) -> None:
        os.environ.update(rank_openmp_environment(dict(os.environ)))
        os.environ.update(rank_memory_environment(dict(os.environ)))
        ctx = mp.get_context("spawn")
        for dp_rank in range(self.args.dp_size):
            for tp_rank in local_tp_ranks(self.args):
                proc = ctx.Process(target=run_tp_follower,
                                   args=(self.args, dp_rank, tp_rank, os.getpid()),
                                   name=f"sglang-admin-rank{dp_rank}-tp{tp_rank}", daemon=True)
                proc.start()
                self.procs.append((dp_rank, tp_rank, proc))

    def state(self) -> dict:
        """What /metrics and /health read (multinode/node_http.py)."""
        now = asyncio.get_running_loop().time()
        ranks = {}
        for dp_rank, tp_rank, proc in self.procs:
            heard = self.heard.get((dp_rank, tp_rank))
            ranks[dp_rank, tp_rank] = (proc.is_alive(), None if heard is None else now - heard)
        return {"ranks": ranks, "link_up": self.link_up and not self.done.is_set(),
                "ready": self.ready and not self.done.is_set()}

    def _fail(self, why: str) -> None:
        if self.done.is_set():
            return
        logger.error("node %d stops: %s", self.args.node_rank, why)
        self.exit_code = 1
        self.done.set()

    def _on_message(self, msg: dict) -> None:
        if msg.get("ready"):
            self.ready = True
            now = asyncio.get_running_loop().time()
            for dp_rank, tp_rank, _ in self.procs:  # every rank passed the replica's barrier
                self.heard.setdefault((dp_rank, tp_rank), now)
            asyncio.get_running_loop().create_task(
                self._set_health(health_pb2.HealthCheckResponse.SERVING))
            logger.info("node 0 reports the replica ready; serving health")
        elif msg.get("stop"):
            self.clean_stop = True
            self.done.set()

    async def _watch_ranks(self) -> None:
        limit = self.args.watchdog_probe_timeout_s
        while not self.done.is_set():
            now = asyncio.get_running_loop().time()
            for dp_rank, tp_rank, proc in self.procs:
                if not proc.is_alive() and not self.clean_stop:
                    self._fail(f"TP rank {tp_rank} of replica {dp_rank} exited with code "
                               f"{proc.exitcode}")
                heard = self.heard.get((dp_rank, tp_rank))
                if limit and heard is not None and now - heard > limit:
                    self._fail(f"TP rank {tp_rank} of replica {dp_rank} stopped answering: no "
                               f"heartbeat for {now - heard:.1f}s (--watchdog-probe-timeout "
                               f"{limit:.0f}s; the process is stopped or frozen)")
            await asyncio.sleep(POLL_S)

    async def _read_heartbeats(self, sock: zmq.asyncio.Socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await sock.recv()
            try:
                beat = decode(data)
            except Exception:  # noqa: BLE001 - a local socket: only our ranks write to it
                continue
            if isinstance(beat, Heartbeat):
                if (beat.dp_rank, beat.tp_rank) not in self.heard:
                    logger.info("heartbeats of TP rank %d of replica %d reach node %d",
                                beat.tp_rank, beat.dp_rank, self.args.node_rank)
                self.heard[beat.dp_rank, beat.tp_rank] = loop.time()

    async def run(self) -> int:
        args = self.args
        server = self._grpc()
        address = f"{args.host}:{args.port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if not port:
            logger.error("cannot listen on %s (in use or not allowed)", address)
            return 2
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        http = None
        if not args.disable_http_sidecar:
            try:
                http = await start_node_http(args, self.state)
            except OSError as exc:
                logger.error("cannot serve /health and /metrics on %s:%d (%s); choose another "
                             "--grpc-http-sidecar-port, or --disable-http-sidecar", args.host,
                             args.http_sidecar_listen_port, exc.strerror or exc)
                await server.stop(None)
                return 2
        logger.info("node %d of %d: health and GetServerInfo on %s", args.node_rank,
                    args.nnodes, address)
        try:
            await self.link.join()
        except LinkError as exc:
            logger.error("%s", exc)
            await server.stop(None)
            if http is not None:
                await http.cleanup()
            return 2
        self.link_up = True
        ctx = zmq.asyncio.Context()
        beats = ctx.socket(zmq.PULL)
        beats.setsockopt(zmq.LINGER, 0)
        beats.bind(args.server_addr)  # the ranks' heartbeats (in this node's IPC directory)
        self._start_ranks()
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read_heartbeats(beats))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._fail, f"signal {sig.name}")
        self.link.watch(lambda node, why: self._fail(f"node {node} {why}"), self._on_message)
        watcher = loop.create_task(self._watch_ranks())
        await self.done.wait()
        watcher.cancel()
        reader.cancel()
        beats.close()
        ctx.term()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._stop_ranks()
        await self.link.close(clean=False)
        await server.stop(0.5)
        if http is not None:
            await http.cleanup()
        logger.info("node %d stopped (exit %d)", args.node_rank, self.exit_code)
        return self.exit_code

    async def _stop_ranks(self) -> None:
        """On a clean stop the followers leave on rank 0's STOP: wait for them; else (or
        past the wait) kill them: they may sit in a collective whose peer is gone."""
        wait = STOP_WAIT_S if self.clean_stop else 0.0
        until = loop_time() + wait
        for _, _, proc in self.procs:
            left = until - loop_time()
            if proc.is_alive() and left > 0:
                await asyncio.to_thread(proc.join, left)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def serve_node(args: ServerArgs) -> int:
    """Run node ``args.node_rank`` (>= 1) until node 0 stops or a part of it fails."""
    return asyncio.run(NodeServer(args).run())
