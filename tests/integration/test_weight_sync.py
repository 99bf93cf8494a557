"""Weights pushed by a trainer process, end to end, to a dp 2 worker on gloo: SGLang's own
helper pattern, our WeightPusher, shared memory; destroy and re-init; a trainer killed
mid-broadcast; bad input.

The trainer (tests/integration/sglang_trainer.py) is a real process holding a transformers
Qwen2 model changed by a few optimizer steps; after each push it saves the model, and the
worker's greedy outputs must equal transformers' on that saved model token for token.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ROOT, ServerProc, free_port, greedy, run_generate, start_server
from tests.integration.test_grpcurl import GRPCURL, parse_json_stream
from tests.integration.test_refit import build_qwen2, hf_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHECK_TOKENS = 8
PROMPTS = [[5, 9, 33, 70], [100, 3, 4, 200, 17, 8], [250, 251, 12], [40, 41, 42, 43, 44, 45, 46]]
TRAINER = [sys.executable, "-m", "tests.integration.sglang_trainer"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen2(tmp_path_factory.mktemp("sync-ckpt") / "A", seed=5)


@pytest.fixture(scope="module")
def worker(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("sync-dp2"), "--model-path", str(ckpt),
                       "--dp-size", "2", "--dtype", "float32")
    yield srv
    srv.stop()


def worker_outputs(stub: pb_grpc.SglangSchedulerStub) -> list[list[int]]:
    return [run_generate(stub, greedy(p, CHECK_TOKENS), timeout=120)[0] for p in PROMPTS]


@functools.cache
def reference(path: Path) -> list[list[int]]:
    """transformers' greedy outputs of the checkpoint at ``path`` (each computed once)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_greedy(model, p, CHECK_TOKENS) for p in PROMPTS]


def version(stub: pb_grpc.SglangSchedulerStub) -> str:
    return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).weight_version


class Trainer:
    """The trainer subprocess; ``expect(line)`` reads its stdout up to that line."""

    def __init__(self, mode: str, worker: ServerProc, ckpt: Path, out: Path) -> None:
        self.out = out
        self.log = out / f"trainer-{mode}.log"
        with open(self.log, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [*TRAINER, mode, worker.target, str(ckpt), str(out), str(free_port()),
                 str(free_port()), str(free_port())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            )

    def expect(self, line: str) -> None:
        assert self.proc.stdout is not None
        while True:
            got = self.proc.stdout.readline()
            if not got:
                self.proc.wait(60)
                raise AssertionError(f"trainer ended before {line!r}:\n{self.log.read_text()[-4000:]}")
            if got.strip() == line:
                return

    def next(self, word: str = "next") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{word}\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)


@pytest.fixture(scope="module")
def handed_over() -> Iterator[list[Trainer]]:
    """The first test's trainer, once its pushes are done, for the killed-trainer test (one
    trainer process, torch and transformers imported once, for both)."""
    trainers: list[Trainer] = []
    yield trainers
    for trainer in trainers:
        trainer.close()


def test_trainer_pushes_through_sglang_helper_our_helper_and_shared_memory(
    worker: ServerProc, ckpt: Path, tmp_path: Path, handed_over: list[Trainer]
) -> None:
    stub = worker.stub()
    before = worker_outputs(stub)
    assert before == reference(ckpt)
    trainer = Trainer("sglang-then-die", worker, ckpt, tmp_path)
    try:
        # 1. SGLang's init_custom_process_group + one broadcast per parameter.
        trainer.expect("pushed sglang")
        expected = reference(tmp_path / "sglang")
        assert expected != before  # the optimizer steps changed what greedy decoding says
        assert worker_outputs(stub) == expected
        assert version(stub) == "sglang-1"
        # The group exists on every rank: a second Init with its name is refused clearly.
        with pytest.raises(grpc.RpcError) as err:
            stub.InitWeightsUpdateGroup(pb.InitWeightsUpdateGroupRequest(
                master_address="127.0.0.1", master_port=free_port(), rank_offset=1,
                world_size=3, group_name="sglang-group"), timeout=30)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'sglang-group' already exists" in err.value.details()

        # 2. Destroy, then a new group joined and pushed through our WeightPusher (buckets).
        trainer.next()
        trainer.expect("pushed helper")
        assert worker_outputs(stub) == reference(tmp_path / "helper")
        assert version(stub) == "helper-2"

        # 3. The same host: tensors handed over in shared memory.
        trainer.next()
        trainer.expect("pushed shm")
        assert worker_outputs(stub) == reference(tmp_path / "shm")
        assert version(stub) == "shm-3"
        trainer.expect("done")  # its helper's group destroyed without an error
        assert trainer.proc.poll() is None
        handed_over.append(trainer)
    finally:
        if trainer not in handed_over:
            trainer.close()
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).healthy


