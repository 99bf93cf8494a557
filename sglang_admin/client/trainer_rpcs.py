"""The RPCs that take weights from a trainer rather than from disk: a process group that
the ranks join and receive broadcasts from, and tensors placed in shared memory. A base of
:class:`~sglang_admin.client.client.AsyncClient` (which supplies ``stub`` and the call
options), so the blocking client and FanOut have them as every other RPC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc


class TrainerWeightRPCs:
    """InitWeightsUpdateGroup, UpdateWeightsFromDistributed, DestroyWeightsUpdateGroup and
    UpdateWeightsFromTensor as ``async`` methods of the client."""

    stub: pb_grpc.SglangSchedulerStub
    _call_options: Callable[[], dict[str, Any]]  # AsyncClient's: every call's deadline, metadata

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "",
    ) -> pb.AdminResponse:
        """InitWeightsUpdateGroup: every rank joins the trainer's process group as rank
        ``rank_offset + dp_rank`` (the trainer, rank 0, hosts the TCPStore at
        ``master_address:master_port``). Answers once all joined; otherwise ``success`` is
        false by the call's deadline and ``message`` names the ranks that did not join."""
        req = pb.InitWeightsUpdateGroupRequest(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend)
        return await self.stub.InitWeightsUpdateGroup(req, **self._call_options())

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        *,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str = "",
        load_format: str = "",
    ) -> pb.UpdateWeightsResponse:
        """UpdateWeightsFromDistributed: every rank receives each named tensor by broadcast
        from rank 0 of ``group_name`` (in this order; with ``load_format`` "flattened_bucket",
        one broadcast of them all concatenated) and loads it. The trainer broadcasts while
        this call runs. A failure part-way leaves the weights partially updated: Generate is
        then refused until a good update or UpdateWeightsFromDisk."""
        req = pb.UpdateWeightsFromDistributedRequest(
            names=list(names), dtypes=list(dtypes),
            shapes=[pb.TensorShape(dims=list(s)) for s in shapes], group_name=group_name,
            flush_cache=flush_cache, abort_all_requests=abort_all_requests,
            weight_version=weight_version, load_format=load_format)
        return await self.stub.UpdateWeightsFromDistributed(req, **self._call_options())

    async def destroy_weights_update_group(self, group_name: str) -> pb.AdminResponse:
        """DestroyWeightsUpdateGroup: every rank leaves ``group_name``."""
        req = pb.DestroyWeightsUpdateGroupRequest(group_name=group_name)
        return await self.stub.DestroyWeightsUpdateGroup(req, **self._call_options())

    async def update_weights_from_tensor(
        self,
        shm_name: str,
        tensors: Sequence[pb.SharedTensor],
        *,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str = "",
    ) -> pb.UpdateWeightsResponse:
        """UpdateWeightsFromTensor: every rank (on this host) copies the tensors the
        manifest ``tensors`` places in shared-memory segment ``/dev/shm/<shm_name>``."""
        req = pb.UpdateWeightsFromTensorRequest(
            shm_name=shm_name, tensors=list(tensors), flush_cache=flush_cache,
            abort_all_requests=abort_all_requests, weight_version=weight_version)
        return await self.stub.UpdateWeightsFromTensor(req, **self._call_options())
