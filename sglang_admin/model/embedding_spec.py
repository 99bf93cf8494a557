"""What a checkpoint serves: generation, embeddings or classification logits, and how it pools.

Read from config.json's ``architectures``, the ``--is-embedding`` flag and the
sentence-transformers files a checkpoint may carry (``modules.json`` naming a Pooling
module whose ``config.json`` says the pooling mode, and a Normalize module), as SGLang's
``configs/model_config.py`` and ``layers/pooler.py`` decide it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

# An architecture that is never generative -> the causal LM whose layers it shares (the
# model is built as that one, without its LM head; a classifier adds its score head).
EMBEDDING_ARCHITECTURES: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "LlamaEmbeddingModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
CLASSIFICATION_ARCHITECTURES: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "Qwen2ForRewardModel": "Qwen2ForCausalLM",
}
IS_EMBEDDING_FLAG = "--is-embedding"


class PoolingType(IntEnum):
    """SGLang's pooling types (layers/pooler.py)."""

    LAST = 0
    CLS = 1
    MEAN = 2


class SpecError(ValueError):
    """The checkpoint's embedding files cannot be understood; the message says why."""


@dataclass(frozen=True)
class EmbeddingSpec:
    """How the served model answers: ``kind`` is "generation", "embedding" or
    "classification"; an embedding pools with ``pooling`` and L2-normalizes when
    ``normalize``; a classifier returns its ``num_labels`` score logits at the last token."""

    kind: str = "generation"
    pooling: PoolingType = PoolingType.LAST
    normalize: bool = True
    num_labels: int = 0
    id2label: dict[str, str] = field(default_factory=dict)
    has_lm_head: bool = True  # whether the checkpoint carries the LM head (tied aside)
    # a base model's checkpoint (LlamaModel, Qwen3Model ...): its tensors are named without
    # the "model." prefix ("layers.0.mlp.up_proj.weight")
    unprefixed: bool = False

    @property
    def is_generation(self) -> bool:
        return self.kind == "generation"

    @property
    def pools_every_token(self) -> bool:
        """Whether every prompt token's hidden state is needed (not only the last one)."""
        return self.kind == "embedding" and self.pooling != PoolingType.LAST


def causal_architecture(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with an embedding or classification architecture replaced by the causal LM
    that shares its layers (the config the decoder is built from); else ``cfg`` itself."""
    archs = list(cfg.get("architectures") or [])
    table = {**EMBEDDING_ARCHITECTURES, **CLASSIFICATION_ARCHITECTURES}
    mapped = [table.get(a, a) for a in archs]
    return cfg if mapped == archs else dict(cfg, architectures=mapped)


def _read(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"cannot read {path}: {exc}") from None


def sentence_transformers_pooling(model_path: str) -> tuple[PoolingType, bool] | None:
    """(pooling, normalize) from a sentence-transformers ``modules.json``, or None when the
    checkpoint has none (or names no Pooling module)."""
    modules_path = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _read(modules_path)
    if not isinstance(modules, list):
        raise SpecError(f"{modules_path} is not a list of modules")
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling_dir = next((str(m.get("path", "")) for m in modules if isinstance(m, dict)
                        and str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling_dir is None:
        return None
    config = _read(os.path.join(model_path, pooling_dir, "config.json"))
    if not isinstance(config, dict):
        raise SpecError(f"{pooling_dir}/config.json is not a JSON object")
    modes = {
        PoolingType.CLS: config.get("pooling_mode_cls_token"),
        PoolingType.MEAN: config.get("pooling_mode_mean_tokens"),
        PoolingType.LAST: config.get("pooling_mode_lasttoken"),
    }
    chosen = [mode for mode, on in modes.items() if on]
    others = [k for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                          "pooling_mode_weightedmean_tokens") if config.get(k)]
    if others or len(chosen) != 1:
        raise SpecError(
            f"{pooling_dir}/config.json: pooling {others or [m.name for m in chosen] or 'none'} "
            "is not served (exactly one of cls, mean, lasttoken)")
    return chosen[0], normalize


def embedding_spec(model_path: str, cfg: dict[str, Any], is_embedding: bool) -> EmbeddingSpec:
    """What the checkpoint at ``model_path`` (its parsed config.json ``cfg``) serves."""
    archs = list(cfg.get("architectures") or [])
    classifier = next((a for a in archs if a in CLASSIFICATION_ARCHITECTURES), None)
    if classifier is not None:
        raw = cfg.get("id2label") or {}
        num_labels = int(cfg.get("num_labels") or len(raw) or 2)
        id2label = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
        if len(id2label) != num_labels:
            id2label = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        return EmbeddingSpec("classification", PoolingType.LAST, False, num_labels, id2label,
                             has_lm_head=False)
    base_model = any(a in EMBEDDING_ARCHITECTURES for a in archs)
    if not (base_model or is_embedding):
        return EmbeddingSpec()
    declared = sentence_transformers_pooling(model_path)
    pooling, normalize = declared if declared is not None else (PoolingType.LAST, True)
    return EmbeddingSpec("embedding", pooling, normalize, has_lm_head=not base_model,
                         unprefixed=base_model)
