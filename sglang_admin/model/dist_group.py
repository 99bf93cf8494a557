"""A trainer's weight-update process group, joined the way SGLang joins it.

SGLang's ``init_custom_process_group`` (which verl, slime, AReaL and OpenRLHF copy into
their trainers) builds a group without touching the default one: a TCPStore rendezvous at
``tcp://ADDR:PORT`` (the trainer, rank 0, hosts it), a ``PrefixStore`` named by the group,
and a new process group on that store. :func:`join_group` does exactly the same, so both
sides derive the same store keys and meet.

The wait is bounded: the rendezvous and the group's own handshake time out at the
caller's deadline, and the error then names the ranks that never wrote their address
(:class:`GroupJoinError`). Broadcasts take their own timeout (:func:`broadcast_from_trainer`)
so a trainer that dies or stalls part-way fails the receive instead of hanging it.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

BACKENDS = ("gloo", "nccl")


class GroupJoinError(RuntimeError):
    """Joining a weight-update group failed; the message names who was missing."""


@dataclass
class WeightGroup:
    """One joined group: its process group and how this process sits in it."""

    name: str
    pg: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    init_method: str
    store: dist.Store  # kept alive with the group (the TCPStore connection)
    device: torch.device = torch.device("cpu")  # where its collectives take their tensors
    _scratch: torch.Tensor | None = None

    def scratch(self, numel: int, dtype: torch.dtype,
                device: torch.device | None = None) -> torch.Tensor:
        """A 1-D receive buffer of ``numel`` elements, kept between pushes (a fresh one
        would cost a page fault per 4 KiB on every bucket)."""
        buf = self._scratch
        want = concrete_device(device or "cpu")
        if buf is None or buf.dtype != dtype or buf.numel() < numel or buf.device != want:
            self._scratch = buf = torch.empty(numel, dtype=dtype, device=want)
        return buf[:numel]

    def drop_scratch(self) -> None:
        """Free the receive buffer (memory release: it is allocated again at the next push)."""
        self._scratch = None

    def destroy(self) -> None:
        """Leave the group and free its connections."""
        self._scratch = None
        _world.pg_group_ranks.pop(self.pg, None)
        try:
            dist.destroy_process_group(self.pg)
        except (ValueError, RuntimeError, KeyError):
            # Not registered as a world group (it was built beside the default one): the
            # backend's own shutdown is what remains to do.
            shutdown = getattr(self.pg, "shutdown", None)
            if shutdown is not None:
                shutdown()


def _address_store(group_store: dist.Store, group_name: str) -> dist.Store:
    """Where each rank of a gloo group publishes its address, under key ``str(rank)``:
    the group's store, then the prefixes ``_new_process_group_helper`` and ProcessGroupGloo
    add (``<group>/``, the device type, the context index 0)."""
    return PrefixStore("0", PrefixStore("cpu/", PrefixStore(f"{group_name}/", group_store)))


def _missing_ranks(store: dist.Store, world_size: int, me: int) -> list[int]:
    """Ranks whose address is not in the group's store (they never joined)."""
    missing = []
    for r in range(world_size):
        if r == me:
            continue
        try:
            if not store.check([str(r)]):
                missing.append(r)
        except RuntimeError:
            missing.append(r)
    return missing


