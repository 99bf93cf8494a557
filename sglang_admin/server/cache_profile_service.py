"""The cache and profiler RPCs: FlushCache, StartProfile, StopProfile, DownloadProfile.

The profile rules (output confinement, size caps, merging, the registry of profiles this
server started) live in server/profiles.py; this module runs the ops over the ranks.

Profiling is spread over several modules; their map is in ``scheduler/profiling/export.py``'s
docstring.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc

from sglang_admin.config import ServerArgs
from sglang_admin.messages import (
    PROFILE_STOPPED_BY_ITSELF,
    FlushCacheReq,
    FlushResult,
    ProfileStopResult,
    StopProfileReq,
)
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server import profiles
from sglang_admin.server.admin import AdminCalls, CallContext, effective_timeout
from sglang_admin.server.communicator import Communicator
from sglang_admin.server.errors import ServiceError, invalid
from sglang_admin.server.info_service import INFO_TIMEOUT_S

FLUSH_MARGIN_S = 30.0
PROFILE_TIMEOUT_S = 600.0


MAX_FLUSH_TIMEOUT_S = 3600.0  # FlushCache.timeout_s; a flush waits at most an hour for idle


def flush_timeout_from_proto(timeout_s: float) -> float:
    """FlushCacheRequest.timeout_s checked: finite and at most MAX_FLUSH_TIMEOUT_S (<= 0:
    fail at once when the ranks are busy)."""
    if not math.isfinite(timeout_s):
        raise invalid(f"timeout_s must be a finite number, got {timeout_s}")
    if timeout_s > MAX_FLUSH_TIMEOUT_S:
        raise invalid(f"timeout_s must be at most {MAX_FLUSH_TIMEOUT_S:g} seconds, got {timeout_s}")
    return timeout_s


class CacheAndProfile:
    """Flush the prefix cache; run, stop and hand out torch.profiler traces."""

    def __init__(self, args: ServerArgs, comm: Communicator, admin: AdminCalls) -> None:
        self.args = args
        self.comm = comm
        self.admin = admin
        self.profiles = profiles.ProfileRegistry()  # the profiles this server started

    async def flush(
        self, request: pb.FlushCacheRequest, context: CallContext
    ) -> pb.FlushCacheResponse:
        timeout_s = flush_timeout_from_proto(float(request.timeout_s))
        out = await self.admin.fan_out(
            context, "flush_cache",
            lambda rid, deadline, trace: FlushCacheReq(
                rid, timeout_s, deadline=deadline, trace=trace),
            max(timeout_s, 0.0) + FLUSH_MARGIN_S, timeout_s=timeout_s,
        )
        response = pb.FlushCacheResponse(
            success=out.ok, message=out.message("Cache flushed successfully"))
        add = response.rank_results.add  # made in place, each in one call
        for rank, ok, text in out.outcomes():
            found = out.result(rank)
            freed = found.tokens_freed if ok and isinstance(found, FlushResult) else 0
            add(dp_rank=rank, success=ok, message=text, tokens_freed=freed)
        return response

    async def start_profile(
        self, request: pb.StartProfileRequest, context: CallContext
    ) -> pb.ProfileResponse:
        """Start (or arm, with start_step) a torch.profiler session on every rank."""
        self.admin.require_ready()
        registry = self.profiles
        info = self.comm.model_info
        plan = profiles.plan_start(
            request, self.args, info.device if info else "cpu", registry.new_id()
        )
        async with registry.lock:  # every rank sees the profile ops in one order
            out = await self.admin.fan_out(
                context, "start_profile", plan.message, PROFILE_TIMEOUT_S,
                raise_unanswered=False, profile_id=plan.profile_id, output_dir=plan.output_dir,
            )
        if any(r.success for r in out.replies.values()):
            registry.add(plan.record())
        out.raise_if_unanswered()
        return pb.ProfileResponse(
            success=out.ok, message=out.message(plan.started_message()),
            rank_results=out.rank_results(), profile_id=plan.profile_id,
        )

    async def stop_profile(
        self, request: pb.StopProfileRequest, context: CallContext
    ) -> pb.ProfileResponse:
        """Stop every rank's profiler; answers once every rank has written its files."""
        registry = self.profiles
        async with registry.lock:
            out = await self.admin.fan_out(
                context, "stop_profile",
                lambda rid, deadline, trace: StopProfileReq(rid, deadline=deadline, trace=trace),
                PROFILE_TIMEOUT_S, raise_unanswered=False,
            )
        results = out.rank_results()
        files: list[str] = []
        profile_id = ""
        for res in results:
            found = out.result(res.dp_rank)
            if isinstance(found, ProfileStopResult):
                res.files.extend(found.files)
                files.extend(found.files)
                profile_id = profile_id or found.profile_id
        self.comm.metrics.profile_files(files)
        record = registry.get(profile_id)
        notes: list[str] = []
        if record is not None:
            record.finished = True
            record.files = list(files)
            if record.merge and files:
                merged, note = await profiles.merge_once(record, files)
                files.extend(f for f in merged if f not in files)
                notes += [note] if note else []
        out.raise_if_unanswered()
        if out.ok and not files:
            message = "Stop profiling. No file written: " + " | ".join(
                f"rank {r.dp_rank}: {r.message}" for r in results
            )
        elif out.ok:
            where = f" to {record.output_dir}" if record is not None else ""
            message = f"Stop profiling. {len(files)} file(s) written{where}"
            # a profile that had ended at its cap: say so (each rank's message names it)
            message += "".join(f"; rank {r.dp_rank}: {r.message}" for r in results
                               if r.message.startswith(PROFILE_STOPPED_BY_ITSELF))
        else:
            message = out.failure_message()
        message += "".join(f"; {n}" for n in notes)
        return pb.ProfileResponse(
            success=out.ok, message=message, rank_results=results, files=files,
            profile_id=profile_id,
        )

    async def download_profile(
        self, request: pb.DownloadProfileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProfileFileChunk]:
        """Stream the files of a finished profile (empty id: the newest finished one)."""
        registry = self.profiles
        record = await profiles.find_finished(
            registry, request.profile_id, self.comm, effective_timeout(context, INFO_TIMEOUT_S)
        )
        files = profiles.profile_files(record, self.args.profile_dir)
        merged_on_disk = any("-merged" in f for f in files)
        if record.merge and files and (record.merge_task is not None or not merged_on_disk):
            # One merge per profile, shared with StopProfile and concurrent downloads.
            await profiles.merge_once(record, [f for f in files if "-merged" not in f])
            files = profiles.profile_files(record, self.args.profile_dir)
        if not files:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"profile {record.profile_id} has no files in {record.output_dir}",
            )
        for path in files:
            async for chunk in profiles.file_chunks(path):
                yield chunk
