"""Two or more ``sglang-admin serve`` process trees on this machine, one per node, joined
over 127.0.0.1 with ``--nnodes``: the helpers test_multinode.py and
test_multinode_lifecycle.py share.

Node 1 runs in a mount namespace of its own when the machine allows one (``unshare -m``, as
root): a directory there is hidden under an empty tmpfs, so a path node 0's disk has and
node 1's lacks is a real case, not a simulation. Each node is the leader of its own
process group, so a test kills a "host" whole; no node a test started outlives it
(:func:`no_node_left`, imported by each test module).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ROOT, free_port, wait_serving

PROMPTS = [[3, 14, 15, 92, 65, 35], [27, 18, 28], list(range(40, 140)), [7] * 17]
NEW_TOKENS = [12, 20, 8, 16]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


UNSHARE = _can_unshare()


@dataclass
class Node:
    """One node's serve process (the leader of its own process group)."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    http_port: int = 0  # its HTTP sidecar (node >= 1: /health and /metrics)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tree(self) -> list[int]:
        """The serve process and every process below it."""
        out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True)
        children: dict[int, list[int]] = {}
        for line in out.stdout.split("\n"):
            if line.strip():
                pid, ppid = map(int, line.split())
                children.setdefault(ppid, []).append(pid)
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += children.get(pid, [])
        return found

    def kill_host(self) -> None:
        """Every process of this node at once, as a host that loses power."""
        os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill_host()
                self.proc.wait(10)


def start_node(tmp: Path, rank: int, init_port: int, *extra: str, nnodes: int = 2,
               tp: int = 2, hide: Path | None = None, port: int | None = None) -> Node:
    """``sglang-admin serve`` as node ``rank`` of ``nnodes``; ``hide``: a directory this
    node sees empty (its own mount namespace)."""
    port = port or free_port()
    http_port = free_port()
    log_path = tmp / f"node{rank}-{port}.log"
    cmd = [sys.executable, "-m", "sglang_admin", "serve", "--port", str(port),
           "--grpc-http-sidecar-port", str(http_port), "--tp-size", str(tp),
           "--nnodes", str(nnodes), "--node-rank", str(rank),
           "--dist-init-addr", f"127.0.0.1:{init_port}", "--max-total-tokens", "2048",
           "--dist-timeout", "120", *extra]
    if hide is not None:
        script = f"mount -t tmpfs tmpfs {hide} && exec \"$@\""
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                start_new_session=True)
    node = Node(proc, port, log_path, http_port)
    STARTED.append(node)
    return node


def init_port() -> int:
    """A --dist-init-addr port whose next port (replica 0's TP group) is free too."""
    while True:
        port = free_port()
        if port < 65000:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def wait_both(nodes: list[Node], timeout: float = 240) -> None:
    for node in nodes:
        try:
            wait_serving(node.target, node.proc, timeout)
        except Exception:
            for n in nodes:
                if n.proc.poll() is None:
                    n.kill_host()
            raise RuntimeError("nodes failed to start:\n" +
                               "\n".join(n.log()[-3000:] for n in nodes)) from None


@dataclass
class Pair:
    node0: Node
    node1: Node
    hidden: Path | None  # a directory node 1 sees empty (None: no mount namespace here)

    def stub(self) -> pb_grpc.SglangSchedulerStub:
        return pb_grpc.SglangSchedulerStub(grpc.insecure_channel(self.node0.target))


STARTED: list[Node] = []  # every node a test started: none outlives it (see below)


@pytest.fixture(autouse=True)
def no_node_left() -> Iterator[None]:
    """A test that fails half-way leaves no process of its nodes behind (the module's
    pair, stopped at the module's end, excepted)."""
    before = len(STARTED)
    yield
    for node in STARTED[before:]:
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)  # the group outlives its leader
        except ProcessLookupError:
            pass
    del STARTED[before:]


def start_pair(tmp: Path, *extra: str) -> Pair:
    hidden = tmp / "hidden-on-node1"
    hidden.mkdir(exist_ok=True)
    port = init_port()
    node0 = start_node(tmp, 0, port, *extra)
    node1 = start_node(tmp, 1, port, *extra, hide=hidden if UNSHARE else None)
    return Pair(node0, node1, hidden if UNSHARE else None)



def kill_group(node: Node) -> None:
    """SIGKILL what is left of ``node``'s process group (it outlives its leader)."""
    try:
        os.killpg(node.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