def _listening(host: str, port: int, until: float) -> bool:
    """Whether something accepts connections at host:port before ``until`` (monotonic).

    Checked before the TCPStore client is built: its own connect retries overrun the
    timeout it is given, and log a stack trace per attempt."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((host, port), timeout=min(left, 1.0)):
                return True
        except OSError:
            time.sleep(min(0.1, max(until - time.monotonic(), 0)))


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    device: torch.device | str | None = None,
) -> WeightGroup:
    """Join ``group_name`` as ``rank`` of ``world_size`` (rank 0 hosts the TCPStore).

    ``device`` is where the group's tensors live: the CPU for gloo; for nccl a CUDA device
    (default: this thread's current one). Blocks until every rank has joined or
    ``timeout_s`` passes; raises :class:`GroupJoinError` naming the ranks that did not join.
    """
    where = group_device(backend, device)
    init_method = f"tcp://{master_address}:{master_port}"
    until = time.monotonic() + timeout_s
    if rank != 0 and not _listening(master_address, master_port, until):
        raise GroupJoinError(
            f"rank {rank}: nothing listens at {init_method} after {timeout_s:.0f}s: rank 0 "
            "(the trainer, which hosts the TCPStore there) did not join; did it start, is "
            "the address or port wrong?")
    timeout = datetime.timedelta(seconds=max(until - time.monotonic(), 0.5))
    try:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    except (RuntimeError, TimeoutError, ValueError) as exc:
        raise GroupJoinError(
            f"rank {rank}: no rendezvous at {init_method} within {timeout_s:.0f}s "
            f"(rank 0, the trainer, hosts the TCPStore there; did it start, is the port "
            f"right, does world_size {world_size} add up?): {_first_line(exc)}"
        ) from None
    timeout = datetime.timedelta(seconds=max(until - time.monotonic(), 0.5))
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    try:
        # With a device, NCCL forms its communicator now (every rank, the trainer too, meets
        # here) instead of at the first broadcast; gloo always connects every pair here.
        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), prefixed, group_name=group_name,
            timeout=timeout, device_id=where if where.type == "cuda" else None,
        )
    except (RuntimeError, TimeoutError, ValueError) as exc:
        if backend == "gloo":
            missing = _missing_ranks(_address_store(prefixed, group_name), world_size, rank)
            who = (f"ranks that did not join: {', '.join(map(str, missing))}" if missing
                   else "every rank wrote its address but the handshake failed")
        else:  # NCCL keeps no per-rank address in the store to tell who is missing
            who = ("the NCCL communicator did not form: every rank, the trainer too, must "
                   "join with its own CUDA device")
        raise GroupJoinError(
            f"rank {rank}: group {group_name!r} at {init_method} (world_size {world_size}) "
            f"did not form within {timeout_s:.0f}s; {who}: {_first_line(exc)}"
        ) from None
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightGroup(group_name, pg, rank, world_size, backend, init_method, store, where)


def group_device(backend: str, device: torch.device | str | None) -> torch.device:
    """The device of a group's tensors: the CPU for gloo; for nccl ``device`` (a bare
    "cuda" or None: the current CUDA device), which must be a CUDA device."""
    if backend != "nccl":
        return torch.device("cpu")
    dev = concrete_device(device or "cuda")
    if dev.type != "cuda":
        raise GroupJoinError(f"backend nccl moves CUDA tensors; device {dev} is not one")
    return dev


def concrete_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: a bare "cuda" is the current CUDA device (a tensor's
    ``.device`` always has one, so a bare "cuda" never compares equal to it)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def broadcast_from_trainer(group: WeightGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    """Receive ``tensor`` (in place) from rank 0 of the group; at most ``timeout_s``."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=max(timeout_s, 0.1))
    wait_received(group.pg.broadcast([tensor], opts), tensor.device, timeout_s)


def wait_received(work: dist.Work, device: torch.device, timeout_s: float) -> None:
    """Return once ``work``'s data is in ``device`` memory; TimeoutError after ``timeout_s``.

    ``Work.wait()`` blocks the host for gloo, but for NCCL it only makes the current CUDA
    stream wait: the call returns before a byte has arrived, so a success, a bytes/s figure
    or a deadline check made after it would be made too early. So the job is polled until it
    reports completion (gloo: at once, after the blocking wait; NCCL: once the collective's
    kernel has run), and a CUDA device is synchronized before the weights count as loaded.
    One path for both backends, so the tests run it on gloo."""
    until = time.monotonic() + max(timeout_s, 0.1)
    work.wait()  # gloo: the receive itself (its own timeout); nccl: the stream's wait
    pause = 1e-4
    while not work.is_completed():
        if time.monotonic() >= until:
            raise TimeoutError(f"the trainer's broadcast did not arrive within {timeout_s:.1f}s")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
