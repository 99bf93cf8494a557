"""The rank profiler (scheduler/profiling/profiler.py) on a tiny torch workload, no server, and the
server-side helpers of server/profiles.py."""

from __future__ import annotations

import asyncio
import gc
import gzip
import hashlib
import json
import os
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from sglang_admin.config import ServerArgs
from sglang_admin.messages import ProfileStopResult, StartProfileReq
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.scheduler.profiling.profiler import (
    ALREADY_RUNNING,
    NOT_RUNNING,
    SEGMENT_STEPS,
    Profiler,
)
from sglang_admin.server import profiles
from sglang_admin.server.admin import rank_failure_text
from sglang_admin.server.communicator import RankFailure
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.metrics import Metrics

X = torch.randn(32, 32)


def req(out: Path, **kw: Any) -> StartProfileReq:
    kw.setdefault("activities", ["CPU"])
    kw.setdefault("with_stack", False)
    kw.setdefault("record_shapes", False)
    return StartProfileReq(rid="r", output_dir=str(out), profile_id="p1", **kw)


def step(prof: Profiler, stage: str = "prefill") -> list[str] | None:
    """One forward step as the rank loop runs it, labelled like the model runner does."""
    prof.before_step(stage)
    kind = "decode" if stage == "decode" else "extend"
    with torch.profiler.record_function(f"forward_{kind}_bs{prof.forward_ct}"):
        X @ X
    done = prof.after_step(stage)  # a Future of the files, written in the background
    return done.result() if done is not None else None


def labels(path: str) -> list[str]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    # on CUDA each labelled range also has a gpu_user_annotation copy: counted once
    return sorted(e["name"] for e in data["traceEvents"]
                  if e["name"].startswith("forward_") and e.get("cat") != "gpu_user_annotation")


