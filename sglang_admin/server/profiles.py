"""The server's side of profiling: request checks, output confinement, the profiles it
started, merged traces and the file chunks of DownloadProfile.

- ``output_dir`` (relative: under the profile root; absolute: must lie inside it) is
  resolved with symlinks and must stay inside ``args.profile_dir`` (PERMISSION_DENIED
  otherwise); nothing is created before that check passes. The ranks check it again.
- Size cap: ``args.profile_max_bytes`` per profile, split evenly over the ranks; each rank
  checks its share after every file it writes (see ``scheduler/profiling/export.py``). A merged
  trace is written only while the profile's files stay under the whole cap.
- The registry remembers the profiles this server started (the newest
  ``MAX_PROFILES``); a profile is finished once StopProfile answered for it or, for one that
  stopped by itself after num_steps, once no rank reports a running profiler.

Profiling is spread over several modules; their map is in ``scheduler/profiling/export.py``'s
docstring.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from sglang_admin.config import ServerArgs, is_inside
from sglang_admin.constants import DEFAULT_PROFILE_ACTIVITIES, profile_file_stem
from sglang_admin.messages import StartProfileReq, StateReq
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server import trace_merge
from sglang_admin.server.errors import ServiceError, invalid

ACTIVITIES = ("CPU", "GPU", "CUDA", "MEM")
STAGES = {"prefill": "prefill", "extend": "prefill", "decode": "decode"}
CHUNK_BYTES = 1 << 20
MAX_PROFILES = 64
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """A boolean environment setting: false/0/no/off turn it off, anything else on."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in _FALSE


def resolve_output_dir(requested: str, root: str) -> str:
    """The real path of a requested output_dir, or PERMISSION_DENIED naming the root."""
    if "\x00" in requested:
        raise invalid("output_dir must not contain NUL characters")
    real_root = os.path.realpath(root)
    path = requested or real_root
    if not os.path.isabs(path):
        path = os.path.join(real_root, path)
    real = os.path.realpath(path)
    if os.path.commonpath([real, real_root]) != real_root:
        raise ServiceError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"output_dir {requested!r} resolves to {real}, outside the profile root {root} "
            "(set with --profile-dir)",
        )
    return real



@dataclass
class ProfileRecord:
    """A profile this server started."""

    profile_id: str
    stem: str
    output_dir: str
    merge: bool
    max_bytes: int
    started_at: float = field(default_factory=time.time)
    finished: bool = False
    files: list[str] = field(default_factory=list)  # reported by StopProfile
    # The one merge of this profile's traces, shared by StopProfile and every download.
    merge_task: asyncio.Future | None = field(default=None, repr=False, compare=False)


@dataclass
class StartPlan:
    """A checked StartProfile request, ready to be sent to every rank."""

    profile_id: str
    output_dir: str
    prefix: str
    start_step: int | None
    num_steps: int | None
    activities: list[str]
    with_stack: bool
    record_shapes: bool
    profile_by_stage: bool
    profile_stages: list[str]
    merge: bool
    max_bytes: int  # each (dp, tp) rank's share of the cap
    dp_size: int
    root: str
    notes: list[str]
    tp_size: int = 1

    def message(self, rid: str, deadline: float, trace: dict[str, str]) -> StartProfileReq:
        return StartProfileReq(
            rid=rid,
            output_dir=self.output_dir,
            profile_id=self.profile_id,
            start_step=self.start_step,
            num_steps=self.num_steps,
            activities=self.activities,
            with_stack=self.with_stack,
            record_shapes=self.record_shapes,
            profile_by_stage=self.profile_by_stage,
            profile_stages=self.profile_stages,
            merge_profiles=self.merge,
            max_bytes=self.max_bytes,
            deadline=deadline,
            trace=trace,
            profile_prefix=self.prefix,
            dp_size=self.dp_size,
            profile_root=self.root,
        )

    def record(self) -> ProfileRecord:
        return ProfileRecord(
            self.profile_id, profile_file_stem(self.profile_id, self.prefix), self.output_dir,
            self.merge, self.max_bytes * self.dp_size * self.tp_size,
        )

    def started_message(self) -> str:
        if self.start_step:
            text = f"Profiling armed for forward step {self.start_step}"
        else:
            text = "Start profiling."
        text += f" Traces will be saved to {self.output_dir} (profile id {self.profile_id})"
        return text + "".join(f"; {n}" for n in self.notes)


