"""Profiling end to end: StartProfile / StopProfile / DownloadProfile on a dp-size 2 server."""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ServerProc, greedy, run_generate, start_server

ALREADY_RUNNING = "Profiling is already in progress. Call /stop_profile first."
NOT_RUNNING = "Profiling is not in progress. Call /start_profile first."
TIMEOUT = 120
# profiles whose checks read neither Python stacks nor shapes ask for neither (both default
# on: stack tracing records every call on every rank and makes the export dearer); the
# concurrent-download test keeps them (a bigger merge: the race it guards had more room)
LEAN = dict(with_stack=False, record_shapes=False)


@pytest.fixture(scope="module")
def root(dp2_profiles: Path) -> Path:
    return dp2_profiles


@pytest.fixture(scope="module")
def srv(dp2_server: ServerProc) -> ServerProc:
    """The session's --dp-size 2 worker; the stub fixture leaves no profile running."""
    return dp2_server


@pytest.fixture
def stub(srv: ServerProc) -> Iterator:
    stub = srv.stub()
    yield stub
    stub.StopProfile(pb.StopProfileRequest(), timeout=TIMEOUT)  # leave every rank idle


def generate_on_both_ranks(stub, first: int, n: int = 4) -> None:
    """One greedy request per rank; `first` keeps prompts apart (no prefix-cache hits)."""
    for rank in (0, 1):
        prompt = [first + 10 * rank + i for i in range(6)]
        tokens, _ = run_generate(stub, greedy(prompt, n, data_parallel_rank=rank), timeout=60)
        assert len(tokens) == n


def wait_idle(stub, timeout: float = 60) -> None:
    """Until no rank reports a running profiler (a rank answers after its export)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        if all(s.profiler_state == "idle" for s in info.rank_states):
            return
        time.sleep(0.2)
    raise AssertionError("profilers still running")


def events(path: Path) -> list[str]:
    """The forward-step events of a gzipped Chrome trace."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    assert data["traceEvents"]
    return [e["name"] for e in data["traceEvents"] if e.get("name", "").startswith("forward_")]


def test_start_generate_stop_writes_a_trace_per_rank(stub, root: Path) -> None:
    start = stub.StartProfile(pb.StartProfileRequest(output_dir="run1", **LEAN), timeout=TIMEOUT)
    assert start.success, start.message
    assert start.profile_id
    assert "GPU activity left out" in start.message  # CPU-only test machine
    generate_on_both_ranks(stub, 40)
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=TIMEOUT)
    assert stop.success, stop.message
    assert stop.profile_id == start.profile_id
    out = (root / "run1").resolve()
    expected = [str(out / f"{start.profile_id}-TP-0-DP-{r}.trace.json.gz") for r in (0, 1)]
    assert list(stop.files) == expected
    assert [list(r.files) for r in stop.rank_results] == [[f] for f in expected]
    assert all(r.success for r in stop.rank_results)
    for path in expected:
        names = events(Path(path))
        assert any(n.startswith("forward_extend_bs") for n in names), names
        assert any(n.startswith("forward_decode_bs") for n in names), names


def test_error_strings(stub) -> None:
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=TIMEOUT)
    assert not stop.success and stop.message == NOT_RUNNING
    assert [r.message for r in stop.rank_results] == [NOT_RUNNING, NOT_RUNNING]
    assert stub.StartProfile(pb.StartProfileRequest(output_dir="errs", **LEAN),
                             timeout=TIMEOUT).success
    again = stub.StartProfile(pb.StartProfileRequest(output_dir="errs"), timeout=TIMEOUT)
    assert not again.success and again.message == ALREADY_RUNNING


