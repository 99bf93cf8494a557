"""Tiny embedding and classification checkpoints for the Embed tests (random float32
weights, ``save_pretrained``, the default model's byte-level tokenizer), and transformers'
answer for them: the reference every served vector is compared with."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from sglang_admin.model.default_model import VOCAB_SIZE, write_default_model

PAD_ID = VOCAB_SIZE - 1  # the default tokenizer's <|pad|>
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# kind -> (transformers class, config class, pooling declared in modules.json or None,
# normalize module, number of labels, serve with --is-embedding)
KINDS: dict[str, tuple[str, str, str | None, bool, int, bool]] = {
    "qwen3": ("Qwen3Model", "Qwen3Config", "last", True, 0, False),
    "qwen2-mean": ("Qwen2Model", "Qwen2Config", "mean", True, 0, False),
    "llama-cls": ("LlamaModel", "LlamaConfig", "cls", False, 0, False),
    "qwen3-causal": ("Qwen3ForCausalLM", "Qwen3Config", None, False, 0, True),
    "llama-classify": ("LlamaForSequenceClassification", "LlamaConfig", None, False, 3, False),
    "qwen2-reward": ("Qwen2ForSequenceClassification", "Qwen2Config", None, False, 1, False),
    "qwen3-classify": ("Qwen3ForSequenceClassification", "Qwen3Config", None, False, 2, False),
}
LABELS = {3: {0: "negative", 1: "neutral", 2: "positive"}, 2: {0: "no", 1: "yes"}}

_tokenizer_dir: Path | None = None


def _tokenizer_source() -> Path:
    global _tokenizer_dir
    if _tokenizer_dir is None:
        _tokenizer_dir = Path(tempfile.mkdtemp(prefix="embed-tokenizer-"))
        write_default_model(str(_tokenizer_dir))
    return _tokenizer_dir


def build(kind: str, path: Path, seed: int = 0, hidden: int = 64) -> Path:
    """Write checkpoint ``kind`` (see KINDS) into ``path``; returns ``path``."""
    cls_name, config_name, pooling, normalize, num_labels, _flag = KINDS[kind]
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=VOCAB_SIZE - 2, bos_token_id=256,
        pad_token_id=PAD_ID, tie_word_embeddings=False,
    )
    if config_name == "Qwen3Config":
        kw["head_dim"] = hidden // 4
    if num_labels:
        labels = LABELS.get(num_labels, {i: f"LABEL_{i}" for i in range(num_labels)})
        kw.update(num_labels=num_labels, id2label=labels,
                  label2id={v: k for k, v in labels.items()})
    config = getattr(transformers, config_name)(**kw)
    model = getattr(transformers, cls_name)(config)
    with torch.no_grad():  # a larger init than 0.02 keeps the vectors apart
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif p.dim() == 1:  # norms and biases: not all ones / zeros
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(_tokenizer_source() / name, path / name)
    if pooling is not None:  # the sentence-transformers layout
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
            (path / "2_Normalize").mkdir()
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": hidden,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": pooling == "last",
        }))
        (path / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return path


def server_flags(kind: str) -> list[str]:
    """The serve flags of checkpoint ``kind``."""
    return ["--is-embedding"] if KINDS[kind][5] else []


class Reference:
    """transformers' answer for a checkpoint: the pooled, normalized last hidden state (as
    the checkpoint declares) or the classifier's logits, one unpadded sequence at a time."""

    def __init__(self, kind: str, path: Path) -> None:
        cls_name, _, pooling, normalize, num_labels, _ = KINDS[kind]
        self.num_labels = num_labels
        self.pooling = pooling or "last"
        self.normalize = normalize if pooling is not None else not num_labels
        auto = (transformers.AutoModelForSequenceClassification if num_labels
                else transformers.AutoModel)
        self.model = auto.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> list[float]:
        x = torch.tensor([ids])
        if self.num_labels:
            return self.model(input_ids=x).logits[0].tolist()
        states = self.model(input_ids=x).last_hidden_state[0]
        if self.pooling == "mean":
            vector = states.float().mean(dim=0)
        elif self.pooling == "cls":
            vector = states[0]
        else:
            vector = states[-1]
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
        return vector.tolist()