def plan_start(
    request: pb.StartProfileRequest, args: ServerArgs, device: str, profile_id: str
) -> StartPlan:
    """Check a StartProfileRequest; INVALID_ARGUMENT or PERMISSION_DENIED on refusal."""
    for name in ("start_step", "num_steps"):
        if request.HasField(name) and getattr(request, name) < 0:
            raise invalid(f"{name} must be >= 0, got {getattr(request, name)}")
    names: list[str] = []
    for raw in request.activities or DEFAULT_PROFILE_ACTIVITIES:
        name = raw.strip().upper()
        if name not in ACTIVITIES:
            raise invalid(f"unknown profiler activity {raw!r}; valid: CPU, GPU (or CUDA), MEM")
        name = "GPU" if name == "CUDA" else name
        if name not in names:
            names.append(name)
    notes: list[str] = []
    if "GPU" in names and not device.startswith("cuda"):
        names.remove("GPU")
        notes.append("GPU activity left out: this server has no CUDA device")
        if not names:
            names.append("CPU")
            notes.append("profiling CPU activity instead")
    if "MEM" in names and not device.startswith("cuda"):
        notes.append("MEM without CUDA: memory events go into the trace, no memory snapshot")
    stages: list[str] = []
    for raw in request.profile_stages:
        if raw.strip().lower() not in STAGES:
            raise invalid(f"unknown profile stage {raw!r}; valid: prefill (or extend), decode")
        stages.append(STAGES[raw.strip().lower()])
    prefix = request.profile_prefix if request.HasField("profile_prefix") else ""
    if prefix and not _PREFIX_RE.match(prefix):
        raise invalid(
            f"profile_prefix {prefix!r} must be 1-100 characters of letters, digits, '.', "
            "'_' or '-'"
        )
    requested = request.output_dir if request.HasField("output_dir") else ""
    output_dir = resolve_output_dir(requested, args.profile_dir)
    with_stack = (
        request.with_stack if request.HasField("with_stack")
        else env_flag("SGLANG_PROFILE_WITH_STACK", True)
    )
    record_shapes = (
        request.record_shapes if request.HasField("record_shapes")
        else env_flag("SGLANG_PROFILE_RECORD_SHAPES", True)
    )
    return StartPlan(
        profile_id=profile_id,
        output_dir=output_dir,
        prefix=prefix,
        start_step=request.start_step or None,
        num_steps=request.num_steps or None,
        activities=names,
        with_stack=with_stack,
        record_shapes=record_shapes,
        profile_by_stage=request.profile_by_stage or bool(stages),
        profile_stages=stages,
        merge=request.merge_profiles,
        # each (dp, tp) rank writes its own traces: an even share each
        max_bytes=max(1, args.profile_max_bytes // max(args.dp_size * args.tp_size, 1)),
        dp_size=args.dp_size,
        tp_size=args.tp_size,
        root=os.path.realpath(args.profile_dir),
        notes=notes,
    )


class ProfileRegistry:
    """The profiles one server started, newest last."""

    def __init__(self) -> None:
        self.records: OrderedDict[str, ProfileRecord] = OrderedDict()
        # One start/stop at a time, so every rank sees the same order of profile ops.
        self.lock = asyncio.Lock()

    def new_id(self) -> str:
        """SGLang's profile id: the start time in seconds, made unique here."""
        profile_id = str(time.time())
        while profile_id in self.records:
            profile_id = str(time.time())
        return profile_id

    def add(self, record: ProfileRecord) -> None:
        self.records[record.profile_id] = record
        while len(self.records) > MAX_PROFILES:
            self.records.popitem(last=False)

    def get(self, profile_id: str) -> ProfileRecord | None:
        return self.records.get(profile_id)

    def newest_first(self) -> list[ProfileRecord]:
        return list(reversed(self.records.values()))


async def busy_ranks(comm: Any, timeout: float) -> list[int]:
    """Ranks whose profiler is armed or running (a rank that does not answer counts)."""
    replies, failures = await comm.call_ranks(lambda rid: StateReq(rid), timeout)
    busy = [r for r, reply in replies.items() if reply.result.profiler_state != "idle"]
    return sorted(busy + list(failures))


async def find_finished(
    registry: ProfileRegistry, profile_id: str, comm: Any, timeout: float
) -> ProfileRecord:
    """The finished profile asked for (empty id: the newest finished one), or a refusal."""
    if profile_id:
        record = registry.get(profile_id)
        if record is None:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"no profile {profile_id!r} on this server (it knows the last {MAX_PROFILES})",
            )
        candidates = [record]
    else:
        candidates = registry.newest_first()
    newest = registry.newest_first()[:1]
    for record in candidates:
        if not record.finished and record in newest:
            busy = await busy_ranks(comm, timeout)
            if busy:
                if profile_id:
                    raise ServiceError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"profile {profile_id} is still running on rank(s) "
                        f"{', '.join(map(str, busy))}: call StopProfile first (or wait for "
                        "its num_steps)",
                    )
                continue
            record.finished = True
        return record
    raise ServiceError(grpc.StatusCode.NOT_FOUND, "no finished profile on this server yet")


