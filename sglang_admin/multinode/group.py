"""A replica's TP group across hosts (--nnodes > 1): the rendezvous at node 0's
``--dist-init-addr`` host, port ``PORT + 1 + dp_rank``, and nothing listening on 0.0.0.0.

torch's TCPStore server binds every interface; TP rank 0 of the replica (on node 0) binds
its own socket to the given host and hands it over (``master_listen_fd``). Each rank's gloo
pairs listen on this host's address on the route to node 0
(topology.local_address), not on whatever the host name resolves to. NCCL (CUDA) brings its
own sockets, chosen by ``NCCL_SOCKET_IFNAME`` as usual.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from sglang_admin.config import ServerArgs
from sglang_admin.model.tensor_parallel import _IDLE_TIMEOUT, TensorParallel
from sglang_admin.multinode.topology import local_address, parse_init_addr, per_node

_KEEP: list[socket.socket] = []  # the store's listening sockets, open as long as the process


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"the TP group cannot listen on {host}:{port}: "
                           f"{exc.strerror or exc}") from None
    sock.listen(128)
    return sock


def join_across_nodes(args: ServerArgs, dp_rank: int, tp_rank: int,
                      dev: torch.device) -> TensorParallel:
    """TP rank ``tp_rank`` (global over the nodes) of replica ``dp_rank`` joins its group;
    blocks until every rank on every node has joined (the nodes' link bounds the wait: a
    node that goes away ends the server, and with it this process)."""
    init = parse_init_addr(args.dist_init_addr or "")
    port = init.group_port(dp_rank)
    join_timeout = datetime.timedelta(seconds=max(args.dist_timeout_s, 1.0))
    if tp_rank == 0:
        sock = _listen(init.host, port)
        _KEEP.append(sock)
        store = dist.TCPStore(init.host, port, args.tp_size, True, join_timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    else:
        store = dist.TCPStore(init.host, port, args.tp_size, False, join_timeout)
    if dev.type == "cuda":
        dist.init_process_group("nccl", store=store, rank=tp_rank, world_size=args.tp_size,
                                timeout=_IDLE_TIMEOUT)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(init))]
        options._timeout = _IDLE_TIMEOUT
        dist.init_process_group("gloo", store=store, rank=tp_rank, world_size=args.tp_size,
                                timeout=_IDLE_TIMEOUT, pg_options=options)
    return TensorParallel(tp_rank, args.tp_size, dist.group.WORLD, dev,
                          ranks_per_node=per_node(args))
