"""The nodes' link: one TCP connection from each node >= 1 to node 0's ``--dist-init-addr``.

At start it is the join check: each node sends its settings (:func:`node_settings`), node 0
compares them with its own and answers every node "ok" or "refused" with one line naming
the first difference; a node that never joins fails node 0's start after
``--dist-timeout``. Then it is the liveness of the replica: both ends send a ping every
:data:`PING_S` and a node whose connection closes, or that is silent for
:data:`SILENT_S` or ``--watchdog-probe-timeout``, whichever is longer (a stopped host, a
cut network), is gone; node 0 then fails its calls and exits non-zero,
and a node >= 1 whose node 0 is gone stops its ranks and exits non-zero. A clean stop of
node 0 sends "stop": the others exit 0.

Frames are a 4-byte big-endian length and a msgpack map of plain values (no extension
types, no pickle), at most :data:`MAX_FRAME` bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from sglang_admin.config import ServerArgs
from sglang_admin.multinode.topology import InitAddress, parse_init_addr

logger = logging.getLogger(__name__)

PING_S = 1.0
SILENT_S = 10.0
MAX_FRAME = 1 << 20
_LEN = struct.Struct(">I")


class LinkError(Exception):
    """The nodes could not form the replica; the message is one line for the operator."""


def weights_fingerprint(model_path: str | None) -> str:
    """A cheap digest of the checkpoint a node would load: its config.json and the names
    and sizes of its weight files; a single file: its size; a built-in model: its name."""
    if not model_path:
        return "the embedded model"
    if os.path.isfile(model_path):
        return f"a file of {os.path.getsize(model_path)} bytes"
    if not os.path.isdir(model_path):
        return f"no such directory: {model_path}" if os.sep in model_path else model_path
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model_path)):
        full = os.path.join(model_path, name)
        if name == "config.json":
            with open(full, "rb") as f:
                digest.update(f.read())
        elif name.endswith((".safetensors", ".bin", ".gguf")):
            digest.update(f"{name}:{os.path.getsize(full)}\n".encode())
    return digest.hexdigest()[:16]


# The settings every node must share, in the order a refusal names them.
SHARED = ("model_path", "weights", "dtype", "tp_size", "dp_size", "context_length",
          "max_total_tokens", "max_running_requests", "enable_lora", "max_loaded_loras",
          "max_lora_rank", "is_embedding", "seed", "device")


def node_settings(args: ServerArgs) -> dict[str, Any]:
    """This node's values of :data:`SHARED`."""
    values = {name: getattr(args, name) for name in SHARED if name != "weights"}
    values["weights"] = weights_fingerprint(args.model_path)
    return {name: values[name] for name in SHARED}


def first_difference(mine: dict[str, Any], theirs: dict[str, Any], node: int) -> str | None:
    """One line naming the first setting node ``node`` has otherwise than node 0."""
    for name in SHARED:
        if mine.get(name) != theirs.get(name):
            return (f"node {node} disagrees with node 0 on {name}: node 0 has "
                    f"{mine.get(name)!r}, node {node} has {theirs.get(name)!r}")
    return None