def profile_files(record: ProfileRecord, root: str) -> list[str]:
    """The files of a profile on disk: plain files (no symlinks) inside the root."""
    out: list[str] = []
    try:
        names = sorted(os.listdir(record.output_dir))
    except OSError:
        return out
    for name in names:
        if not name.startswith(record.stem + "-"):
            continue
        if not name.endswith((".trace.json.gz", ".pickle")):
            continue
        path = os.path.join(record.output_dir, name)
        if os.path.islink(path) or not os.path.isfile(path) or not is_inside(path, root):
            continue
        out.append(path)
    return out


def merge_traces(record: ProfileRecord, files: list[str]) -> tuple[list[str], str]:
    """Write one trace per stage holding every rank's events; (files written, note).

    Runs :mod:`trace_merge` in a child process, so that parsing the traces never holds
    this process's GIL (its event loop serves every stream); raises RuntimeError with the
    child's reason when it fails.
    """
    done = subprocess.run(
        [sys.executable, trace_merge.__file__, record.output_dir, record.stem,
         str(record.max_bytes), *files],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeError(f"merging the profile's traces failed: {tail}")
    outcome = json.loads(done.stdout)
    return list(outcome["written"]), str(outcome["note"])


async def merge_once(record: ProfileRecord, files: list[str]) -> tuple[list[str], str]:
    """:func:`merge_traces` for this profile, run once (in a worker thread: it reads and
    writes whole traces) however many StopProfile and DownloadProfile calls ask at the
    same time; they all get its outcome. A merge that failed is tried again by the next
    caller; one whose caller went away runs to its end for the others."""
    task = record.merge_task
    if task is None or (task.done() and task.exception() is not None):
        task = asyncio.ensure_future(asyncio.to_thread(merge_traces, record, list(files)))
        record.merge_task = task
    return await asyncio.shield(task)


def _open_for_reading(path: str) -> tuple[Any, int]:
    f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by file_chunks
    return f, os.fstat(f.fileno()).st_size


def _read_upto(f: Any, size: int) -> bytes:
    """Up to `size` bytes from `f`: fewer only at the end of the file."""
    parts: list[bytes] = []
    while size > 0:
        data = f.read(size)
        if not data:
            break
        parts.append(data)
        size -= len(data)
    return b"".join(parts)


async def file_chunks(path: str, chunk_bytes: int = CHUNK_BYTES) -> AsyncIterator[pb.ProfileFileChunk]:
    """One file as ProfileFileChunks; the last one carries the sha256 of the whole file.

    Every chunk is read through one open descriptor, so a file renamed over this one
    meanwhile (a merge) cannot mix two files; a file that shrinks while it is read ends
    the call with ABORTED rather than an OK with part of it.
    """
    name = os.path.basename(path)
    try:
        f, size = await asyncio.to_thread(_open_for_reading, path)
    except FileNotFoundError:
        raise ServiceError(
            grpc.StatusCode.ABORTED, f"profile file {name} was removed before it could be read"
        ) from None
    try:
        digest = hashlib.sha256()
        offset = 0
        while True:
            want = min(chunk_bytes, size - offset)
            data = await asyncio.to_thread(_read_upto, f, want) if want else b""
            if len(data) < want:
                raise ServiceError(
                    grpc.StatusCode.ABORTED,
                    f"profile file {name} shrank while it was read ({offset + len(data)} of "
                    f"{size} bytes): download it again",
                )
            digest.update(data)
            last = offset + len(data) >= size
            yield pb.ProfileFileChunk(
                file_name=name, data=data, offset=offset, last=last,
                sha256=digest.hexdigest() if last else "",
            )
            offset += len(data)
            if last:
                return
    finally:
        f.close()