def test_trainer_killed_mid_broadcast(worker: ServerProc, ckpt: Path, tmp_path: Path,
                                      handed_over: list[Trainer]) -> None:
    """A trainer killed mid-broadcast (the first test's, still running, or one of its own)."""
    stub = worker.stub()
    if handed_over:
        trainer = handed_over.pop()
        trainer.next("die")
    else:
        trainer = Trainer("die", worker, ckpt, tmp_path)
    late: dict[str, grpc.RpcError] = {}

    def generate_during_receive() -> None:
        try:
            run_generate(stub, greedy(PROMPTS[1], 2), timeout=120)
        except grpc.RpcError as exc:
            late["error"] = exc

    waiter = threading.Thread(target=generate_during_receive, daemon=True)
    try:
        trainer.expect("half")
        # Mid-broadcast the ranks block on a worker thread, not in their loops: health and
        # state still answer, and a new request waits behind the update.
        health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=30)
        assert health.healthy, health.message
        states = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).rank_states
        assert len(states) == 2
        # Nothing else writes (or frees) the parameters while the broadcast does.
        busy = "weights are being received from group 'die-group'"
        disk = stub.UpdateWeightsFromDisk(
            pb.UpdateWeightsFromDiskRequest(model_path=str(ckpt)), timeout=60)
        assert not disk.success and busy in disk.message
        freed = stub.ReleaseMemoryOccupation(
            pb.ReleaseMemoryOccupationRequest(tags=["weights"]), timeout=60)
        assert not freed.success and busy in freed.message
        waiter.start()
        trainer.next()
        trainer.expect("dying")
        assert trainer.proc.wait(60) == -9
    finally:
        trainer.close()
    # The update fails on every rank (the broadcast breaks), well within its deadline: the
    # worker stays up and refuses Generate, saying why and what restores serving.
    deadline_s = 60.0
    refused = None
    for _ in range(int(deadline_s / 0.5)):
        try:
            run_generate(stub, greedy(PROMPTS[0], 2), timeout=30)
        except grpc.RpcError as exc:
            refused = exc
            break
        threading.Event().wait(0.5)
    assert refused is not None, "Generate still served from partially updated weights"
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "partially updated" in refused.details() or "not valid" in refused.details()
    assert "UpdateWeightsFromDisk" in refused.details()
    waiter.join(120)
    assert late["error"].code() == grpc.StatusCode.FAILED_PRECONDITION  # never served
    health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=30)
    assert health.healthy, health.message  # every rank answers: none hangs
    # The broken group can be destroyed; a reload from disk restores serving.
    done = cli("destroy-group", "--group-name", "die-group", "--target", worker.target)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "group 'die-group' destroyed" in done.stdout
    resp = stub.UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(ckpt), weight_version="restored"),
        timeout=300)
    assert resp.success, resp.message
    assert worker_outputs(stub) == reference(ckpt)
    assert version(stub) == "restored"


# ---------------------------------------------------------------- bad input


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sglang_admin", *args], capture_output=True,
                          text=True, timeout=90, cwd=ROOT)


