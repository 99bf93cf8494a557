"""--tp-size 2 on GGUF weights kept quantized: each rank keeps its shard of the quantized
values (model/quant/shard.py) and the row-parallel outputs are summed over the ranks.

The two ranks run in two threads of this process, their all-reduce a sum through a barrier
(the product's gloo all-reduce is the integration tests' business): what is tested here is
the cut of the quantized values and which outputs are summed."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from sglang_admin.model.gguf import GgufError, resolve_model_path  # noqa: E402
from sglang_admin.model.loader import ModelLoadError  # noqa: E402
from sglang_admin.model.lora import read_adapter, served_config  # noqa: E402
from sglang_admin.model.quant.gguf_blocks import Int4Groups  # noqa: E402
from sglang_admin.model.quant.shard import shard_kept  # noqa: E402
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.model.tensor_parallel import TensorParallel  # noqa: E402
from sglang_admin.scheduler.tp.weights import full_tensor, local_part  # noqa: E402
from tests.gguf_models import write_gguf  # noqa: E402
from tests.unit.test_quant_lora import _logprobs, _write_adapter  # noqa: E402

RANKS = 2


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SGLANG_ADMIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class ThreadSum:
    """An all-reduce (sum, in place) among threads, the parts added in rank order."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(RANKS, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * RANKS

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> None:
        self.parts[rank] = tensor.clone()
        self.barrier.wait()
        total = self.parts[0] + self.parts[1]
        self.barrier.wait()
        tensor.copy_(total)


def _ranks(path: str, dtype: str, quantization: str = "gguf") -> list[ModelRunner]:
    hub = ThreadSum()
    runners = []
    for rank in range(RANKS):
        tp = TensorParallel(rank, RANKS, None, torch.device("cpu"))
        tp.all_reduce = lambda t, r=rank: hub.all_reduce(r, t)  # type: ignore[method-assign]
        runners.append(ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=512,
                                   max_running_requests=4, quantization=quantization,
                                   tensor_parallel=tp, lora_slots=(2, 8)))
    return runners


def _on_ranks(runners: list[ModelRunner], fn) -> list:  # noqa: ANN001 - a test helper
    """fn(runner) on every rank at once, one thread each; their results in rank order."""
    results: list = [None] * RANKS
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(runners[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_tp_shards_of_kept_weights_compute_what_one_rank_computes(
        tmp_path: Path, qtype: str) -> None:
    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", qtype=qtype, seed=12)))
    whole = ModelRunner(out, device="cpu", dtype="float32", max_total_tokens=512,
                        max_running_requests=4, quantization="gguf", lora_slots=(2, 8))
    ranks = _ranks(out, "float32")
    # each rank holds half of every split projection's quantized bytes
    per_rank = [r.model.quant.quantized_bytes() for r in ranks]
    head = whole.model.quant.find(whole.model.lm_head.weight).quantized_bytes()
    half = (whole.model.quant.quantized_bytes() - head) / 2 + head  # the head: replicated
    assert per_rank[0] == per_rank[1] and abs(per_rank[0] - half) <= 0.05 * half
    # GetWeightsByName at tp 2: each rank's shard dequantized, joined whole
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        parts = [local_part(r.model, r.model.tensor_parallel, name) for r in ranks]
        joined = full_tensor(ranks[0].model, ranks[0].model.tensor_parallel, name, parts)
        assert torch.equal(joined, whole.model.quant.dequantized(name)), name
    # a LoRA adapter on top: each rank its cut of A and B (model/lora.py), the base model
    # beside it in the batch
    adapter = _write_adapter(whole, tmp_path / "adapter", seed=2)
    for runner in (whole, *ranks):
        runner.lora.write(0, read_adapter(str(adapter), served_config(runner.model), 8))
    ids = list(range(7, 19))
    for decode in (True, False):
        want = _logprobs(whole, ids, [0, -1], decode)
        got = _on_ranks(ranks, lambda r, d=decode: _logprobs(r, ids, [0, -1], d))
        assert (got[0] - want).abs().max().item() < 1e-4, decode
        assert (got[1] - got[0]).abs().max().item() == 0, decode  # every rank the same
        assert (want[0] - want[1]).abs().max().item() > 0.1, decode
    # bfloat16: decode rows through the quantized kernels on each shard
    ranks16 = _ranks(out, "auto")
    whole16 = ModelRunner(out, device="cpu", dtype="auto", max_total_tokens=512,
                          max_running_requests=4, quantization="gguf")
    got = _on_ranks(ranks16, lambda r: _logprobs(r, ids, [-1], True))
    want = _logprobs(whole16, ids, [-1], True)
    assert (got[0] - want).abs().max().item() < 0.1


def test_tp_shards_quantized_at_load_compute_what_one_rank_computes(tmp_path: Path) -> None:
    """--torchao-config int4wo-32 at tp 2: each rank quantizes its shard (the cuts fall on
    whole groups, so the values are tp 1's), the row-parallel outputs summed."""
    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", qtype="F32", seed=13)))
    whole = ModelRunner(out, device="cpu", dtype="float32", max_total_tokens=512,
                        max_running_requests=4, quantization="int4wo-32")
    ranks = _ranks(out, "float32", "int4wo-32")
    assert all(r.model.quant.scheme == "int4wo-32" for r in ranks)
    ids = list(range(30, 40))
    want = _logprobs(whole, ids, [-1], True)
    got = _on_ranks(ranks, lambda r: _logprobs(r, ids, [-1], True))
    assert (got[0] - want).abs().max().item() < 1e-4


def test_a_row_parallel_cut_inside_a_group_is_refused(tmp_path: Path) -> None:
    tp = TensorParallel(1, 4, None, torch.device("cpu"))
    out = resolve_model_path(str(write_gguf(tmp_path / "m.gguf", qtype="Q4_0", seed=1)))
    # 64 inputs of o_proj are 2 groups of 32: 4 ranks would cut inside them
    with pytest.raises(ModelLoadError, match="inside its groups of 32"):
        ModelRunner(out, device="cpu", dtype="float32", max_total_tokens=256,
                    quantization="gguf", tensor_parallel=tp)
    q = np.zeros((4, 64), dtype=np.uint8)
    groups = Int4Groups(q, np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32))
    with pytest.raises(GgufError, match="tp-size 4"):
        shard_kept(groups, "model.layers.0.mlp.down_proj.weight", tp)