def test_start_stop_writes_one_trace(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    ok, text = prof.start(req(tmp_path))
    assert ok, text
    assert prof.state == "running"
    for _ in range(3):
        assert step(prof) is None
    ok, text, data = prof.stop()
    assert ok, text
    assert prof.state == "idle"
    assert data.profile_id == "p1"
    assert data.files == [str(tmp_path / "p1-TP-0.trace.json.gz")]
    assert labels(data.files[0]) == [
        "forward_extend_bs1", "forward_extend_bs2", "forward_extend_bs3"
    ]


def test_error_strings(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    assert prof.stop() == (False, NOT_RUNNING, ProfileStopResult([], ""))
    assert NOT_RUNNING == "Profiling is not in progress. Call /start_profile first."
    assert prof.start(req(tmp_path))[0]
    assert prof.start(req(tmp_path)) == (False, ALREADY_RUNNING)
    assert ALREADY_RUNNING == "Profiling is already in progress. Call /stop_profile first."
    prof.stop()


def test_num_steps_stops_by_itself(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    assert prof.start(req(tmp_path, num_steps=2))[0]
    assert step(prof) is None
    files = step(prof)
    assert files == [str(tmp_path / "p1-TP-0.trace.json.gz")]
    assert prof.state == "idle"
    step(prof)  # not recorded
    assert labels(files[0]) == ["forward_extend_bs1", "forward_extend_bs2"]
    assert prof.stop()[1] == NOT_RUNNING


def test_start_step_arms(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    step(prof)  # rank at step 1
    ok, text = prof.start(req(tmp_path, start_step=3, num_steps=2))
    assert ok and "step 3" in text
    assert prof.state == "armed"
    step(prof)  # step 2: not yet
    assert prof.state == "armed"
    assert step(prof) is None  # step 3: starts
    assert prof.state == "running"
    files = step(prof)  # step 4: the second profiled step
    assert files and labels(files[0]) == ["forward_extend_bs3", "forward_extend_bs4"]


def test_a_second_start_while_armed_replaces_the_plan(tmp_path: Path) -> None:
    """As SGLang: armed (start_step, not recording yet) accepts another start."""
    prof = Profiler(0, "cpu")
    assert prof.start(req(tmp_path, start_step=10))[0]
    ok, text = prof.start(req(tmp_path, start_step=2, num_steps=1))
    assert ok and "step 2" in text and prof.state == "armed"
    assert step(prof) is None and prof.state == "armed"  # step 1
    files = step(prof)  # step 2: starts and, after one step, ends
    assert files and labels(files[0]) == ["forward_extend_bs2"]
    assert prof.start(req(tmp_path))[0]
    assert prof.start(req(tmp_path)) == (False, ALREADY_RUNNING)  # recording: refused
    prof.stop()


def test_stop_while_armed_writes_nothing(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    assert prof.start(req(tmp_path, start_step=10))[0]
    ok, text, data = prof.stop()
    assert ok and "before it started" in text
    assert data.files == [] and not list(tmp_path.iterdir())
    assert prof.state == "idle"


def test_by_stage_writes_a_trace_per_stage(tmp_path: Path) -> None:
    prof = Profiler(1, "cpu")
    assert prof.start(req(tmp_path, num_steps=2, profile_by_stage=True, dp_size=2))[0]
    step(prof, "prefill")
    step(prof, "prefill")  # EXTEND done (2 steps)
    assert prof.state == "running"
    step(prof, "decode")
    files = step(prof, "decode")  # DECODE done: the profile ends
    assert prof.state == "idle"
    extend = str(tmp_path / "p1-TP-0-DP-1-EXTEND.trace.json.gz")
    decode = str(tmp_path / "p1-TP-0-DP-1-DECODE.trace.json.gz")
    assert files == [extend, decode]
    assert labels(extend) == ["forward_extend_bs1", "forward_extend_bs2"]
    assert labels(decode) == ["forward_decode_bs3", "forward_decode_bs4"]


def test_by_stage_next_stage_ends_the_previous_session(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    assert prof.start(req(tmp_path, num_steps=5, profile_by_stage=True))[0]
    step(prof, "prefill")
    step(prof, "decode")  # decode starts: the EXTEND session ends with 1 step
    step(prof, "prefill")  # recorded in the DECODE session, not counted
    ok, _, data = prof.stop()
    assert ok
    extend, decode = data.files
    assert extend.endswith("p1-TP-0-EXTEND.trace.json.gz")
    assert labels(extend) == ["forward_extend_bs1"]
    assert labels(decode) == ["forward_decode_bs2", "forward_extend_bs3"]


def test_profile_stages_selects_stages(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    assert prof.start(req(tmp_path, num_steps=1, profile_stages=["decode"]))[0]
    step(prof, "prefill")
    files = step(prof, "decode")
    assert files == [str(tmp_path / "p1-TP-0-DECODE.trace.json.gz")]


def test_prefix_in_file_names(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    assert prof.start(req(tmp_path, num_steps=1, profile_prefix="bench"))[0]
    assert step(prof) == [str(tmp_path / "bench-p1-TP-0.trace.json.gz")]


def test_refusals(tmp_path: Path) -> None:
    """The rank re-checks only the output directory's confinement (where it creates it);
    activities, stages and step counts are refused at the edge (test_plan_start_...)."""
    prof = Profiler(0, "cpu")
    root = tmp_path / "root"
    root.mkdir()
    ok, text = prof.start(req(tmp_path / "elsewhere", profile_root=str(root)))
    assert not ok and "outside" in text
    assert not (tmp_path / "elsewhere").exists()
    assert prof.state == "idle"


def test_gpu_without_cuda_is_left_out(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    ok, text = prof.start(req(tmp_path, activities=["GPU"]))
    assert ok and "GPU activity left out" in text
    prof.stop()


def test_size_cap_stops_and_says_why(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    assert prof.start(req(tmp_path, max_bytes=100))[0]
    step(prof)
    ok, text, data = prof.stop()
    assert not ok and "cap" in text and "removed" in text
    assert data.files == [] and not list(tmp_path.glob("*.gz"))
    assert prof.state == "idle"


def test_mem_on_cpu_records_memory_events(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu")
    ok, text = prof.start(req(tmp_path, activities=["CPU", "MEM"], num_steps=1))
    assert ok and "MEM" in text
    files = step(prof)
    assert files and files[0].endswith(".trace.json.gz")


def test_max_steps_cap_stops_the_profile_and_the_next_stop_says_so(tmp_path: Path) -> None:
    prof = Profiler(0, "cpu", max_steps=3)
    assert prof.start(req(tmp_path))[0]
    assert step(prof) is None and step(prof) is None
    files = step(prof)  # the third step reaches the cap
    assert files == [str(tmp_path / "p1-TP-0.trace.json.gz")]
    assert prof.state == "idle"
    assert labels(files[0]) == ["forward_extend_bs1", "forward_extend_bs2", "forward_extend_bs3"]
    ok, text, data = prof.stop()
    assert ok and "cap of 3 forward steps" in text and "--profile-max-steps" in text
    assert data == ProfileStopResult(files, "p1")
    assert prof.stop()[1] == NOT_RUNNING  # said once


@pytest.mark.parametrize("by_stage", [False, True])
def test_segments_are_joined_into_one_trace(tmp_path: Path, by_stage: bool) -> None:
    """The torch session restarts every segment_steps steps (bounding the pause a stop
    costs the loop); the file still holds every step, and no part file stays behind."""
    prof = Profiler(0, "cpu", segment_steps=2)
    assert prof.start(req(tmp_path, profile_by_stage=by_stage, profile_stages=["prefill"]
                          if by_stage else []))[0]
    for _ in range(5):
        assert step(prof) is None
    ok, text, data = prof.stop()
    assert ok, text
    name = "p1-TP-0-EXTEND.trace.json.gz" if by_stage else "p1-TP-0.trace.json.gz"
    assert data.files == [str(tmp_path / name)]
    assert labels(data.files[0]) == [f"forward_extend_bs{i}" for i in range(1, 6)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_cuda_rank_records_a_session_in_one_segment(tmp_path: Path) -> None:
    """Restarting the profiler on CUDA restarts CUPTI (slow, and a hole in the GPU timeline
    each time), so a CUDA rank does not segment; a CPU rank does. Checked on the state
    machine: a rank named cuda records 40 steps without ending a segment."""
    assert Profiler(0, "cpu").segment_steps == SEGMENT_STEPS
    prof = Profiler(0, "cuda:0")
    assert prof.segment_steps == 0
    assert prof.start(req(tmp_path))[0]
    for _ in range(2 * SEGMENT_STEPS + 8):
        assert step(prof) is None
        assert prof.session is not None and prof.session.parts == []
    ok, text, data = prof.stop()
    assert ok, text
    assert len(labels(data.files[0])) == 2 * SEGMENT_STEPS + 8


def test_export_runs_in_the_background_while_steps_go_on(tmp_path: Path) -> None:
    """StopProfile's answer waits for the files; the loop does not."""
    prof = Profiler(0, "cpu")
    assert prof.start(req(tmp_path))[0]
    step(prof)
    gate = threading.Event()
    prof.export.pool.submit(gate.wait)  # hold the export thread
    pending = prof.request_stop()
    assert not pending.done() and prof.state == "idle"
    assert prof.reported_state == "exporting"  # the rank tells its files are not all written
    for _ in range(3):  # the rank keeps stepping meanwhile
        assert step(prof) is None
    assert prof.start(req(tmp_path / "next"))[0]  # and may even start the next profile
    gate.set()
    ok, text, data = pending.result(timeout=60)
    assert ok, text
    assert data.files == [str(tmp_path / "p1-TP-0.trace.json.gz")]
    assert labels(data.files[0]) == ["forward_extend_bs1"]
    assert prof.stop()[0]
    assert prof.reported_state == "idle"


def test_a_written_session_is_freed_without_a_collection(tmp_path: Path) -> None:
    """The recorded events go when the export is done, by refcounting: the full collection
    that would otherwise free torch's self-referencing profile holds the rank's GIL for
    ~0.3 s (no step, no heartbeat meanwhile)."""
    warm = Profiler(0, "cpu")  # torch's first profile in a process imports lazily, and
    assert warm.start(req(tmp_path / "warm"))[0]  # a traceback of that keeps it for gc
    step(warm)
    assert warm.stop()[0]
    gc.collect()
    gc.disable()
    try:
        for by_stage, steps in ((False, 3), (False, 20), (True, 3)):  # 20: segments too
            prof = Profiler(0, "cpu")
            assert prof.start(req(tmp_path / f"{by_stage}{steps}", profile_by_stage=by_stage))[0]
            step(prof)
            assert prof.session is not None and prof.session.prof is not None
            recorded = weakref.ref(prof.session.prof)
            for _ in range(steps - 1):
                step(prof)
            ok, text, _ = prof.stop()
            assert ok, text
            prof.export.pool.submit(lambda: None).result()  # the export's work item is gone
            assert recorded() is None
    finally:
        gc.enable()


# ---------------------------------------------------------------- server helpers


def test_resolve_output_dir(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    real_root = os.path.realpath(root)
    assert profiles.resolve_output_dir("", str(root)) == real_root
    assert profiles.resolve_output_dir("a/b", str(root)) == os.path.join(real_root, "a", "b")
    assert profiles.resolve_output_dir(str(root / "x"), str(root)) == os.path.join(real_root, "x")
    for bad in ("..", "../x", "/etc", "link/x", str(tmp_path)):
        with pytest.raises(ServiceError) as exc:
            profiles.resolve_output_dir(bad, str(root))
        assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert str(root) in exc.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_plan_start_defaults_and_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ServerArgs(profile_dir=str(tmp_path), dp_size=2, profile_max_bytes=1000)
    plan = profiles.plan_start(pb.StartProfileRequest(), args, "cpu", "id1")
    assert plan.activities == ["CPU"] and "GPU activity left out" in plan.started_message()
    assert plan.with_stack and plan.record_shapes and plan.max_bytes == 500
    assert plan.output_dir == os.path.realpath(tmp_path)
    monkeypatch.setenv("SGLANG_PROFILE_WITH_STACK", "false")
    monkeypatch.setenv("SGLANG_PROFILE_RECORD_SHAPES", "0")
    plan = profiles.plan_start(
        pb.StartProfileRequest(activities=["cuda", "MEM"], record_shapes=True), args, "cuda:0", "i"
    )
    assert plan.activities == ["GPU", "MEM"] and not plan.with_stack and plan.record_shapes
    for request, word in (
        (pb.StartProfileRequest(activities=["CPU", "NPU"]), "NPU"),
        (pb.StartProfileRequest(num_steps=-1), "num_steps"),
        (pb.StartProfileRequest(start_step=-2), "start_step"),
        (pb.StartProfileRequest(profile_stages=["warmup"]), "warmup"),
        (pb.StartProfileRequest(profile_prefix="../x"), "profile_prefix"),
    ):
        with pytest.raises(ServiceError) as exc:
            profiles.plan_start(request, args, "cpu", "i")
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and word in exc.value.message


def test_failure_message() -> None:
    assert rank_failure_text({0: NOT_RUNNING, 1: NOT_RUNNING}, dp_size=2) == NOT_RUNNING
    assert rank_failure_text({1: "boom"}, dp_size=2) == "rank 1: boom"


def test_file_chunks_and_merge(tmp_path: Path) -> None:
    prof0, prof1 = Profiler(0, "cpu"), Profiler(1, "cpu")
    for prof in (prof0, prof1):
        assert prof.start(req(tmp_path, num_steps=1, dp_size=2))[0]
        step(prof)
    record = profiles.ProfileRecord("p1", "p1", str(tmp_path), True, 1 << 30)
    files = profiles.profile_files(record, str(tmp_path))
    assert [os.path.basename(f) for f in files] == [
        "p1-TP-0-DP-0.trace.json.gz", "p1-TP-0-DP-1.trace.json.gz"
    ]
    merged, note = profiles.merge_traces(record, files)
    assert note == "" and [os.path.basename(m) for m in merged] == ["p1-merged.trace.json.gz"]
    assert labels(merged[0]) == ["forward_extend_bs1", "forward_extend_bs1"]

    async def collect(path: str) -> list[pb.ProfileFileChunk]:
        return [c async for c in profiles.file_chunks(path, chunk_bytes=100)]

    chunks = asyncio.run(collect(files[0]))
    data = b"".join(c.data for c in chunks)
    assert data == Path(files[0]).read_bytes() and len(chunks) > 1
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    assert [c.offset for c in chunks] == [i * 100 for i in range(len(chunks))]


def _two_rank_profile(tmp_path: Path) -> tuple[profiles.ProfileRecord, list[str]]:
    for rank in (0, 1):
        prof = Profiler(rank, "cpu")
        assert prof.start(req(tmp_path, num_steps=1, dp_size=2))[0]
        step(prof)
    record = profiles.ProfileRecord("p1", "p1", str(tmp_path), True, 1 << 30)
    return record, profiles.profile_files(record, str(tmp_path))


def test_concurrent_merges_run_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record, files = _two_rank_profile(tmp_path)
    calls: list[int] = []
    real = profiles.merge_traces

    def counting(*args: Any) -> tuple[list[str], str]:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(profiles, "merge_traces", counting)

    async def many() -> list[tuple[list[str], str]]:
        return await asyncio.gather(*(profiles.merge_once(record, files) for _ in range(8)))

    results = asyncio.run(many())
    assert len(calls) == 1
    assert all(r == results[0] for r in results) and results[0][0]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    with gzip.open(results[0][0][0], "rt") as f:
        assert json.load(f)["traceEvents"]


def test_a_file_replaced_mid_download_is_served_whole(tmp_path: Path) -> None:
    """One descriptor per download: a rename over the file after the first chunk does not
    mix the two files."""
    path, other = tmp_path / "a.trace.json.gz", tmp_path / "b.tmp"
    old = os.urandom(1000)
    path.write_bytes(old)
    other.write_bytes(os.urandom(1500))

    async def collect() -> list[pb.ProfileFileChunk]:
        out = []
        async for chunk in profiles.file_chunks(str(path), chunk_bytes=100):
            if not out:
                os.replace(other, path)
            out.append(chunk)
        return out

    chunks = asyncio.run(collect())
    data = b"".join(c.data for c in chunks)
    assert data == old and chunks[-1].last
    assert chunks[-1].sha256 == hashlib.sha256(old).hexdigest()


def test_a_file_that_shrinks_mid_download_is_not_ok(tmp_path: Path) -> None:
    path = tmp_path / "a.trace.json.gz"
    path.write_bytes(os.urandom(1000))

    async def collect() -> None:
        async for _ in profiles.file_chunks(str(path), chunk_bytes=100):
            os.truncate(path, 150)

    with pytest.raises(ServiceError) as err:
        asyncio.run(collect())
    assert err.value.code == grpc.StatusCode.ABORTED
    assert "shrank while it was read (150 of 1000 bytes)" in err.value.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trace_and_memory_snapshot(tmp_path: Path) -> None:
    prof = Profiler(0, "cuda")
    ok, text = prof.start(req(tmp_path, activities=["CPU", "GPU", "MEM"], num_steps=1))
    assert ok and "left out" not in text
    prof.before_step("prefill")
    x = torch.randn(64, 64, device="cuda")
    with torch.profiler.record_function("forward_extend_bs1"):
        (x @ x).sum().item()
    files = prof.after_step("prefill").result()
    assert files == [
        str(tmp_path / "p1-TP-0.trace.json.gz"), str(tmp_path / "p1-TP-0-memory.pickle")
    ]
    assert labels(files[0]) == ["forward_extend_bs1"]
    assert os.path.getsize(files[1]) > 0


# ---------------------------------------------------------------- servicer aggregation


class FakeComm:
    """Just enough of Communicator for the profile RPCs: canned replies per rank."""

    def __init__(self, answers: dict[int, tuple[bool, str, Any]], late: tuple[int, ...] = ()):
        self.answers, self.late = answers, late
        self.dead_ranks: dict[int, str] = {}
        self.ready = asyncio.Event()
        self.ready.set()
        self.model_info = SimpleNamespace(device="cpu")
        self.timeouts: list[float] = []
        self.sent: list[Any] = []
        self.metrics = Metrics(ServerArgs(), lambda: "m", lambda: [])  # off, as by default

    def new_admin_id(self) -> str:
        return "rid"

    async def call_ranks(self, make: Any, timeout: float, rid: str = "rid") -> tuple[dict, dict]:
        from sglang_admin.messages import AdminReply

        msg = make(rid)
        self.sent.append(msg)
        self.timeouts.append(timeout)
        replies = {
            r: AdminReply("rid", r, ok, text, data) for r, (ok, text, data) in self.answers.items()
        }
        failures = {
            r: RankFailure("timeout", f"rank {r} did not answer within {timeout:.1f}s")
            for r in self.late
        }
        return replies, failures


class FakeContext:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining

    def invocation_metadata(self) -> list:
        return []


def servicer(tmp_path: Path, comm: FakeComm) -> Any:
    from sglang_admin.server.servicer import SglangSchedulerServicer

    return SglangSchedulerServicer(ServerArgs(profile_dir=str(tmp_path), dp_size=2), comm)


def test_servicer_deadline_and_rank_failures(tmp_path: Path) -> None:
    late = FakeComm({0: (True, "ok", None)}, late=(1,))
    with pytest.raises(ServiceError) as exc:
        asyncio.run(servicer(tmp_path, late).StartProfile(pb.StartProfileRequest(), FakeContext(7)))
    assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "rank 1 did not answer" in exc.value.message
    assert 6 < late.timeouts[0] <= 7  # the caller's deadline (less a margin) wins
    sent = late.sent[0]
    assert sent.output_dir == os.path.realpath(tmp_path) and sent.dp_size == 2
    assert sent.activities == ["CPU"] and sent.with_stack and sent.record_shapes

    files = [str(tmp_path / "x-TP-0-DP-0.trace.json.gz")]
    mixed = FakeComm({0: (True, "ok", ProfileStopResult(files, "x")),
                      1: (False, "boom", ProfileStopResult([], "x"))})
    resp = asyncio.run(
        servicer(tmp_path, mixed).StopProfile(pb.StopProfileRequest(), FakeContext(None))
    )
    assert not resp.success and resp.message == "rank 1: boom"
    assert list(resp.files) == files and list(resp.rank_results[0].files) == files
    assert mixed.timeouts == [600.0]
