"""The PD control plane between ranks: one ZMQ PULL socket per rank for messages from peers
(msgpack dicts, never pickle), PUSH sockets to peers, and the bootstrap-server HTTP calls.

Messages (``kind``):
- ``handshake`` decode -> prefill: ``room, rid, peer (PeerDescriptor wire), peers (one
  descriptor per decode TP rank, rank 0's first), tp_size, dst_slots, notify ("host:port"
  of decode's control socket)``
- ``done`` prefill -> decode: ``room, ok, error, first_token, logprob, top_logprobs,
  token_ids_logprobs, cached_tokens, checksum, checksums (one per TP rank), nbytes,
  seconds, weight_version``
- ``cancel`` either way: ``room, reason`` (the other side gave the room up)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import urllib.error
import urllib.request
from typing import Any

import msgpack
import zmq

logger = logging.getLogger(__name__)

MAX_CONTROL_BYTES = 64 << 20  # a handshake lists a prompt's slots: bounded
HTTP_TIMEOUT_S = 5.0
MAX_PEERS = 256  # outgoing sockets kept (one per peer control address)


def advertised_host(bind_host: str) -> str:
    """The address peers reach this machine at: SGLANG_HOST_IP, else --host unless it is a
    wildcard, else this host's name resolved."""
    env = os.environ.get("SGLANG_HOST_IP")
    if env:
        return env
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ControlSocket:
    """This rank's inbox for peer messages and its outboxes to peers (one thread only)."""

    def __init__(self, bind_host: str, advertise: str) -> None:
        self.ctx = zmq.Context(1)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self.inbox.setsockopt(zmq.LINGER, 0)
        port = self.inbox.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"{advertise}:{port}"
        self._out: dict[str, zmq.Socket] = {}

    def send(self, addr: str, msg: dict[str, Any]) -> bool:
        """Send without blocking; False when it could not be queued."""
        sock = self._out.get(addr)
        if sock is None:
            if len(self._out) >= MAX_PEERS:  # addresses come from peers: bounded
                oldest = next(iter(self._out))
                self._out.pop(oldest).close(linger=0)
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            try:
                sock.connect(f"tcp://{addr}")
            except zmq.ZMQError as exc:
                logger.warning("cannot connect to PD peer %s: %s", addr, exc)
                sock.close()
                return False
            self._out[addr] = sock
        try:
            sock.send(msgpack.packb(msg, use_bin_type=True), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def receive(self) -> list[dict[str, Any]]:
        """Every message waiting now (malformed ones dropped and logged)."""
        out = []
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
            except Exception:  # noqa: BLE001 - network input
                logger.warning("dropping a malformed PD control message (%d bytes)", len(data))
                continue
            if isinstance(msg, dict) and isinstance(msg.get("kind"), str) and isinstance(
                    msg.get("room"), int):
                out.append(msg)
            else:
                logger.warning("dropping a PD control message without kind/room")

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(linger=0)
        self.inbox.close(linger=0)
        self.ctx.term()


def http_json(method: str, url: str, body: dict[str, Any] | None = None,
              timeout: float = HTTP_TIMEOUT_S) -> Any:
    """One JSON call; raises OSError (unreachable, non-2xx) with a short reason."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our peer
            raw = resp.read(1 << 20)
    except urllib.error.HTTPError as exc:
        raise OSError(f"HTTP {exc.code} from {url}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise OSError(f"{url} unreachable: {getattr(exc, 'reason', exc)}") from None
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        raise OSError(f"{url} answered non-JSON") from None


def http_ok(url: str, timeout: float = HTTP_TIMEOUT_S) -> None:
    """A GET that must answer 2xx (a liveness probe); OSError otherwise."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - our peer
            resp.read(4096)
    except urllib.error.HTTPError as exc:
        raise OSError(f"HTTP {exc.code} from {url}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise OSError(f"{url} unreachable: {getattr(exc, 'reason', exc)}") from None


def resolve_prefill_rank(host: str, port: int, room: int) -> tuple[str, int]:
    """The control address of the prefill rank holding ``room`` (rank room % prefill dp)
    and the prefill worker's TP size (1 when its bootstrap server does not say)."""
    table = http_json("GET", f"http://{host}:{port}/route")
    try:
        dp_size = int(table["dp_size"])
        ranks = table["ranks"]
        tp_size = int(table.get("tp_size", 1))
        return str(ranks[str(room % dp_size)]), tp_size
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        raise OSError(f"bootstrap server {host}:{port} answered a malformed route") from None