def code_and_details(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def init_req(**kw: object) -> pb.InitWeightsUpdateGroupRequest:
    fields = dict(master_address="127.0.0.1", master_port=free_port(), rank_offset=1,
                  world_size=3, group_name="bad", backend="gloo")
    fields.update(kw)
    return pb.InitWeightsUpdateGroupRequest(**fields)


def dist_req(names: list[str], dtypes: list[str], shapes: list[list[int]],
             group: str = "nope") -> pb.UpdateWeightsFromDistributedRequest:
    return pb.UpdateWeightsFromDistributedRequest(
        names=names, dtypes=dtypes, shapes=[pb.TensorShape(dims=s) for s in shapes],
        group_name=group)


NORM = "model.norm.weight"  # hidden 64


@pytest.mark.parametrize("request_, code, words", [
    (init_req(world_size=2), "INVALID_ARGUMENT", "world_size 2 cannot hold"),
    (init_req(rank_offset=0), "INVALID_ARGUMENT", "rank 0 is the trainer"),
    (init_req(master_port=0), "INVALID_ARGUMENT", "master_port"),
    (init_req(group_name=""), "INVALID_ARGUMENT", "group_name"),
    (init_req(backend="nccl"), "INVALID_ARGUMENT", "does not match this worker's device cpu"),
    (init_req(backend="mpi"), "INVALID_ARGUMENT", "backend 'mpi'"),
])
def test_bad_init(worker: ServerProc, request_: pb.InitWeightsUpdateGroupRequest, code: str,
                  words: str) -> None:
    got, details = code_and_details(
        lambda: worker.stub().InitWeightsUpdateGroup(request_, timeout=30))
    assert got == getattr(grpc.StatusCode, code), details
    assert words in details


@pytest.mark.parametrize("request_, code, words", [
    (dist_req(["model.layers.0.mlp.nope.weight"], ["float32"], [[4]]), "INVALID_ARGUMENT",
     "'model.layers.0.mlp.nope.weight' is not a parameter of this model"),
    (dist_req([NORM], ["float32"], [[65]]), "INVALID_ARGUMENT", "has shape [65], the model's is [64]"),
    (dist_req([NORM], ["int8"], [[64]]), "INVALID_ARGUMENT", "dtype 'int8'"),
    (dist_req([NORM, NORM], ["float32"] * 2, [[64]] * 2), "INVALID_ARGUMENT", "listed twice"),
    (dist_req([NORM], [], [[64]]), "INVALID_ARGUMENT", "one entry per tensor"),
    (dist_req([], [], []), "INVALID_ARGUMENT", "at least one tensor"),
    (dist_req([NORM], ["float32"], [[64]], group="nope"), "NOT_FOUND",
     "no weight update group named 'nope'"),
])
def test_bad_update_from_distributed(
    worker: ServerProc, request_: pb.UpdateWeightsFromDistributedRequest, code: str, words: str
) -> None:
    got, details = code_and_details(
        lambda: worker.stub().UpdateWeightsFromDistributed(request_, timeout=30))
    assert got == getattr(grpc.StatusCode, code), details
    assert words in details


def test_destroy_unknown_group(worker: ServerProc) -> None:
    got, details = code_and_details(lambda: worker.stub().DestroyWeightsUpdateGroup(
        pb.DestroyWeightsUpdateGroupRequest(group_name="never"), timeout=30))
    assert got == grpc.StatusCode.NOT_FOUND
    assert "no weight update group named 'never'" in details
    done = cli("destroy-group", "--group-name", "never", "--target", worker.target)
    assert done.returncode != 0
    assert "NOT_FOUND" in done.stdout + done.stderr


@pytest.fixture
def segment() -> Iterator[shared_memory.SharedMemory]:
    shm = shared_memory.SharedMemory(create=True, size=4096)
    yield shm
    shm.close()
    shm.unlink()


def test_bad_update_from_tensor(worker: ServerProc, segment: shared_memory.SharedMemory) -> None:
    stub = worker.stub()

    def call(shm_name: str, *tensors: pb.SharedTensor) -> Callable[[], object]:
        return lambda: stub.UpdateWeightsFromTensor(
            pb.UpdateWeightsFromTensorRequest(shm_name=shm_name, tensors=tensors), timeout=30)

    norm = pb.SharedTensor(name=NORM, dtype="float32", shape=[64], offset=0)
    cases = [
        (call("../etc/passwd", norm), "is not a shared-memory segment name"),
        (call("sglang-admin-no-such-segment", norm), "cannot be opened"),
        (call(segment.name, pb.SharedTensor(name=NORM, dtype="float32", shape=[64],
                                            offset=4000)), "lies outside segment"),
        (call(segment.name, pb.SharedTensor(name=NORM, dtype="float32", shape=[64],
                                            offset=2)), "not a multiple of its element size"),
        (call(segment.name, pb.SharedTensor(name="lm_head.bias", dtype="float32", shape=[4],
                                            offset=0)), "not a parameter of this model"),
        (call(segment.name, pb.SharedTensor(name=NORM, dtype="float32", shape=[8, 8],
                                            offset=0)), "the model's is [64]"),
        (call(segment.name, pb.SharedTensor(name=NORM, dtype="float32", shape=[64],
                                            offset=-8)), "offsets must not be negative"),
        (call("", norm), "shm_name"),
    ]
    for fn, words in cases:
        got, details = code_and_details(fn)
        assert got == grpc.StatusCode.INVALID_ARGUMENT, (words, details)
        assert words in details
    # ... and the worker keeps serving.
    assert len(run_generate(stub, greedy([5, 6, 7], 3), timeout=60)[0]) == 3


def test_init_fails_by_its_deadline_naming_who_did_not_join(worker: ServerProc) -> None:
    stub = worker.stub()
    # Nobody listens on the port: every rank gives up before the call's deadline (5 s: the
    # ranks wait 4 s for nobody and keep the same 1 s to answer as with a longer one).
    resp = stub.InitWeightsUpdateGroup(init_req(group_name="lonely"), timeout=5)
    assert not resp.success
    assert "nothing listens at tcp://127.0.0.1:" in resp.message
    assert "rank 0 (the trainer" in resp.message
    assert {r.dp_rank for r in resp.rank_results if not r.success} == {0, 1}
    # A trainer that hosts the store, but a world_size that does not add up (4 with a dp 2
    # worker): the ranks name the one that never came (3) as well as the stuck trainer.
    from tests.integration.sglang_trainer import init_custom_process_group

    port = free_port()

    def host() -> None:
        try:
            init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                      timeout=timedelta(seconds=5), world_size=4, rank=0,
                                      group_name="short")
        except Exception:  # noqa: BLE001 - it times out waiting for rank 3, as expected
            pass

    t = threading.Thread(target=host, daemon=True)
    t.start()
    resp = stub.InitWeightsUpdateGroup(init_req(master_port=port, world_size=4,
                                                group_name="short"), timeout=5)
    t.join(30)
    assert not resp.success
    assert "ranks that did not join: 0, 3" in resp.message
    # Neither failed join left a group behind, and the worker still serves.
    for name in ("lonely", "short"):
        got, _ = code_and_details(lambda n=name: stub.DestroyWeightsUpdateGroup(
            pb.DestroyWeightsUpdateGroupRequest(group_name=n), timeout=30))
        assert got == grpc.StatusCode.NOT_FOUND
    assert len(run_generate(stub, greedy([5, 6, 7], 3), timeout=60)[0]) == 3