async def _read(reader: asyncio.StreamReader) -> dict[str, Any]:
    head = await reader.readexactly(_LEN.size)
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise LinkError(f"a link frame of {n} bytes (at most {MAX_FRAME})")
    body = await reader.readexactly(n)
    try:
        msg = msgpack.unpackb(body, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise LinkError(f"an undecodable link frame: {exc}") from None
    if not isinstance(msg, dict):
        raise LinkError("a link frame that is not a map")
    return msg


def _write(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    writer.write(_LEN.pack(len(body)) + body)


@dataclass
class Peer:
    """One end of the link as seen from the other: the node's index and its stream."""

    node: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    info: dict[str, Any] = field(default_factory=dict)


class NodeLink:
    """This node's end of the link (node 0: one peer per other node; else: node 0)."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.init: InitAddress = parse_init_addr(args.dist_init_addr or "")
        self.peers: dict[int, Peer] = {}
        self._server: asyncio.base_events.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        # how long a peer may be silent before it counts as gone
        self.silent_s = max(SILENT_S, args.watchdog_probe_timeout_s)

    # ------------------------------------------------------------ the join check

    async def join(self) -> None:
        """Form the replica's nodes (node 0 waits for the others, the others reach node 0);
        LinkError (one line) when they disagree or one is missing after --dist-timeout."""
        if self.args.node_rank == 0:
            await self._gather()
        else:
            await self._reach()

    async def _gather(self) -> None:
        args, init = self.args, self.init
        arrived: asyncio.Queue[Peer | str] = asyncio.Queue()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                hello = await asyncio.wait_for(_read(reader), args.dist_timeout_s)
                node = hello.get("node")
                if not isinstance(node, int) or not 1 <= node < args.nnodes:
                    raise LinkError(f"a hello with node {node!r}")
                await arrived.put(Peer(node, reader, writer, hello))
            except (LinkError, OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                logger.warning("a connection to the nodes' link was refused: %s", exc)
                writer.close()

        try:
            self._server = await asyncio.start_server(accept, init.host, init.port)
        except OSError as exc:
            raise LinkError(f"cannot listen on --dist-init-addr {init.host}:{init.port} "
                            f"({exc.strerror or exc})") from None
        logger.info("waiting up to %.0fs for nodes 1..%d at %s:%d", args.dist_timeout_s,
                    args.nnodes - 1, init.host, init.port)
        until = time.monotonic() + args.dist_timeout_s
        while len(self.peers) < args.nnodes - 1:
            left = until - time.monotonic()
            try:
                peer = await asyncio.wait_for(arrived.get(), max(left, 0.0))
            except TimeoutError:
                missing = [k for k in range(1, args.nnodes) if k not in self.peers]
                why = (f"node(s) {', '.join(map(str, missing))} did not join at "
                       f"{init.host}:{init.port} within --dist-timeout "
                       f"{args.dist_timeout_s:.0f}s (started with --nnodes {args.nnodes} "
                       f"--node-rank k and the same --dist-init-addr? a firewall?)")
                self._refuse_all(why)  # the nodes that did join say the same
                raise LinkError(why) from None
            assert isinstance(peer, Peer)
            if peer.node in self.peers:  # a second node with the same --node-rank
                _write(peer.writer, {"refused": f"node {peer.node} joined twice: each node "
                                                f"needs its own --node-rank"})
                peer.writer.close()
                continue
            self.peers[peer.node] = peer
        mine = node_settings(args)
        for node in sorted(self.peers):
            why = first_difference(mine, self.peers[node].info.get("settings", {}), node)
            if why is not None:
                self._refuse_all(why)
                raise LinkError(why)
        for peer in self.peers.values():
            _write(peer.writer, {"ok": True})
        logger.info("nodes 0..%d joined; their settings agree", args.nnodes - 1)

    def _refuse_all(self, why: str) -> None:
        for peer in self.peers.values():
            _write(peer.writer, {"refused": why})
            peer.writer.close()

    async def _reach(self) -> None:
        args, init = self.args, self.init
        until = time.monotonic() + args.dist_timeout_s
        last = ""
        while True:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(init.host, init.port),
                    max(until - time.monotonic(), 0.1))
                break
            except (OSError, TimeoutError) as exc:
                last = getattr(exc, "strerror", None) or type(exc).__name__
            if time.monotonic() >= until:
                raise LinkError(f"node 0 is not reachable at --dist-init-addr "
                                f"{init.host}:{init.port} within --dist-timeout "
                                f"{args.dist_timeout_s:.0f}s ({last})")
            await asyncio.sleep(0.5)
        _write(writer, {"node": args.node_rank, "settings": node_settings(args)})
        try:
            answer = await asyncio.wait_for(_read(reader), args.dist_timeout_s)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            raise LinkError(f"node 0 at {init.host}:{init.port} closed the link before "
                            "answering (it refused another node, or stopped)") from None
        if "refused" in answer:
            raise LinkError(str(answer["refused"]))
        self.peers[0] = Peer(0, reader, writer, answer)

    # ------------------------------------------------------------ liveness

    def watch(self, lost: Callable[[int, str], None],
              on_message: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Ping every peer and read its pings; ``lost(node, why)`` once a peer is gone;
        ``on_message(msg)`` for every other message (node 0's "ready", "stop")."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._ping()))
        for peer in self.peers.values():
            self._tasks.append(loop.create_task(self._listen(peer, lost, on_message)))

    async def _ping(self) -> None:
        while True:
            for peer in self.peers.values():
                if not peer.writer.is_closing():
                    _write(peer.writer, {"ping": time.time()})
            await asyncio.sleep(PING_S)

    async def _listen(self, peer: Peer, lost: Callable[[int, str], None],
                      on_message: Callable[[dict[str, Any]], None] | None) -> None:
        while True:
            try:
                msg = await asyncio.wait_for(_read(peer.reader), self.silent_s)
            except TimeoutError:
                why = f"silent for {self.silent_s:.0f}s (stopped, or the network is down)"
                break
            except (OSError, asyncio.IncompleteReadError, LinkError) as exc:
                why = f"its link closed ({type(exc).__name__})"
                break
            if "ping" in msg:
                continue
            if on_message is not None:
                on_message(msg)
            if msg.get("stop"):
                return
        if not self._stopping:
            lost(peer.node, why)

    def send_all(self, msg: dict[str, Any]) -> None:
        """``msg`` to every peer (node 0: "ready" once every replica is)."""
        for peer in self.peers.values():
            if not peer.writer.is_closing():
                _write(peer.writer, msg)

    async def close(self, clean: bool) -> None:
        """Stop pinging; ``clean`` (node 0): tell the others to stop too."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for peer in self.peers.values():
            if clean and not peer.writer.is_closing():
                _write(peer.writer, {"stop": True})
            try:
                await peer.writer.drain()
            except (OSError, ConnectionError):
                pass
            peer.writer.close()
        if self._server is not None:
            self._server.close()
