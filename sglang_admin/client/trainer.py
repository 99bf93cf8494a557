"""A trainer's few lines to push its weights to a fleet of workers.

    pusher = WeightPusher(["10.0.0.5:30000", "10.0.0.6:30000"])
    pusher.join("10.0.0.1", 29500)                 # once: every worker rank joins
    for step in ...:
        train_step()
        pusher.push(model.named_parameters(), weight_version=f"step-{step}")
    pusher.destroy()

:meth:`WeightPusher.join` hosts the process group (rank 0) and has every worker's ranks
join it (rank offsets follow each worker's dp size); :meth:`WeightPusher.push` cuts the
parameters into buckets of one dtype, with one UpdateWeightsFromDistributed per worker per
bucket (not one per tensor), and broadcasts each tensor of the bucket straight into the
workers' parameters (or, with ``flatten``, the bucket as one flattened tensor: fewer
collectives for thousands of tiny tensors, one more copy on each side);
:meth:`WeightPusher.push_shared` hands them over through shared memory instead, to workers
on this host (no process group needed). The version and the cache flush go with the last
bucket. torch is imported only when these methods run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sglang_admin.client.client import AsyncClient
from sglang_admin.client.errors import ClientError
from sglang_admin.pb import common_pb2 as pb

if TYPE_CHECKING:
    import torch

    from sglang_admin.model.dist_group import WeightGroup
    from sglang_admin.model.weight_push import Bucket

FLATTENED_BUCKET = "flattened_bucket"


class WeightPushError(ClientError):
    """A worker refused or failed a push; the message names the worker and why."""


def workers_backend(infos: Sequence[pb.GetServerInfoResponse]) -> str:
    """nccl when every rank of every worker runs on CUDA (as their GetServerInfo says),
    gloo when every one runs on the CPU; a fleet that mixes them cannot share one group."""
    devices = {s.device.split(":")[0] for i in infos for s in i.rank_states}
    if devices == {"cuda"}:
        return "nccl"
    if devices <= {"cpu"}:
        return "gloo"
    raise WeightPushError(f"the workers' ranks run on {', '.join(sorted(devices))}: one "
                          "process group cannot reach them all; push to each kind apart")


def worker_tp_size(info: pb.GetServerInfoResponse) -> int:
    """A worker's TP ranks per replica (each joins a trainer's group at its own rank)."""
    return max(1, int(info.server_args["tp_size"])) if "tp_size" in info.server_args else 1


class WeightPusher:
    """Join a fleet of workers into one process group and push weights to them."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        bucket_bytes: int = 256 << 20,
        flatten: bool = False,
        device: str | None = None,
    ) -> None:
        """``device``: with nccl, the GPU the trainer sends from ("cuda:1"; default: the
        current CUDA device); gloo sends from the CPU."""
        self.targets = list(targets)
        self.device = device
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.flatten = flatten
        self.group: WeightGroup | None = None
        self.group_name = ""

    # ------------------------------------------------------------------ plumbing

    async def _each(self, call: Callable[[AsyncClient], Awaitable[Any]]) -> list[Any]:
        """``call`` on every worker at once; the answers in target order."""
        clients = [AsyncClient(t, api_key=self.api_key, timeout=self.timeout_s)
                   for t in self.targets]
        try:
            return list(await asyncio.gather(*(call(c) for c in clients)))
        finally:
            for c in clients:
                await c.close()

    def _check(self, what: str, answers: list[Any]) -> None:
        failed = [f"{t}: {a.message}" for t, a in zip(self.targets, answers, strict=True)
                  if not a.success]
        if failed:
            raise WeightPushError(f"{what} failed on {'; '.join(failed)}")

    # ------------------------------------------------------------------ group

    def join(self, master_address: str, master_port: int, group_name: str = "weights",
             backend: str = "auto") -> None:
        """Host group ``group_name`` at ``master_address:master_port`` as rank 0 and have
        every worker's ranks join it; raises :class:`WeightPushError` naming who did not.
        ``backend`` "auto" is nccl when every worker rank runs on CUDA, else gloo."""
        asyncio.run(self._join(master_address, master_port, group_name, backend))

    async def _join(self, address: str, port: int, group_name: str, backend: str) -> None:
        from sglang_admin.model.weight_push import join_as_trainer

        infos = await self._each(lambda c: c.server_info())
        if backend == "auto":
            backend = workers_backend(infos)
        sizes = [max(1, len(i.rank_states)) * worker_tp_size(i) for i in infos]
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]
        mine = asyncio.create_task(asyncio.to_thread(
            join_as_trainer, address, port, world, group_name, backend, self.timeout_s,
            self.device))
        clients = [AsyncClient(t, api_key=self.api_key, timeout=self.timeout_s)
                   for t in self.targets]
        try:
            answers = await asyncio.gather(*(
                c.init_weights_update_group(address, port, off, world, group_name, backend)
                for c, off in zip(clients, offsets, strict=True)), return_exceptions=True)
        finally:
            for c in clients:
                await c.close()
        errors = [f"{t}: {a}" for t, a in zip(self.targets, answers, strict=True)
                  if isinstance(a, BaseException)]
        try:
            group = await mine
        except Exception as exc:
            raise WeightPushError(f"the trainer could not host group {group_name!r}: {exc}"
                                  + (f"; {'; '.join(errors)}" if errors else "")) from None
        if errors:
            group.destroy()
            raise WeightPushError("joining failed on " + "; ".join(errors))
        try:
            self._check(f"joining group {group_name!r}", list(answers))
        except WeightPushError:
            group.destroy()
            raise
        self.group, self.group_name = group, group_name

    def destroy(self) -> None:
        """Every worker leaves the group, then the trainer."""
        if self.group is None:
            return
        name, group = self.group_name, self.group
        self.group = None
        try:
            answers = asyncio.run(self._each(lambda c: c.destroy_weights_update_group(name)))
            self._check(f"destroying group {name!r}", answers)
        finally:
            group.destroy()

    # ------------------------------------------------------------------ push

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
             weight_version: str = "", flush_cache: bool = True) -> None:
        """Broadcast every tensor to every worker rank, bucketed; raises
        :class:`WeightPushError` when any worker failed (its weights are then partially
        updated and it refuses Generate until a good push or a reload from disk)."""
        from sglang_admin.model.weight_push import buckets

        if self.group is None:
            raise WeightPushError("join() the workers into a group first")
        todo = buckets(named_tensors, self.bucket_bytes)
        for k, bucket in enumerate(todo):
            last = k == len(todo) - 1
            asyncio.run(self._push_bucket(bucket, weight_version if last else "",
                                          flush_cache and last))

    async def _push_bucket(self, bucket: Bucket, version: str, flush: bool) -> None:
        from sglang_admin.model.weight_push import broadcast_bucket, broadcast_each

        group = self.group
        assert group is not None
        calls = asyncio.ensure_future(self._each(
            lambda c: c.update_weights_from_distributed(
                bucket.names, bucket.dtype_names, bucket.shapes, self.group_name,
                flush_cache=flush, weight_version=version,
                load_format=FLATTENED_BUCKET if self.flatten else "")))
        send = broadcast_bucket if self.flatten else broadcast_each
        sent = asyncio.ensure_future(asyncio.to_thread(send, group, bucket, self.timeout_s))
        done, _ = await asyncio.wait({calls, sent}, return_when=asyncio.FIRST_EXCEPTION)
        if calls in done and calls.exception() is not None:
            raise WeightPushError(f"a worker refused the update: {calls.exception()}")
        answers = await calls
        try:
            await sent
        except Exception as exc:
            raise WeightPushError(f"broadcasting {len(bucket.names)} tensors failed: "
                                  f"{exc}") from None
        self._check("UpdateWeightsFromDistributed", answers)

    def push_shared(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                    weight_version: str = "", flush_cache: bool = True) -> None:
        """Hand every tensor to workers on this host through shared memory, bucketed (one
        segment per bucket, unlinked once every worker loaded it)."""
        from sglang_admin.model.weight_push import buckets

        todo = buckets(named_tensors, self.bucket_bytes)
        for k, bucket in enumerate(todo):
            last = k == len(todo) - 1
            asyncio.run(self._push_shared_bucket(bucket, weight_version if last else "",
                                                 flush_cache and last))

    async def _push_shared_bucket(self, bucket: Bucket, version: str, flush: bool) -> None:
        from sglang_admin.model.weight_push import write_shared

        shm, offsets = write_shared(bucket)
        try:
            manifest = [
                pb.SharedTensor(name=n, dtype=d, shape=s, offset=o)
                for n, d, s, o in zip(bucket.names, bucket.dtype_names, bucket.shapes,
                                      offsets, strict=True)
            ]
            answers = await self._each(lambda c: c.update_weights_from_tensor(
                shm.name, manifest, flush_cache=flush, weight_version=version))
            self._check("UpdateWeightsFromTensor", answers)
        finally:
            shm.close()
            shm.unlink()