def test_num_steps_stops_by_itself_and_download_matches(stub, root: Path) -> None:
    start = stub.StartProfile(
        pb.StartProfileRequest(output_dir="auto", num_steps=2, merge_profiles=False, **LEAN),
        timeout=TIMEOUT,
    )
    assert start.success, start.message
    generate_on_both_ranks(stub, 80, n=3)
    wait_idle(stub)  # no StopProfile: each rank stopped after 2 forward steps
    files = sorted((root / "auto").glob(f"{start.profile_id}-TP-0-DP-*.trace.json.gz"))
    assert len(files) == 2
    for path in files:
        assert len(events(path)) == 2
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=TIMEOUT)
    assert not stop.success and stop.message == NOT_RUNNING

    for profile_id in (start.profile_id, ""):  # by id, and the newest finished one
        got: dict[str, bytearray] = {}
        sums: dict[str, str] = {}
        for chunk in stub.DownloadProfile(
            pb.DownloadProfileRequest(profile_id=profile_id), timeout=TIMEOUT
        ):
            buf = got.setdefault(chunk.file_name, bytearray())
            assert chunk.offset == len(buf)
            buf.extend(chunk.data)
            if chunk.last:
                sums[chunk.file_name] = chunk.sha256
        assert sorted(got) == [p.name for p in files]
        for path in files:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            assert sums[path.name] == digest == hashlib.sha256(got[path.name]).hexdigest()

    with pytest.raises(grpc.RpcError) as exc:
        list(stub.DownloadProfile(pb.DownloadProfileRequest(profile_id="nope"), timeout=30))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_by_stage_traces(stub, root: Path) -> None:
    start = stub.StartProfile(
        pb.StartProfileRequest(output_dir="stages", num_steps=1, profile_by_stage=True,
                               **LEAN),
        timeout=TIMEOUT,
    )
    assert start.success, start.message
    generate_on_both_ranks(stub, 120, n=3)
    wait_idle(stub)
    files = sorted((root / "stages").glob(f"{start.profile_id}-*.trace.json.gz"))
    names = sorted(p.name for p in files)
    assert names == sorted(
        f"{start.profile_id}-TP-0-DP-{r}-{s}.trace.json.gz"
        for r in (0, 1) for s in ("EXTEND", "DECODE")
    )
    for path in files:
        kind = "extend" if path.name.endswith("EXTEND.trace.json.gz") else "decode"
        assert [n.split("_bs")[0] for n in events(path)] == [f"forward_{kind}"]


def test_output_dir_escapes_are_refused(stub, root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root.mkdir(parents=True, exist_ok=True)
    (root / "sneaky").symlink_to(outside, target_is_directory=True)
    before = sorted(p.name for p in root.iterdir())
    for bad in ("..", "../escaped", str(tmp_path / "abs"), "sneaky", "sneaky/sub"):
        with pytest.raises(grpc.RpcError) as exc:
            stub.StartProfile(pb.StartProfileRequest(output_dir=bad), timeout=TIMEOUT)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, bad
        assert str(root) in exc.value.details()
    assert sorted(p.name for p in root.iterdir()) == before
    assert not list(outside.iterdir())
    assert not (tmp_path / "abs").exists() and not (root.parent / "escaped").exists()


def test_invalid_arguments(stub) -> None:
    for request, word in (
        (pb.StartProfileRequest(activities=["CPU", "TPU"]), "TPU"),
        (pb.StartProfileRequest(num_steps=-1), "num_steps"),
        (pb.StartProfileRequest(start_step=-1), "start_step"),
    ):
        with pytest.raises(grpc.RpcError) as exc:
            stub.StartProfile(request, timeout=TIMEOUT)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert word in exc.value.details()


def test_merge_profiles_and_start_step(stub, root: Path) -> None:
    start = stub.StartProfile(
        pb.StartProfileRequest(output_dir="merge", merge_profiles=True, profile_prefix="m",
                               **LEAN),
        timeout=TIMEOUT,
    )
    assert start.success, start.message
    generate_on_both_ranks(stub, 160, n=2)
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=TIMEOUT)
    assert stop.success, stop.message
    merged = Path(stop.files[-1])
    assert merged.name == f"m-{start.profile_id}-merged.trace.json.gz"
    assert len(events(merged)) == sum(len(events(Path(f))) for f in stop.files[:-1])

    armed = stub.StartProfile(pb.StartProfileRequest(start_step=10**9, **LEAN), timeout=TIMEOUT)
    assert armed.success and "armed" in armed.message
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert [s.profiler_state for s in info.rank_states] == ["armed", "armed"]
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=TIMEOUT)
    assert stop.success and not stop.files and "before it started" in stop.message


def _download(target: str, profile_id: str) -> tuple[dict[str, bytes], dict[str, str]]:
    """Every file of one DownloadProfile call on its own channel: bytes and last sha256."""
    with grpc.insecure_channel(target) as ch:
        got: dict[str, bytearray] = {}
        sums: dict[str, str] = {}
        for chunk in pb_grpc.SglangSchedulerStub(ch).DownloadProfile(
            pb.DownloadProfileRequest(profile_id=profile_id), timeout=TIMEOUT
        ):
            buf = got.setdefault(chunk.file_name, bytearray())
            assert chunk.offset == len(buf)
            buf.extend(chunk.data)
            if chunk.last:
                sums[chunk.file_name] = chunk.sha256
    return {k: bytes(v) for k, v in got.items()}, sums


