"""Start a worker in a subprocess on loopback and talk to it: the helpers that the tests,
the benchmarks and the tools share (a free port, the server process, a greedy request).

Torch-free; loopback only. ``tests/conftest.py`` keeps the pytest fixtures built on these.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc

# The directory that holds the sglang_admin package: a worker started from it runs this code.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


# Ports handed out below the kernel's ephemeral range (32768-60999 by default): a port the
# kernel gave away with bind(0) can be taken again, before the worker binds it, by any
# process's next outgoing connection or bind(0). Each pytest-xdist process (and any other
# process) takes its own block, walked in turn, so two test processes never draw the same;
# each draw skips PORT_STRIDE - 1 ports, left to what a caller puts beside its port (a
# worker's default sidecar at port + 1, a multi-node group at port + 1 + dp rank).
PORT_BLOCKS_FROM, PORT_BLOCK, PORT_BLOCKS, PORT_STRIDE = 20000, 1500, 8, 4
_next_port: list[int] = []


def _port_block() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    index = int(worker[2:]) if worker[2:].isdigit() else os.getpid()
    return PORT_BLOCKS_FROM + (index % PORT_BLOCKS) * PORT_BLOCK


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, from this process's block
    below the ephemeral range (the next one each call)."""
    if not _next_port:
        _next_port.append(os.getpid() % PORT_BLOCK // PORT_STRIDE * PORT_STRIDE)
    block = _port_block()
    for _ in range(PORT_BLOCK // PORT_STRIDE):
        port = block + _next_port[0]
        _next_port[0] = (_next_port[0] + PORT_STRIDE) % PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or in TIME_WAIT): the next one
            return port
    with socket.socket() as s:  # the whole block taken: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the flags that set the HTTP sidecar's port (one name and its aliases)
SIDECAR_PORT_FLAGS = ("--grpc-http-sidecar-port", "--smg-http-sidecar-port", "--metrics-port")


def sidecar_port_of(args: tuple[str, ...] | list[str]) -> int | None:
    """The sidecar port ``serve`` ARGS set (``--flag N`` or ``--flag=N``), else None."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in SIDECAR_PORT_FLAGS:
            return int(value if eq else args[i + 1])
    return None


def sidecar_args(port: int, args: tuple[str, ...] | list[str]) -> tuple[list[str], int | None]:
    """The flags to add to ``serve`` ARGS on gRPC ``port`` so that its HTTP sidecar gets a
    free port of its own (port + 1, its default, may be another worker's), and that port
    (None: ``--disable-http-sidecar``). ARGS that set the port keep it."""
    if "--disable-http-sidecar" in args:
        return [], None
    given = sidecar_port_of(args)
    if given is not None:
        return [], given
    sidecar = free_port()
    while sidecar == port:
        sidecar = free_port()
    return ["--grpc-http-sidecar-port", str(sidecar)], sidecar


@dataclass
class ServerProc:
    """A worker running in a subprocess."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    sidecar_port: int | None = None  # its HTTP sidecar (None: --disable-http-sidecar)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The HTTP sidecar's base URL (``http://127.0.0.1:PORT``)."""
        assert self.sidecar_port is not None, "started with --disable-http-sidecar"
        return f"http://127.0.0.1:{self.sidecar_port}"

    def channel(self, **kw) -> grpc.Channel:
        return grpc.insecure_channel(self.target, **kw)

    def stub(self) -> pb_grpc.SglangSchedulerStub:
        return pb_grpc.SglangSchedulerStub(self.channel())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True
        ).stdout
        return [int(p) for p in out.split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the worker and wait for its exit (killed after ``timeout``); its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


class Prestart:
    """The workers of a parametrized fixture, started one parameter ahead: the next
    parameter's worker boots (seconds of CPU, mostly on one core) while the tests of this
    one run. ``start(param)`` starts one with ``wait=False`` and returns it."""

    def __init__(self, params: list[str], start: Callable[[str], ServerProc]) -> None:
        self.params = list(params)
        self.start = start
        self.started: dict[str, ServerProc] = {}
        self.taken: set[str] = set()  # handed out once: not started ahead again

    def take(self, param: str) -> ServerProc:
        """``param``'s worker, SERVING; the next parameter's starts now beside it. One the
        tests never take is stopped by :func:`stop_untaken`."""
        server = self.started.pop(param, None) or self.start(param)
        self.taken.add(param)
        i = self.params.index(param)
        following = self.params[i + 1] if i + 1 < len(self.params) else None
        if following is not None and following not in self.started \
                and following not in self.taken:
            self.started[following] = self.start(following)
            _UNTAKEN.append(self.started[following])
        if server in _UNTAKEN:
            _UNTAKEN.remove(server)
        wait_started(server)
        return server


_UNTAKEN: list[ServerProc] = []  # started by a Prestart, never taken (yet)


def stop_untaken() -> None:
    """Stop the workers a :class:`Prestart` started that no test took (deselected)."""
    while _UNTAKEN:
        _UNTAKEN.pop().stop()


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 180, **chan_kw) -> None:
    """Block until grpc.health.v1 says SERVING (``make``: a channel factory, for TLS)."""
    deadline = time.time() + timeout
    with grpc.insecure_channel(target) if not chan_kw else chan_kw["make"]() as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"server at {target} not SERVING after {timeout}s")


def start_server(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True,
    port: int | None = None, make_channel=None, default_sidecar: bool = False,
) -> ServerProc:
    """``python -m sglang_admin serve ARGS`` on a free loopback port, its log in
    ``tmp_path``; with ``wait``, once it is SERVING (killed, with its log, if it fails).
    Its HTTP sidecar gets a free port too unless ARGS set one (``ServerProc.sidecar_port``),
    or ``default_sidecar`` leaves it at its default, ``port`` + 1."""
    port = port or free_port()
    log_path = tmp_path / f"server-{port}.log"
    extra, sidecar = ([], port + 1) if default_sidecar else sidecar_args(port, args)
    cmd = [sys.executable, "-m", "sglang_admin", "serve", "--port", str(port), *args, *extra]
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=PACKAGE_PARENT
        )
    server = ServerProc(proc, port, log_path, list(args), sidecar)
    if wait:
        try:
            if make_channel is None:
                wait_serving(server.target, proc)
            else:
                wait_serving(server.target, proc, make=make_channel)
        except Exception:
            server.stop(signal.SIGKILL)
            raise RuntimeError(f"server failed to start:\n{server.log()[-4000:]}") from None
    return server


def wait_started(server: ServerProc, timeout: float = 180) -> None:
    """Block until a worker started with ``wait=False`` is SERVING (several then start side
    by side); one that fails is killed and its log's end raised."""
    try:
        wait_serving(server.target, server.proc, timeout)
    except Exception:
        server.stop(signal.SIGKILL)
        raise RuntimeError(f"server failed to start:\n{server.log()[-4000:]}") from None


def greedy(ids: list[int], n: int, **kw) -> pb.GenerateRequest:
    """A greedy GenerateRequest that ignores EOS (fixed length)."""
    return pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True),
        **kw,
    )


def run_generate(stub: pb_grpc.SglangSchedulerStub, req: pb.GenerateRequest, **kw) -> tuple[list[int], pb.GenerateComplete]:
    """Tokens and final message of one Generate call (streaming or not)."""
    tokens: list[int] = []
    complete = None
    for resp in stub.Generate(req, **kw):
        if resp.HasField("chunk"):
            tokens.extend(resp.chunk.token_ids)
        else:
            complete = resp.complete
    assert complete is not None
    if not req.stream:
        tokens = list(complete.output_ids)
    return tokens, complete
