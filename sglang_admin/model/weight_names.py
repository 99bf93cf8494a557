"""The one resolution of a Hugging Face weight name to the served model's parameter, used
by every by-name path: loading (start-up, refits, pushed tensors), reading
(GetWeightsByName) and digesting (CheckWeights).

A name is either a parameter's own name, another name of a parameter (``lm_head.weight`` of
a model with tied embeddings is the embedding matrix, as in SGLang), or a buffer the model
computes itself (rotary ``inv_freq``), which a checkpoint may carry and a load drops. Any
other name is unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from sglang_admin.model.llama import LlamaForCausalLM

# Checkpoint tensors the model computes itself or never reads.
COMPUTED_BUFFERS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)rotary\.inv_freq$")
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


class UnknownWeightName(KeyError):
    """A name that is no parameter of the served model; ``str()`` says so in one line."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"the model has no parameter named {self.name!r}"


@dataclass(frozen=True)
class ResolvedName:
    """What a weight name denotes in the served model."""

    name: str  # as asked
    param_name: str | None  # the parameter it is; None for a computed buffer
    param: torch.Tensor | None
    alias: bool = False  # another name of ``param_name`` (the LM head of a tied model)

    @property
    def loads(self) -> bool:
        """Whether a load under this name copies into a parameter. An alias does not: a
        tied checkpoint's ``lm_head.weight`` is a copy of the embedding, dropped as SGLang
        drops it, so the embedding is written once, under its own name."""
        return self.param is not None and not self.alias


def model_parameters(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Every parameter of the model by its (Hugging Face) name, duplicates kept."""
    return dict(model.named_parameters(remove_duplicate=False))


def resolve(model: LlamaForCausalLM, name: str,
            params: dict[str, torch.Tensor] | None = None) -> ResolvedName:
    """What ``name`` is in ``model`` (``params``: its :func:`model_parameters`, when the
    caller resolves many names). Raises :class:`UnknownWeightName`."""
    params = model_parameters(model) if params is None else params
    param = params.get(name)
    if param is not None:
        return ResolvedName(name, name, param)
    if name == LM_HEAD and model.config.tie_word_embeddings and EMBEDDING in params:
        return ResolvedName(name, EMBEDDING, params[EMBEDDING], alias=True)
    if COMPUTED_BUFFERS.search(name):
        return ResolvedName(name, None, None)
    raise UnknownWeightName(name)