@pytest.mark.parametrize("attempt", range(3))
def test_concurrent_downloads_of_a_merged_profile(
    srv: ServerProc, stub, root: Path, attempt: int
) -> None:
    """8 downloads at once of a merged profile that nobody merged yet (it stopped by itself
    after num_steps): one merge, every answer OK, every file whole and matching its sha256
    (they used to race on one .tmp path: INTERNAL, or OK with a truncated file)."""
    start = stub.StartProfile(
        pb.StartProfileRequest(output_dir=f"concurrent{attempt}", num_steps=2,
                               merge_profiles=True),
        timeout=TIMEOUT,
    )
    assert start.success, start.message
    generate_on_both_ranks(stub, 200 + 20 * attempt, n=3)
    wait_idle(stub)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _download(srv.target, start.profile_id), range(8)))
    out = (root / f"concurrent{attempt}").resolve()
    names = sorted(answers[0][0])
    assert f"{start.profile_id}-merged.trace.json.gz" in names and len(names) == 3
    for got, sums in answers:
        assert sorted(got) == names
        for name, data in got.items():
            digest = hashlib.sha256(data).hexdigest()
            assert sums[name] == digest == hashlib.sha256((out / name).read_bytes()).hexdigest()
            assert json.loads(gzip.decompress(data))["traceEvents"]
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, Path]]:
    """A dp 1 worker of its own, --profile-max-steps 3: the late-imports test takes it first,
    right after READY (its late imports not done yet), then the step-cap test; (worker,
    its profile root)."""
    profiles = tmp_path_factory.mktemp("capped-profiles")
    srv = start_server(tmp_path_factory.mktemp("capped"), "--model-path", "toy",
                       "--profile-dir", str(profiles), "--profile-max-steps", "3")
    yield srv, profiles
    srv.stop()


def test_a_profile_started_before_the_late_imports_waits_off_the_loop(capped) -> None:
    """Right after READY a rank has not imported what torch.profiler needs yet
    (scheduler/late_imports.py): StartProfile is answered once it has, and meanwhile the
    loop serves (a request sent after it is answered before it) and health stays good.
    The first test of its worker."""
    srv, profiles = capped
    stub = srv.stub()
    start = stub.StartProfile.future(
        pb.StartProfileRequest(output_dir="early", activities=["CPU"]), timeout=120)
    time.sleep(0.2)  # the StartProfile reached the rank first
    assert not start.done()
    run_generate(stub, greedy([5, 6, 7], 4), timeout=60)
    assert not start.done()  # the loop answered the request while the start waited
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    assert start.result().success, start.result().message
    run_generate(stub, greedy([5, 6, 7], 2), timeout=60)  # 2 steps: under the cap of 3
    stopped = stub.StopProfile(pb.StopProfileRequest(), timeout=120)
    assert stopped.success, stopped.message
    assert list((profiles / "early").rglob("*.trace.json.gz"))


def test_a_profile_left_running_stops_at_its_step_cap(capped) -> None:
    """A profile nobody stops (issue 17, finding 5: it grew each rank without end) stops by
    itself after --profile-max-steps forward steps; its trace is kept, the rank goes on
    serving, and the next StopProfile says why it ended."""
    server, _ = capped
    stub = server.stub()
    start = stub.StartProfile(pb.StartProfileRequest(**LEAN), timeout=TIMEOUT)
    assert start.success, start.message
    for i in range(4):  # more forward steps than the cap
        tokens, _ = run_generate(stub, greedy([40 + i, 41, 42], 3), timeout=60)
        assert len(tokens) == 3
    wait_idle(stub)
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=TIMEOUT)
    assert stop.success, stop.message
    assert "cap of 3 forward steps" in stop.message and "--profile-max-steps" in stop.message
    assert len(stop.files) == 1 and Path(stop.files[0]).stat().st_size > 0
    assert len(events(Path(stop.files[0]))) == 3
    assert stub.StopProfile(pb.StopProfileRequest(), timeout=TIMEOUT).message == NOT_RUNNING
