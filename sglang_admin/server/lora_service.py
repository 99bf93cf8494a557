"""The LoRA RPCs: LoadLoRAAdapter, UnloadLoRAAdapter, ListLoadedLoRAAdapters.

Each fans out to every rank (scheduler/ops/lora_control.py does the work there), with one
result per rank. The caller mints ``lora_id``; ``GenerateRequest.lora_id`` then selects the
adapter. A failure that every rank reports alike becomes the call's status (the adapter does
not fit the base model: INVALID_ARGUMENT; every slot pinned or busy, or a pinned load
that would pin the last slot: RESOURCE_EXHAUSTED;
unknown adapter: NOT_FOUND; id taken: ALREADY_EXISTS); a failure on some ranks only is an
unsuccessful response whose rank results say which.
"""

from __future__ import annotations

import grpc

from sglang_admin.config import ServerArgs
from sglang_admin.constants import LORA_NOT_ENABLED
from sglang_admin.messages import ListLoraReq, LoadLoraReq, LoraResult, UnloadLoraReq
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.admin import AdminCalls, FanOut
from sglang_admin.server.errors import MAX_REQUEST_ID_CHARS, ServiceError, invalid

LOAD_TIMEOUT_S = 120.0  # reads the adapter from disk
UNLOAD_TIMEOUT_S = 600.0  # waits for the requests that use the adapter
LIST_TIMEOUT_S = 10.0


def _loaded_ids(out: FanOut) -> list[str]:
    """The adapters rank 0 (else the first rank that answered) holds now."""
    for rank in sorted(out.replies):
        found = out.result(rank)
        if isinstance(found, LoraResult):
            return [a.lora_id for a in found.adapters]
    return []


def _raise_uniform_failure(out: FanOut) -> None:
    """Every rank failed with the same kind of error: that is the call's status."""
    if out.ok or out.failures or len(out.replies) != out.dp_size:
        return
    codes = set()
    for reply in out.replies.values():
        found = reply.result
        codes.add(found.error_code if isinstance(found, LoraResult) and not reply.success
                  else "")
    if len(codes) == 1:
        code = codes.pop()
        if code:
            raise ServiceError(grpc.StatusCode[code], out.failure_message())


class Lora:
    """Load, unload and list the LoRA adapters of every rank."""

    def __init__(self, args: ServerArgs, admin: AdminCalls) -> None:
        self.args = args
        self.admin = admin

    def _require_enabled(self) -> None:
        if not self.args.enable_lora:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, LORA_NOT_ENABLED)

    async def load(
        self, request: pb.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadLoRAAdapterResponse:
        self._require_enabled()
        if not request.lora_id:
            raise invalid("lora_id must be set: the caller mints the adapter's id")
        if len(request.lora_id) > MAX_REQUEST_ID_CHARS:
            raise invalid(f"lora_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        if not request.lora_name:
            raise invalid("lora_name must be set")
        if not request.lora_path:
            raise invalid("lora_path must name a PEFT adapter directory")
        out = await self.admin.fan_out(
            context, "load_lora_adapter",
            lambda rid, deadline, trace: LoadLoraReq(
                rid, request.lora_id, request.lora_name, request.lora_path, request.pinned,
                deadline=deadline, trace=trace),
            LOAD_TIMEOUT_S, lora_id=request.lora_id, lora_path=request.lora_path,
        )
        _raise_uniform_failure(out)
        first = out.replies.get(0)
        return pb.LoadLoRAAdapterResponse(
            success=out.ok,
            # rank 0's words (with the adapters it evicted, if any) when every rank succeeded
            message=out.message(first.message if first is not None else ""),
            loaded_lora_ids=_loaded_ids(out), rank_results=out.rank_results(),
        )

    async def unload(
        self, request: pb.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoRAAdapterResponse:
        self._require_enabled()
        if not request.lora_id and not request.lora_name:
            raise invalid("name the adapter to unload: lora_id or lora_name")
        which = request.lora_id or request.lora_name
        out = await self.admin.fan_out(
            context, "unload_lora_adapter",
            lambda rid, deadline, trace: UnloadLoraReq(
                rid, request.lora_id, request.lora_name, deadline=deadline, trace=trace),
            UNLOAD_TIMEOUT_S, lora=which,
        )
        _raise_uniform_failure(out)
        return pb.UnloadLoRAAdapterResponse(
            success=out.ok, message=out.message(f"unloaded LoRA adapter {which!r}"),
            loaded_lora_ids=_loaded_ids(out), rank_results=out.rank_results(),
        )

    async def list(
        self, request: pb.ListLoadedLoRAAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLoadedLoRAAdaptersResponse:
        self._require_enabled()
        out = await self.admin.fan_out(
            context, "list_lora_adapters",
            lambda rid, deadline, trace: ListLoraReq(rid, deadline=deadline, trace=trace),
            LIST_TIMEOUT_S,
        )
        if not out.ok:
            raise ServiceError(grpc.StatusCode.INTERNAL, out.failure_message())
        found = out.result(0)
        adapters = found.adapters if isinstance(found, LoraResult) else []
        return pb.ListLoadedLoRAAdaptersResponse(loaded_adapters=[
            pb.LoadedLoRAAdapter(lora_id=a.lora_id, lora_name=a.lora_name,
                                 lora_path=a.lora_path, pinned=a.pinned)
            for a in adapters
        ])
