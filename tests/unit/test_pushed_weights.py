"""Weights a trainer pushes, rank side and trainer side, without a server: the manifest
checks, shared-memory round trips, buckets, and a real two-process gloo broadcast."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_admin.model.dist_group import GroupJoinError, join_group
from sglang_admin.model.pushed_weights import (
    FLATTENED_BUCKET,
    ManifestError,
    check_manifest,
    load_from_segment,
    receive_weights,
)
from sglang_admin.model.runner import ModelRunner
from sglang_admin.model.weight_push import (
    broadcast_bucket,
    buckets,
    join_as_trainer,
    write_shared,
)
from sglang_admin.model.weights import weights_digest
from tests.conftest import free_port

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    """A served checkpoint, and a transformers model of the same shapes, other weights."""
    root = tmp_path_factory.mktemp("push")
    torch.manual_seed(1)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)).save_pretrained(
        str(root / "a"), safe_serialization=True)
    torch.manual_seed(2)
    other = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)).eval()
    other.save_pretrained(str(root / "b"), safe_serialization=True)
    return str(root / "a"), other


def _runner(path: str) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=256,
                       max_running_requests=4)


def test_manifest_checks_name_the_first_problem(hf_pair: tuple[str, object]) -> None:
    model = _runner(hf_pair[0]).model
    norm = "model.norm.weight"
    cases = [
        (["x.weight"], ["float32"], [[1]], "'x.weight' is not a parameter of this model"),
        ([norm], ["float32"], [[63]], "has shape [63], the model's is [64]"),
        ([norm], ["int32"], [[64]], "dtype 'int32' is not supported"),
        ([norm, norm], ["float32"] * 2, [[64]] * 2, "listed twice"),
        ([norm], ["float32"], [], "one entry per tensor"),
    ]
    for names, dtypes, shapes, words in cases:
        with pytest.raises(ManifestError) as err:
            check_manifest(model, names, dtypes, shapes)
        assert words in str(err.value)
    with pytest.raises(ManifestError, match="one dtype"):
        check_manifest(model, [norm, "model.layers.0.input_layernorm.weight"],
                       ["float32", "bfloat16"], [[64], [64]], FLATTENED_BUCKET)
    # A tied model accepts (and drops) lm_head.weight, as it does from a checkpoint.
    specs = check_manifest(model, ["lm_head.weight", norm], ["torch.float32", "bfloat16"],
                           [[96, 64], [64]])
    assert specs[0].target is None and specs[1].target is dict(model.named_parameters())[norm]


def test_shared_memory_round_trip_loads_every_parameter(hf_pair: tuple[str, Any],
                                                        tmp_path: Path) -> None:
    served, other = hf_pair
    runner = _runner(served)
    target = _runner(str(Path(served).parent / "b"))
    assert weights_digest(runner.model) != weights_digest(target.model)
    bucket = buckets(other.named_parameters(), 1 << 40)
    assert len(bucket) == 1
    shm, offsets = write_shared(bucket[0])
    try:
        specs = check_manifest(runner.model, bucket[0].names, bucket[0].dtype_names,
                               bucket[0].shapes)
        loaded = load_from_segment(runner.model, shm.name, specs, offsets)
        assert loaded == bucket[0].nbytes
        with pytest.raises(ManifestError, match="lies outside"):
            load_from_segment(runner.model, shm.name, specs[-1:], [shm.size])
    finally:
        shm.close()
        shm.unlink()
    assert weights_digest(runner.model) == weights_digest(target.model)


def test_buckets_keep_order_dtype_and_size() -> None:
    tensors = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(4, dtype=torch.bfloat16)),
               ("d", torch.zeros(30)), ("e", torch.zeros(1))]
    got = [(b.names, b.nbytes) for b in buckets(tensors, bucket_bytes=80)]
    assert got == [(["a", "b"], 80), (["c"], 8), (["d"], 120), (["e"], 4)]


def _receiver(port: int, served: str, out: mp.Queue) -> None:
    runner = _runner(served)
    group = join_group("127.0.0.1", port, 1, 2, "unit", "gloo", 60)
    names = [n for n, _ in runner.model.named_parameters()]
    params = dict(runner.model.named_parameters())
    specs = check_manifest(runner.model, names, ["float32"] * len(names),
                           [list(params[n].shape) for n in names])
    receive_weights(group, specs[:3], "", 60)  # one broadcast per tensor
    receive_weights(group, specs[3:], FLATTENED_BUCKET, 60)  # one flattened bucket
    out.put(weights_digest(runner.model))
    group.destroy()


def test_gloo_broadcast_per_tensor_and_flattened(hf_pair: tuple[str, Any]) -> None:
    served, other = hf_pair
    expected = _runner(str(Path(served).parent / "b"))
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, served, out))
    proc.start()
    try:
        group = join_as_trainer("127.0.0.1", port, 2, "unit", "gloo", 60)
        # the receiver's parameter order is ours; the trainer sends in that order
        params = dict(other.named_parameters())
        order = [n for n, _ in expected.model.named_parameters()]
        first = buckets([(n, params[n]) for n in order[:3]], 1)
        for b in first:
            broadcast_bucket(group, b, 60)
        broadcast_bucket(group, buckets([(n, params[n]) for n in order[3:]], 1 << 40)[0], 60)
        assert out.get(timeout=120) == weights_digest(expected.model)
        group.destroy()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def test_join_names_a_trainer_that_is_not_there() -> None:
    with pytest.raises(GroupJoinError, match="nothing listens at tcp://127.0.0.1:"):
        join_group("127.0.0.1", free_port(), 1, 2, "alone", "gloo", 1)


def test_the_client_package_needs_torch_only_when_the_trainer_helper_runs() -> None:
    import subprocess
    import sys

    code = ("import sys\nimport sglang_admin.client, sglang_admin.client.trainer\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
