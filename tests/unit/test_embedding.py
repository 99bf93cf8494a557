"""Embedding models at the rank: what a checkpoint serves (model/embedding_spec.py), pooling
across prefill chunks (model/pooling.py) and an embed request's life in the scheduler."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sglang_admin.messages import GenerateReq, SamplingParams
from sglang_admin.model.embedding_spec import (
    EmbeddingSpec,
    PoolingType,
    SpecError,
    causal_architecture,
    embedding_spec,
)
from sglang_admin.model.pooling import pool
from sglang_admin.model.step_io import SeqOutput
from sglang_admin.scheduler.embedding import EmbedProgress, reusable_prefix
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig


def _st_files(path: Path, modes: dict[str, bool], normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(modes))


def test_what_a_checkpoint_serves(tmp_path: Path) -> None:
    assert embedding_spec(str(tmp_path), {"architectures": ["Qwen3ForCausalLM"]}, False) \
        == EmbeddingSpec()
    flag = embedding_spec(str(tmp_path), {"architectures": ["Qwen3ForCausalLM"]}, True)
    assert (flag.kind, flag.pooling, flag.normalize, flag.has_lm_head) == (
        "embedding", PoolingType.LAST, True, True)
    base = embedding_spec(str(tmp_path), {"architectures": ["MistralModel"]}, False)
    assert base.kind == "embedding" and base.unprefixed and not base.has_lm_head
    cls = embedding_spec(str(tmp_path), {"architectures": ["LlamaForSequenceClassification"],
                                         "id2label": {"0": "bad", "1": "good"}}, False)
    assert (cls.kind, cls.num_labels, cls.id2label, cls.normalize) == (
        "classification", 2, {"0": "bad", "1": "good"}, False)
    assert causal_architecture({"architectures": ["Qwen2Model"]})["architectures"] == [
        "Qwen2ForCausalLM"]


@pytest.mark.parametrize("modes, normalize, expected", [
    ({"pooling_mode_cls_token": True}, False, (PoolingType.CLS, False)),
    ({"pooling_mode_mean_tokens": True}, True, (PoolingType.MEAN, True)),
    ({"pooling_mode_lasttoken": True}, True, (PoolingType.LAST, True)),
])
def test_sentence_transformers_pooling_is_honoured(tmp_path: Path, modes, normalize,
                                                   expected) -> None:
    _st_files(tmp_path, modes, normalize)
    spec = embedding_spec(str(tmp_path), {"architectures": ["Qwen2Model"]}, False)
    assert (spec.pooling, spec.normalize) == expected


@pytest.mark.parametrize("modes", [{"pooling_mode_max_tokens": True}, {},
                                   {"pooling_mode_cls_token": True,
                                    "pooling_mode_mean_tokens": True}])
def test_unserved_pooling_is_refused(tmp_path: Path, modes) -> None:
    _st_files(tmp_path, modes, False)
    with pytest.raises(SpecError, match="pooling"):
        embedding_spec(str(tmp_path), {"architectures": ["LlamaModel"]}, False)


# ---------------------------------------------------------------- pooling


@dataclass
class FakeModel:
    """final_hidden is the identity: the pooled vector is a function of the rows alone."""

    spec: EmbeddingSpec
    score: object = None

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@dataclass
class Seq:
    prefix_len: int
    token_ids: list[int]
    prompt_ids: list[int]
    embed: EmbedProgress | None


def _pool_in_chunks(pooling: PoolingType, hidden: torch.Tensor, cuts: list[int],
                    progress: EmbedProgress) -> list[float] | str | None:
    """Pool ``hidden``'s rows chunk by chunk (cuts: chunk bounds); the vector, or None when
    the last chunk does not end the prompt."""
    model = FakeModel(EmbeddingSpec("embedding", pooling, normalize=False))
    prompt = list(range(hidden.shape[0]))
    out: list[float] | str | None = None
    for start, end in zip(cuts, cuts[1:]):
        seq = Seq(start, prompt[start:end], prompt, progress)
        result = pool(model, hidden[start:end], [seq], [0])
        out = result.get(id(seq), out)
    return out


@pytest.mark.parametrize("pooling, expected", [
    (PoolingType.MEAN, lambda h: h.mean(dim=0)),
    (PoolingType.CLS, lambda h: h[0]),
    (PoolingType.LAST, lambda h: h[-1]),
])
def test_pooling_across_chunks_equals_pooling_at_once(pooling, expected) -> None:
    hidden = torch.randn(10, 6)
    out = _pool_in_chunks(pooling, hidden, [0, 4, 7, 10], EmbedProgress())
    assert torch.allclose(torch.tensor(out), expected(hidden), atol=1e-6)


def test_a_retracted_request_pools_each_position_once() -> None:
    hidden = torch.randn(10, 6)
    progress = EmbedProgress()
    _pool_in_chunks(PoolingType.MEAN, hidden, [0, 4], progress)  # then retracted
    assert progress.pooled_upto == 4
    # admitted again with 2 cached tokens: positions 2..3 run again and are skipped
    assert reusable_prefix(progress, 6, every_token=True) == 4
    out = _pool_in_chunks(PoolingType.MEAN, hidden, [2, 10], progress)
    assert torch.allclose(torch.tensor(out), hidden.mean(dim=0), atol=1e-6)


def test_a_gap_in_the_pooled_positions_fails_that_sequence_alone() -> None:
    hidden = torch.randn(8, 4)
    model = FakeModel(EmbeddingSpec("embedding", PoolingType.MEAN, normalize=True))
    prompt = list(range(4))
    gap = Seq(2, prompt[2:], prompt, EmbedProgress())
    fine = Seq(0, prompt, prompt, EmbedProgress())
    result = pool(model, hidden, [gap, fine], [0, 2])
    assert isinstance(result[id(gap)], str) and "lost prompt positions" in result[id(gap)]
    assert torch.allclose(torch.tensor(result[id(fine)]),
                          torch.nn.functional.normalize(hidden[2:6].mean(dim=0), dim=0))


# ---------------------------------------------------------------- the scheduler


def test_an_embed_request_finishes_after_its_prefill_with_its_vector() -> None:
    sched = Scheduler(SchedulerConfig(token_capacity=256, max_running_requests=4,
                                      max_prefill_tokens=8, context_length=128,
                                      eos_token_ids=(1,), pools_every_token=True))
    sched.add_request(GenerateReq("e", list(range(2, 22)), SamplingParams(max_new_tokens=0),
                                  embed=True))

    outputs = []
    for _ in range(3):  # 20 tokens in chunks of 8
        batch = sched.schedule()
        assert batch is not None and not any(s.sample for s in batch.spans)
        last = batch.spans[0].end == 20
        # a span that does not sample: its token means nothing, its embedding counts
        results = [SeqOutput(0, embedding=[0.5, 0.25] if last else None)]
        outputs += sched.postprocess(batch, results)
    assert sched.schedule() is None and sched.is_idle
    (final,) = [o for o in outputs if o.finish_reason]
    assert final.embedding == [0.5, 0.25] and final.prompt_tokens == 20
    assert final.new_token_ids == [] and final.error is None
    # the same prompt again: MEAN/CLS may not reuse the cached prefix it has not pooled
    sched.add_request(GenerateReq("f", list(range(2, 22)), SamplingParams(max_new_tokens=0),
                                  embed=True))
    batch = sched.schedule()
    assert batch is not None and batch.spans[0].start == 0
