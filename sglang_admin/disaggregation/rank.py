"""PD at a scheduler rank: builds the role's rooms (prefill.py or decode.py) with the KV
transfer backend over the rank's KV pool and the control socket, registers a prefill rank
with its worker's bootstrap server, and gives the rank loop its per-round call."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from sglang_admin.disaggregation.backends import make_backend
from sglang_admin.disaggregation.control import ControlSocket, advertised_host, http_json
from sglang_admin.disaggregation.figures import rooms_figures

logger = logging.getLogger(__name__)

REGISTER_TRIES = 60


class RankPD:
    """The PD side of one rank: ``rooms`` (PrefillRooms or DecodeRooms) and what feeds it."""

    def __init__(self, rooms: Any, runner: Any, backend: Any, control: ControlSocket) -> None:
        self.rooms = rooms
        self.runner = runner
        self.backend = backend
        self.control = control
        self._ptrs: list[int] = []

    def kv_buffers(self) -> list[Any]:
        return list(self.runner.k_caches) + list(self.runner.v_caches)

    def refresh_buffers(self) -> None:
        """(Re-)register the KV pool when it was (re)allocated (release/resume memory)."""
        bufs = self.kv_buffers()
        ptrs = [b.data_ptr() for b in bufs]
        if ptrs != self._ptrs:
            self.backend.register_buffers(bufs)
            self._ptrs = ptrs

    def round(self) -> None:
        """One round of the rank loop: control messages, transfers, timeouts."""
        if self.rooms.busy or self.control.inbox.get(zmq.EVENTS) & zmq.POLLIN:
            self.refresh_buffers()
            self.rooms.poll()

    def idle_wait(self, inbox: zmq.Socket, timeout_ms: int) -> None:
        """Nothing to step but rooms pending: wait for a message on either socket."""
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        poller.register(self.control.inbox, zmq.POLLIN)
        poller.poll(timeout_ms)

    def queue_sizes(self) -> tuple[int, int]:
        """The role's two queue sizes (a state change key of the rank)."""
        r = self.rooms
        if r.role == "prefill":
            return r.num_waiting_handshake, r.num_inflight
        return r.num_prealloc, r.num_transfer

    def figures(self) -> dict[str, Any]:
        """GetLoads' DisaggregationMetrics fields, SGLang's other PD series, the counts."""
        return rooms_figures(self.rooms, *self.queue_sizes())

    def close(self) -> None:
        self.rooms.close()
        self.backend.close()
        self.control.close()


def attach_pd(args: Any, rank: int, runner: Any, scheduler: Any,
              weight_version: Callable[[], str], tensor_parallel: Any = None) -> RankPD | None:
    """The rank's PD side, installed on the scheduler (``scheduler.pd``); None when
    --disaggregation-mode is null. ``tensor_parallel``: this TP rank 0's group at tp > 1,
    whose followers move their own KV shards (tp_shards.py)."""
    mode = args.disaggregation_mode
    if mode == "null":
        return None
    from sglang_admin.disaggregation.decode import DecodeRooms
    from sglang_admin.disaggregation.prefill import PrefillRooms

    host = advertised_host(args.host)
    bind = "0.0.0.0" if host not in ("127.0.0.1", "localhost") else host
    backend = make_backend(args.disaggregation_transfer_backend, host)
    control = ControlSocket(bind, host)
    pd = RankPD(None, runner, backend, control)
    pd.refresh_buffers()
    backend.start()
    rooms_cls = PrefillRooms if mode == "prefill" else DecodeRooms
    pd.rooms = rooms_cls(scheduler, backend, control)
    pd.rooms.weight_version = weight_version
    if tensor_parallel is not None and tensor_parallel.size > 1:
        from sglang_admin.disaggregation.tp_shards import LeaderShards

        pd.rooms.shards = LeaderShards(tensor_parallel)
    scheduler.pd = pd.rooms
    if mode == "prefill":
        threading.Thread(target=_register, args=(args.disaggregation_bootstrap_port, rank,
                                                 control.address),
                         daemon=True, name="pd-register").start()
    logger.info("rank %d: PD %s, %s backend at %s, control at %s", rank, mode, backend.name,
                backend.endpoint(), control.address)
    return pd


def follower_shards(args: Any, tp_rank: int, runner: Any) -> Any:
    """A TP follower's transfer backend over its KV shard, started (tp_shards.py); None
    when --disaggregation-mode is null."""
    if args.disaggregation_mode == "null":
        return None
    from sglang_admin.disaggregation.tp_shards import FollowerShards

    backend = make_backend(args.disaggregation_transfer_backend, advertised_host(args.host))
    shards = FollowerShards(backend, lambda: list(runner.k_caches) + list(runner.v_caches),
                            tp_rank)
    logger.info("TP rank %d: PD %s, %s backend at %s", tp_rank, args.disaggregation_mode,
                backend.name, backend.endpoint())
    return shards


def _register(port: int, rank: int, addr: str) -> None:
    """Register this prefill rank with the worker's bootstrap server (in this machine's
    server process, started before the ranks); retried while it comes up."""
    for _ in range(REGISTER_TRIES):
        try:
            http_json("PUT", f"http://127.0.0.1:{port}/route",
                      {"dp_rank": rank, "rank_addr": addr})
            return
        except OSError as exc:
            last = exc
            time.sleep(0.5)
    logger.error("rank %d could not register with the bootstrap server: %s", rank, last)
