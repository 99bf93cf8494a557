"""The decoder of an embedding or classification checkpoint: the causal LM's layers, the LM
head only when the checkpoint has one, and a classifier's score head."""

from __future__ import annotations

import torch
from torch import nn

from sglang_admin.model.config import LlamaConfig
from sglang_admin.model.embedding_spec import EmbeddingSpec
from sglang_admin.model.llama import LlamaForCausalLM


class LlamaForEmbedding(LlamaForCausalLM):
    """LlamaForCausalLM as an embedding model (its final hidden states pooled) or a
    sequence classifier (``score``, a bias-free linear map to ``num_labels`` logits, as
    transformers' ``*ForSequenceClassification``)."""

    def __init__(self, cfg: LlamaConfig, spec: EmbeddingSpec) -> None:
        super().__init__(cfg)
        self.spec = spec
        if not spec.has_lm_head and not cfg.tie_word_embeddings:
            del self.lm_head  # a base model or a classifier: the checkpoint has none
        if spec.unprefixed:
            # parameters named as the checkpoint names them (refits, GetWeightsByName and a
            # trainer's tensors use those names): the decoder's parts become children of
            # this module; ``self.model`` stays a plain reference for the forward
            inner = self._modules.pop("model")
            for name, child in inner.named_children():
                self.add_module(name, child)
            object.__setattr__(self, "model", inner)
        self.score: nn.Linear | None = None
        if spec.num_labels:
            self.score = nn.Linear(cfg.hidden_size, spec.num_labels, bias=False)

    def output_weight(self) -> torch.Tensor:
        if not hasattr(self, "lm_head") and not self.config.tie_word_embeddings:
            raise RuntimeError("an embedding model has no LM head: it does not generate")
        return super().output_weight()

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last hidden state (after the final norm) of hidden rows [N, hidden]."""
        return self.model.norm(hidden)
