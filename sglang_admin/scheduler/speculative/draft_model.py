"""STANDALONE speculative decoding's draft model: a second, small model of the
target's tokenizer, loaded by the rank beside the target (model/runner.py's ModelRunner on
the target's device and dtype, with a KV pool and request-to-token table of its own), and
the start-up checks that it fits the target. The drafting itself (which tokens each request
feeds, its draft KV) is scheduler/speculative/draft_drafter.py's."""

from __future__ import annotations

import json
import os

from sglang_admin.messages import ModelInfo
from sglang_admin.model.loader import dtype_name, load_model_info
from sglang_admin.model.runner import ModelRunner


class DraftModelError(ValueError):
    """The draft model cannot serve beside this target (one line: why)."""


def draft_mismatch(draft: ModelInfo, target: ModelInfo) -> str | None:
    """Why the draft model cannot draft for the target (one line); None when it can: the
    same vocabulary size, and the same tokenizer when both have a tokenizer.json."""
    if draft.vocab_size != target.vocab_size:
        return (f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the "
                f"target's ({target.vocab_size})")
    mine, theirs = _vocabulary(draft.tokenizer_path), _vocabulary(target.tokenizer_path)
    if mine is not None and theirs is not None and mine != theirs:
        return "the draft model's tokenizer differs from the target's (tokenizer.json vocab)"
    return None


def _vocabulary(directory: str | None) -> dict | None:
    """tokenizer.json's token -> id table and added tokens; None without that file."""
    path = os.path.join(directory, "tokenizer.json") if directory else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    added = {t.get("content"): t.get("id") for t in data.get("added_tokens") or []}
    return {"vocab": (data.get("model") or {}).get("vocab"), "added": added}


def check_draft_model(draft_path: str, target_path: str | None) -> str | None:
    """Why ``draft_path`` cannot draft for the target at ``target_path`` (None: the
    embedded model), in one line; None when it can. Reads the configs, not the weights."""
    if target_path is None:
        from sglang_admin.model.default_model import ensure_default_model

        target_path = ensure_default_model()
    try:
        draft = load_model_info(draft_path)
    except Exception as exc:  # noqa: BLE001 - any reason is a refusal, in one line
        return f"--speculative-draft-model-path {draft_path} does not load: {exc}"
    return draft_mismatch(draft, load_model_info(target_path))


def load_draft_runner(draft_path: str, target: ModelRunner, rows: int, capacity: int,
                      attention_backend: str = "auto") -> ModelRunner:
    """The draft model on the target's device and dtype, with ``rows`` table rows, the
    target's context length and a pool of ``capacity`` KV slots. DraftModelError when its
    vocabulary differs from the target's. A GGUF draft keeps its projections quantized
    (model/quant/) when the target keeps its own (a GGUF target served kept, on CPU);
    otherwise it is loaded dense, as the target."""
    problem = draft_mismatch(load_model_info(draft_path), target.info)
    if problem is not None:
        raise DraftModelError(problem)
    return ModelRunner(
        draft_path, device=str(target.device), dtype=dtype_name(target.dtype),
        max_total_tokens=capacity, max_running_requests=rows,
        context_length=target.context_length, attention_backend=attention_backend,
        quantization=draft_quantization(draft_path, target))


def draft_quantization(draft_path: str, target: ModelRunner) -> str:
    """"gguf" where the draft at ``draft_path`` (a directory converted from a GGUF file)
    keeps its quantized projections: the target keeps its own GGUF weights quantized;
    else "" (dense: a dense or --gguf-dequantize target, --torchao-config, a draft that is
    not a GGUF file)."""
    from sglang_admin.model.quant.flags import gguf_source
    from sglang_admin.model.quant.gguf_load import QUANTIZATION_GGUF

    quant = getattr(target.model, "quant", None)
    if quant is None or quant.scheme != QUANTIZATION_GGUF or gguf_source(draft_path) is None:
        return ""
    return QUANTIZATION_GGUF
