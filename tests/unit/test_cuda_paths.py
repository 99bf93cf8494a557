"""The CUDA path's decisions, checked on the CPU: which GPU a rank takes, how large its KV
pool is, when a received broadcast counts as arrived, and which backend a trainer joins."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from sglang_admin.cli import build_parser
from sglang_admin.client.trainer import WeightPushError, workers_backend
from sglang_admin.config import ServerArgs
from sglang_admin.model import device as device_mod
from sglang_admin.model.device import kv_token_capacity, resolve_device
from sglang_admin.model.dist_group import WeightGroup, concrete_device, wait_received
from sglang_admin.model.loader import ModelLoadError
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.scheduler.ops.weight_groups import WeightGroups

GiB = 1 << 30


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sees four CUDA devices (nothing is allocated on them by these tests)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


# ------------------------------------------------------------------ device per rank


def test_each_rank_takes_its_own_gpu_as_sglang_assigns_them() -> None:
    args = ServerArgs(dp_size=2)
    assert [args.gpu_index(r) for r in range(2)] == [0, 1]
    args = ServerArgs(dp_size=3, base_gpu_id=1, gpu_id_step=2)
    assert [args.gpu_index(r) for r in range(3)] == [1, 3, 5]


def test_auto_and_bare_cuda_resolve_to_the_ranks_gpu(four_gpus: None) -> None:
    assert resolve_device("auto", 2) == torch.device("cuda", 2)
    assert resolve_device("cuda", 3) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", 3) == torch.device("cuda", 1)  # an explicit index stands
    assert resolve_device("cpu", 3) == torch.device("cpu")


def test_a_gpu_past_the_visible_ones_is_refused_with_the_flags_to_check(four_gpus: None) -> None:
    with pytest.raises(ModelLoadError, match="cuda:5 but only 4 CUDA device.*--base-gpu-id"):
        resolve_device("auto", 5)


def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 3) == torch.device("cpu")
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        resolve_device("cuda", 0)


def test_the_gpu_flags_parse_and_bad_values_exit_with_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    ns = build_parser().parse_args(
        ["serve", "--base-gpu-id", "2", "--gpu-id-step", "2", "--mem-fraction-static", "0.5"])
    assert (ns.base_gpu_id, ns.gpu_id_step, ns.mem_fraction_static) == (2, 2, 0.5)
    for bad in (["--mem-fraction-static", "0"], ["--mem-fraction-static", "1.5"],
                ["--gpu-id-step", "0"], ["--base-gpu-id", "-1"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["serve", *bad])
        assert exc.value.code == 2
        assert bad[0] in capsys.readouterr().err


# ------------------------------------------------------------------ KV pool size


def test_a_large_gpu_gets_the_pool_its_requests_can_use_not_its_whole_memory() -> None:
    # The default model on an H200: 85% of free memory would be ~120M slots.
    per_token = 4 * 2 * 4 * 64 * 2  # layers x (K, V) x kv heads x head dim x bf16
    cap = 64 * 2048  # --max-running-requests x context length
    tokens = kv_token_capacity(per_token, free_bytes=139 * GiB, total_bytes=140 * GiB,
                               mem_fraction_static=0.85, max_useful_tokens=cap)
    assert tokens == cap


def test_the_pool_takes_what_the_fraction_leaves_after_the_weights() -> None:
    per_token = 1 << 20
    # 80 GiB card, 30 GiB already used by weights: 0.5 * 80 - 30 - 1 (reserve) = 9 GiB.
    tokens = kv_token_capacity(per_token, free_bytes=50 * GiB, total_bytes=80 * GiB,
                               mem_fraction_static=0.5, max_useful_tokens=10**9)
    assert tokens == 9 * 1024


def test_no_room_for_a_pool_names_the_flag() -> None:
    with pytest.raises(ModelLoadError, match="--mem-fraction-static 0.3"):
        kv_token_capacity(1 << 20, free_bytes=10 * GiB, total_bytes=80 * GiB,
                          mem_fraction_static=0.3, max_useful_tokens=10**9)


def test_the_cpu_default_is_unchanged() -> None:
    per_token = 4 * 2 * 4 * 64 * 4
    assert device_mod.default_token_capacity(
        torch.device("cpu"), per_token, mem_fraction_static=0.85, max_useful_tokens=10
    ) == min(device_mod.CPU_MAX_TOKENS, device_mod.CPU_KV_BUDGET_BYTES // per_token)


# ------------------------------------------------------------------ receiving a broadcast


class NcclLikeWork:
    """A collective as NCCL reports it: ``wait()`` returns at once (it only makes the
    stream wait); ``is_completed()`` turns true when the data has arrived."""

    def __init__(self, arrives_after_s: float | None) -> None:
        self.arrived = threading.Event()
        if arrives_after_s is not None:
            threading.Timer(arrives_after_s, self.arrived.set).start()

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.arrived.is_set()


def test_a_receive_returns_only_once_the_data_has_arrived() -> None:
    work = NcclLikeWork(arrives_after_s=0.3)
    t0 = time.monotonic()
    wait_received(work, torch.device("cpu"), timeout_s=5)  # type: ignore[arg-type]
    assert work.arrived.is_set()
    assert time.monotonic() - t0 >= 0.25


def test_a_receive_that_never_arrives_fails_at_its_deadline() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not arrive within 0.3s"):
        wait_received(NcclLikeWork(arrives_after_s=None), torch.device("cpu"),  # type: ignore[arg-type]
                      timeout_s=0.3)
    assert 0.25 <= time.monotonic() - t0 < 2


def test_a_bare_cuda_device_is_the_current_one(four_gpus: None) -> None:
    # torch.device("cuda") != torch.device("cuda:0"): a receive buffer compared against the
    # bare name was allocated again on every push.
    assert concrete_device("cuda") == torch.device("cuda", 0)
    assert concrete_device("cuda:2") == torch.device("cuda", 2)
    assert concrete_device("cpu") == torch.device("cpu")


def test_memory_release_drops_the_receive_buffers() -> None:
    group = WeightGroup("g", None, 1, 2, "gloo", "tcp://x:1", None)  # type: ignore[arg-type]
    buf = group.scratch(16, torch.float32)
    assert group.scratch(8, torch.float32).data_ptr() == buf.data_ptr()  # kept between pushes
    sync = WeightGroups()
    try:
        sync.groups["g"] = group
        sync.drop_buffers()
        assert group._scratch is None
    finally:
        sync.groups.clear()
        sync.close()


# ------------------------------------------------------------------ the trainer's backend


def _info(*devices: str) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse(rank_states=[pb.RankState(dp_rank=i, device=d)
                                                 for i, d in enumerate(devices)])


def test_the_trainer_joins_with_nccl_when_the_workers_are_on_cuda() -> None:
    assert workers_backend([_info("cuda:0", "cuda:1"), _info("cuda:0")]) == "nccl"
    assert workers_backend([_info("cpu", "cpu")]) == "gloo"
    with pytest.raises(WeightPushError, match="cpu, cuda"):
        workers_backend([_info("cuda:0"), _info("cpu")])


# ------------------------------------------------------------------ joining a group


def _join_capturing(monkeypatch: pytest.MonkeyPatch, backend: str, device: str | None,
                    fail: bool = False) -> dict:
    """join_group as rank 0 of 1 with the process-group constructor replaced: what it got."""
    from sglang_admin.model import dist_group

    seen: dict = {}

    def helper(*args: object, **kwargs: object) -> tuple[object, None]:
        seen.update(kwargs)
        if fail:
            raise RuntimeError("ncclInternalError: no peers")
        return object(), None

    monkeypatch.setattr(dist_group, "_new_process_group_helper", helper)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = dist_group.join_group("127.0.0.1", port, 0, 1, f"g{port}", backend, 10, device)
    dist_group._world.pg_group_ranks.pop(group.pg, None)
    seen["group_device"] = group.device
    return seen


def test_an_nccl_group_forms_its_communicator_on_the_ranks_gpu_when_joined(
        four_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _join_capturing(monkeypatch, "nccl", "cuda:2")
    assert seen["device_id"] == torch.device("cuda", 2)  # eager: the handshake happens now
    assert seen["group_device"] == torch.device("cuda", 2)


def test_a_gloo_group_takes_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _join_capturing(monkeypatch, "gloo", None)
    assert seen["device_id"] is None and seen["group_device"] == torch.device("cpu")


def test_a_failed_nccl_handshake_says_so_without_reading_gloos_store(
        four_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_admin.model.dist_group import GroupJoinError

    with pytest.raises(GroupJoinError, match="NCCL communicator did not form.*ncclInternalError"):
        _join_capturing(monkeypatch, "nccl", "cuda:0", fail=True)
