"""Where the ranks of a replica spread over ``--nnodes`` hosts live, and which flag
combinations are refused at start.

``--tp-size`` is the total over the nodes, as in SGLang. Every replica is cut the same way:
node ``k`` runs TP ranks ``k x per_node .. (k+1) x per_node - 1`` of every replica
(``per_node = tp_size / nnodes``), so TP rank 0 of every replica, which owns its scheduler
and its ZMQ sockets, is on node 0 beside the server, and a node holds
``tp_size x dp_size / nnodes`` rank processes.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from sglang_admin.config import ServerArgs


@dataclass(frozen=True)
class InitAddress:
    """Node 0's ``--dist-init-addr``: the link listens at ``port``, replica ``d``'s TP group
    at ``port + 1 + d``."""

    host: str
    port: int

    def group_port(self, dp_rank: int) -> int:
        """The TCP port of replica ``dp_rank``'s TP group rendezvous."""
        return self.port + 1 + dp_rank


def parse_init_addr(text: str) -> InitAddress:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6); ValueError saying what is wrong."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise ValueError(f"--dist-init-addr {text!r}: expected HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--dist-init-addr {text!r}: the port is not a number") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"--dist-init-addr {text!r}: the port must be in 1..65535")
    return InitAddress(host, port)


def check_flags(args: ServerArgs) -> str | None:
    """Why this combination of --nnodes, --node-rank, --dist-init-addr, --tp-size,
    --dp-size and --disaggregation-mode cannot start (one line), or None."""
    n, k = args.nnodes, args.node_rank
    if n < 1:
        return f"--nnodes must be >= 1, got {n}"
    if not 0 <= k < n:
        return f"--node-rank {k} is not in 0..{n - 1} (--nnodes {n})"
    if n == 1:
        if args.dist_init_addr:
            return "--dist-init-addr needs --nnodes > 1"
        return None
    if not args.dist_init_addr:
        return f"--nnodes {n} needs --dist-init-addr HOST:PORT (node 0's address, on every node)"
    try:
        addr = parse_init_addr(args.dist_init_addr)
    except ValueError as exc:
        return str(exc)
    if addr.port + args.dp_size > 65535:
        return (f"--dist-init-addr port {addr.port}: the TP groups take ports up to "
                f"{addr.port + args.dp_size}, past 65535")
    if args.tp_size % n:
        return (f"--tp-size {args.tp_size} is the total over the nodes and must divide by "
                f"--nnodes {n} (every node holds the same share of each replica)")
    if args.disaggregation_mode != "null":
        return (f"--disaggregation-mode {args.disaggregation_mode} with --nnodes {n} is not "
                "supported: a prefill or decode worker runs on one host (its TP ranks' KV "
                "shards leave from there); start one worker per host and let the router pair "
                "them")
    return None


def per_node(args: ServerArgs) -> int:
    """TP ranks of each replica on one node."""
    return args.tp_size // args.nnodes


def node_of(args: ServerArgs, tp_rank: int) -> int:
    """The node that runs TP rank ``tp_rank`` (of any replica)."""
    return tp_rank // per_node(args)


def local_tp_ranks(args: ServerArgs, node_rank: int | None = None) -> range:
    """The TP ranks (of every replica) that node ``node_rank`` (default: this one) runs."""
    k = args.node_rank if node_rank is None else node_rank
    share = per_node(args)
    return range(k * share, (k + 1) * share)


def local_address(init: InitAddress) -> str:
    """This host's address on the route to node 0 (the address its ranks bind and publish):
    node 0's own address on node 0, else the source address the kernel picks to reach it."""
    try:
        if ipaddress.ip_address(init.host).is_loopback:
            return init.host
    except ValueError:
        pass  # a host name: resolved below
    family = socket.AF_INET6 if ":" in init.host else socket.AF_INET
    infos = socket.getaddrinfo(init.host, init.port, family, socket.SOCK_DGRAM)
    target = infos[0][4]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(target)  # UDP: no packet is sent, the kernel only picks a route
        return str(sock.getsockname()[0])


def placement(args: ServerArgs) -> list[dict[str, int]]:
    """Every TP rank of every replica with the node that runs it (GetServerInfo's
    ``scheduler_info.tp_ranks``)."""
    share = max(1, args.tp_size // max(args.nnodes, 1))
    return [{"dp_rank": d, "tp_rank": t, "node_rank": t // share}
            for d in range(args.dp_size) for t in range(args.tp_size)]


def tp_placement(args: ServerArgs) -> dict[int, list[tuple[int, int]]]:
    """Per replica, its (TP rank, node) pairs (GetServerInfo's ``RankState.tp_ranks``);
    empty at --tp-size 1."""
    if args.tp_size <= 1:
        return {}
    out: dict[int, list[tuple[int, int]]] = {}
    for row in placement(args):
        out.setdefault(row["dp_rank"], []).append((row["tp_rank"], row["node_rank"]))
    return out