# ---------------------------------------------------------------- grpcurl (runs last: it
# pushes a parameter, the same values it reads)


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not found")
def test_grpcurl_update_weights_from_tensor_and_destroy(worker: ServerProc) -> None:
    stub = worker.stub()
    norm = stub.GetWeightsByName(pb.GetWeightsByNameRequest(name=NORM, truncate_size=64),
                                 timeout=30)
    values = torch.tensor(list(norm.values), dtype=torch.float32)
    shm = shared_memory.SharedMemory(create=True, size=values.numel() * 4)
    try:
        torch.frombuffer(shm.buf, dtype=torch.float32).copy_(values)
        manifest = {"shm_name": shm.name, "weight_version": "grpcurl",
                    "tensors": [{"name": NORM, "dtype": "float32", "shape": [64], "offset": 0}]}
        done = grpcurl(worker, "UpdateWeightsFromTensor", manifest)
        assert done.returncode == 0, done.stderr
        (msg,) = parse_json_stream(done.stdout)
        assert msg.get("success"), msg
        assert msg.get("weightVersion", msg.get("weight_version")) == "grpcurl", msg
    finally:
        shm.close()
        shm.unlink()
    after = stub.GetWeightsByName(pb.GetWeightsByNameRequest(name=NORM, truncate_size=64),
                                  timeout=30)
    assert list(after.values) == list(norm.values)
    done = grpcurl(worker, "DestroyWeightsUpdateGroup", {"group_name": "never"})
    assert done.returncode != 0
    assert "NotFound" in done.stderr and "'never'" in done.stderr


def grpcurl(srv: ServerProc, method: str, data: object) -> subprocess.CompletedProcess[str]:
    assert GRPCURL is not None
    cmd = [GRPCURL, "-plaintext", "-max-time", "60", "-d", json.dumps(data), srv.target,
           f"sglang.grpc.scheduler.SglangScheduler/{method}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)
