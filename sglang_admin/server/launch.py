"""Start the scheduler ranks and the grpc.aio server; stop both cleanly."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import signal
import ssl
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from sglang_admin.config import ServerArgs
from sglang_admin.constants import rank_memory_environment, rank_openmp_environment
from sglang_admin.pb import common_pb2, common_pb2_grpc
from sglang_admin.scheduler.rank.entry import run_rank, run_tp_follower
from sglang_admin.server import admission, ipc_dir
from sglang_admin.server.communicator import Communicator
from sglang_admin.server.interceptors import (
    AccessLogInterceptor,
    AuthInterceptor,
    ErrorHandlingRegistry,
)
from sglang_admin.server.servicer import SglangSchedulerServicer
from sglang_admin.server.sidecar import HttpSidecar
from sglang_admin.server.watchdog import Watchdog

logger = logging.getLogger(__name__)

SERVICE_NAME = common_pb2.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
RANK_POLL_S = 0.2


class StartupError(Exception):
    """The server could not start; the message is one line for the operator."""


def _add_reflection_v1(server: grpc.aio.Server, names: list[str]) -> None:
    """Serve reflection under the v1 name too (its messages are v1alpha's, byte for byte)."""
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.method_handlers_generic_handler(
        REFLECTION_V1,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise StartupError(f"cannot read {path}: {exc.strerror}") from None


def _read_pem(path: str, flag: str) -> bytes:
    data = _read(path)
    if b"-----BEGIN " not in data:
        raise StartupError(f"{flag} {path}: not a PEM file")
    return data


def _credentials(args: ServerArgs) -> grpc.ServerCredentials | None:
    if not (args.tls_cert or args.tls_key):
        if args.tls_client_ca:  # never fall back to plaintext when mutual TLS was asked for
            raise StartupError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (args.tls_cert and args.tls_key):
        raise StartupError("--tls-cert and --tls-key must be given together")
    ca = _read_pem(args.tls_client_ca, "--tls-client-ca") if args.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read_pem(args.tls_key, "--tls-key"), _read_pem(args.tls_cert, "--tls-cert"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def connection_options(args: ServerArgs) -> list[tuple[str, int]]:
    """gRPC server options for idle connections, connection age and keepalive (a limit of
    0 is left out, i.e. off). Idle counts only time with no call in flight."""
    options: list[tuple[str, int]] = []
    if args.max_connection_idle_s:
        options.append(("grpc.max_connection_idle_ms", _ms(args.max_connection_idle_s)))
    if args.max_connection_age_s:
        options.append(("grpc.max_connection_age_ms", _ms(args.max_connection_age_s)))
        if args.max_connection_age_grace_s:
            options.append(
                ("grpc.max_connection_age_grace_ms", _ms(args.max_connection_age_grace_s))
            )
    if args.keepalive_time_s:
        options += [
            ("grpc.keepalive_time_ms", _ms(args.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", _ms(args.keepalive_timeout_s or 20.0)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    return options


def max_message_bytes(args: ServerArgs) -> int:
    """Receive limit: room for a full-context prompt (varints of <= 5 bytes) and options."""
    return (1 << 20) + 8 * (args.context_length or 131072)


class Server:
    """One server instance: rank processes, communicator, grpc.aio server, health."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.procs: list[mp.process.BaseProcess] = []
        self.exit_code = 0
        self.stop_event = asyncio.Event()
        self.health = health.aio.HealthServicer()
        self.comm: Communicator | None = None
        self.server: grpc.aio.Server | None = None
        self.sidecar: HttpSidecar | None = None
        self.bootstrap: Any = None  # --disaggregation-mode prefill: its bootstrap server
        # --tp-size > 1: (dp rank, tp rank, process) of every TP rank past the first
        self.tp_procs: list[tuple[int, int, mp.process.BaseProcess]] = []
        self.stuck_ranks: set[int] = set()  # killed at shutdown: they cannot stop themselves
        self.link = None  # --nnodes > 1: the link to the other nodes (multinode/link.py)
        self._tasks: set[asyncio.Task] = set()

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _start_ranks(self) -> None:
        # read by the OpenMP runtime when a rank imports torch, so set before they start
        os.environ.update(rank_openmp_environment(dict(os.environ)))
        os.environ.update(rank_memory_environment(dict(os.environ)))
        ctx = mp.get_context("spawn")
        for rank in range(self.args.dp_size):
            proc = ctx.Process(
                target=run_rank,
                args=(self.args, rank, os.getpid()),
                name=f"sglang-admin-rank{rank}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)
            for tp_rank in range(1, self.args.tp_size // self.args.nnodes):  # this node's
                follower = ctx.Process(
                    target=run_tp_follower,
                    args=(self.args, rank, tp_rank, os.getpid()),
                    name=f"sglang-admin-rank{rank}-tp{tp_rank}",
                    daemon=True,
                )
                follower.start()
                self.tp_procs.append((rank, tp_rank, follower))

    def _rank_down(self, rank: int, why: str) -> None:
        """A rank exited or is stuck: its calls fail, health turns NOT_SERVING at once, and
        the server stops with exit 1."""
        assert self.comm is not None
        if rank in self.comm.dead_ranks:
            return
        self.comm.rank_failed(rank, why)
        # The server exits so a supervisor restarts it whole: calls on the other ranks end
        # now too (UNAVAILABLE: retry elsewhere), not at the grace's end.
        self.comm.fail_all(f"server restarting: scheduler rank {rank} {why}")
        task = asyncio.get_running_loop().create_task(
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        self._tasks.add(task)  # held until done (the loop keeps only a weak reference)
        task.add_done_callback(self._tasks.discard)
        self.exit_code = 1
        self.stop_event.set()

    def _rank_stuck(self, rank: int, why: str) -> None:
        assert self.comm is not None
        self.comm.metrics.rank_stuck(rank)
        self.stuck_ranks.add(rank)
        self._rank_down(rank, why)

    async def _join_nodes(self) -> None:
        """--nnodes > 1: wait for the other nodes and check their settings (a refusal or a
        missing node stops the start), then watch them: a node lost fails every replica."""
        from sglang_admin.multinode.link import LinkError, NodeLink

        self.link = NodeLink(self.args)
        try:
            await self.link.join()
        except LinkError as exc:
            assert self.server is not None
            await self.server.stop(None)
            if self.sidecar is not None:
                await self.sidecar.stop()
            raise StartupError(str(exc)) from None
        self.link.watch(self._node_lost)

    def _node_lost(self, node: int, why: str) -> None:
        for rank in range(self.args.dp_size):  # each may sit in a collective with that node
            self.stuck_ranks.add(rank)
            self._rank_down(rank, f"(node {node}) {why}")

    async def _watch_ranks(self) -> None:
        """A rank that exits while serving fails its calls and stops the server (exit 1)."""
        assert self.comm is not None
        while not self.stop_event.is_set():
            for rank, proc in enumerate(self.procs):
                if not proc.is_alive() and rank not in self.comm.dead_ranks:
                    self._rank_down(rank, f"exited with code {proc.exitcode}")
            for rank, tp_rank, proc in self.tp_procs:
                if not proc.is_alive() and rank not in self.comm.dead_ranks:
                    self._rank_down(rank, f"(TP rank {tp_rank}) exited with code "
                                          f"{proc.exitcode}")
            await asyncio.sleep(RANK_POLL_S)

    async def _start_sidecar(
        self, servicer: SglangSchedulerServicer, auth: AuthInterceptor | None
    ) -> None:
        """The HTTP sidecar on --host at its port; a port it cannot listen on stops the
        start (exit 2) with one line naming the flag."""
        args = self.args
        port = args.http_sidecar_listen_port
        flag = "--grpc-http-sidecar-port"
        why = ""
        if port > 65535:
            why = f"the default, --port + 1, is {port}: past 65535"
        elif port == args.port:
            why = "it is the gRPC --port"
        if not why:
            self.sidecar = HttpSidecar(args, servicer, None if auth is None else auth.check)
            try:
                port = await self.sidecar.start()
            except ssl.SSLError:
                self.sidecar = None
                why = "--tls-cert/--tls-key do not load as a certificate chain and its key"
            except OSError as exc:  # asyncio's text repeats the address: the errno's alone
                self.sidecar = None
                why = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
        if why:
            assert self.server is not None
            await self.server.stop(None)
            raise StartupError(
                f"cannot serve the HTTP sidecar on {args.host}:{port} ({why}); choose "
                f"another {flag}, or --disable-http-sidecar"
            )
        scheme = "https" if args.tls_cert else "http"
        logger.info("HTTP sidecar on %s://%s:%d (/start_profile, /stop_profile, /flush_cache, "
                    "/health%s)", scheme, args.host, port,
                    ", /metrics" if args.enable_metrics else "")

    async def _start_bootstrap(self) -> None:
        """The prefill worker's PD bootstrap server (before the ranks, which register with
        it); a port it cannot listen on stops the start."""
        from sglang_admin.disaggregation.bootstrap_server import BootstrapServer

        args = self.args
        bind = "0.0.0.0" if args.host not in ("127.0.0.1", "localhost") else args.host
        self.bootstrap = BootstrapServer(bind, args.disaggregation_bootstrap_port, args.dp_size,
                                         args.tp_size)
        try:
            await self.bootstrap.start()
        except OSError as exc:
            self.bootstrap = None
            await self.server.stop(None)
            raise StartupError(
                f"cannot serve the PD bootstrap server on {bind}:"
                f"{args.disaggregation_bootstrap_port} ({exc.strerror or exc}); choose another "
                "--disaggregation-bootstrap-port") from None

    async def run(self) -> int:
        args = self.args
        self.comm = Communicator(args)
        self.comm.start()
        servicer = SglangSchedulerServicer(args, self.comm)
        interceptors: list[grpc.aio.ServerInterceptor] = []
        auth: AuthInterceptor | None = None
        if args.api_key or args.admin_api_key:
            auth = AuthInterceptor(args.api_key, args.admin_api_key)
            servicer.admin.check_admin_key = auth.check_admin
            interceptors.append(auth)
        if args.log_requests:
            interceptors.append(AccessLogInterceptor())
        # errors to statuses: wrapped into the handlers as they are registered (below), not
        # an interceptor (with any, grpc.aio runs an interceptor chain on every call)
        limit = max_message_bytes(args)
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.so_reuseport", 0),
                *admission.core_options(),
                *connection_options(args),
            ],
        )
        registry = ErrorHandlingRegistry(self.server)
        common_pb2_grpc.add_SglangSchedulerServicer_to_server(servicer, registry)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registry)
        # v1 is served too (grpcurl tries it first) but not listed: grpcio-reflection ships
        # only v1alpha's descriptors, and every listed service must be describable.
        names = [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        _add_reflection_v1(self.server, names)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{args.host}:{args.port}"
        creds = _credentials(args)
        try:
            if creds is None:
                port = self.server.add_insecure_port(address)
            else:
                port = self.server.add_secure_port(address, creds)
        except RuntimeError:
            port = 0
        if not port:
            why = "in use or not allowed"
            if creds is not None:
                why += ", or --tls-cert/--tls-key are not a certificate chain and its key"
            raise StartupError(f"cannot listen on {address} ({why})")
        await self.server.start()
        logger.info("listening on %s:%d (%s)", args.host, port, "TLS" if creds else "plaintext")
        if not args.disable_http_sidecar:
            await self._start_sidecar(servicer, auth)
        if args.disaggregation_mode == "prefill":
            await self._start_bootstrap()
        if args.nnodes > 1:
            await self._join_nodes()
        self._start_ranks()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        watcher = asyncio.create_task(self._watch_ranks())
        watchdog = asyncio.create_task(
            Watchdog(args, self.comm, self._rank_stuck).run(self.stop_event)
        )
        ready = asyncio.create_task(self.comm.ready.wait())
        stopped = asyncio.create_task(self.stop_event.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if self.comm.startup_error:
            logger.error("startup failed: %s", self.comm.startup_error)
            self.exit_code = 1
            self.stop_event.set()
        elif self.comm.ready.is_set() and not self.stop_event.is_set():
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            if self.link is not None:
                self.link.send_all({"ready": True})
            info = self.comm.model_info
            logger.info("serving on %s:%d: %s in %s, %d scheduler rank(s)", args.host, port,
                        self.comm.served_model_name(), info.dtype if info else "?", args.dp_size)
        await stopped
        ready.cancel()
        await self.shutdown()
        watcher.cancel()
        watchdog.cancel()
        return self.exit_code

    async def shutdown(self) -> None:
        """NOT_SERVING, refuse new calls, give in-flight calls the grace period, stop ranks."""
        grace = self.args.grace_period_s
        if self.exit_code != 0:
            # A rank failed and every call was already ended: what is left is long-lived
            # (health Watch streams), not work to drain; the supervisor is waiting.
            grace = min(grace, 1.0)
        logger.info("shutting down (grace %.1fs)", grace)
        for rank in self.stuck_ranks:  # a stopped process never reads ShutdownReq
            logger.error("killing stuck scheduler rank %d (pid %s)", rank, self.procs[rank].pid)
            self.procs[rank].kill()
            for dp_rank, tp_rank, follower in self.tp_procs:  # its TP ranks, stopped or not
                if dp_rank == rank and follower.is_alive():
                    logger.error("killing TP rank %d of stuck replica %d (pid %s)", tp_rank,
                                 rank, follower.pid)
                    follower.kill()
        await self.health.enter_graceful_shutdown()
        if self.comm is not None:
            self.comm.kv_hub.close()  # KV event streams never end by themselves: end them now
        stopping = [self.server.stop(grace)] if self.server is not None else []
        if self.sidecar is not None:  # its calls in flight finish within the same grace
            stopping.append(self.sidecar.stop())
        if self.bootstrap is not None:
            stopping.append(self.bootstrap.stop())
        await asyncio.gather(*stopping)
        if self.link is not None:  # before the ranks stop: the other nodes expect them to
            await self.link.close(clean=self.exit_code == 0)
        if self.comm is not None:
            await self.comm.close()
        for proc in [*self.procs, *(p for _, _, p in self.tp_procs)]:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        logger.info("stopped")


def serve(args: ServerArgs) -> int:
    """Run a server until SIGTERM/SIGINT or a rank failure; returns the exit code."""
    ipc_dir.remove_stale()
    ipc_path = ipc_dir.create()
    args = args.replace(ipc_dir=ipc_path)
    try:
        if args.node_rank > 0:  # its ranks and health only (server/node_server.py)
            from sglang_admin.server.node_server import serve_node

            return serve_node(args)
        return asyncio.run(Server(args).run())
    except StartupError as exc:
        logger.error("%s", exc)
        return 2
    finally:
        shutil.rmtree(ipc_path, ignore_errors=True)
