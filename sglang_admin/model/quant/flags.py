"""What ``serve``'s quantization flags mean for a model directory (no torch here: the CLI
decides before any rank starts)."""

from __future__ import annotations

import json
import os


def gguf_source(model_dir: str) -> str | None:
    """The GGUF file a converted directory came from (its source.json), if it still exists."""
    path = os.path.join(model_dir, "source.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            source = json.load(f).get("gguf_file")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) and os.path.isfile(source) else None


def served_quantization(model_dir: str | None, quantization: str | None,
                        gguf_dequantize: bool, device: str = "auto",
                        torchao_config: str | None = None) -> str:
    """ServerArgs.quantization for the served directory: "gguf" (weights kept quantized) for
    one converted from a GGUF file on CPU unless ``gguf_dequantize``; the
    ``torchao_config`` name when given; "" otherwise. ValueError (one line) for a
    contradiction."""
    is_gguf = model_dir is not None and gguf_source(model_dir) is not None
    if torchao_config is not None:
        if quantization is not None:
            raise ValueError("--torchao-config and --quantization contradict each other")
        if is_gguf and not gguf_dequantize:
            raise ValueError("--torchao-config quantizes a dense checkpoint: a GGUF model "
                             "keeps its own quantization (or add --gguf-dequantize)")
        if device == "cuda":
            raise ValueError("--torchao-config runs on CPU only here")
        return torchao_config
    if quantization == "gguf" and gguf_dequantize:
        raise ValueError("--quantization gguf and --gguf-dequantize contradict each other")
    if quantization == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a GGUF model (--model-path FILE.gguf)")
    if quantization == "gguf" and device == "cuda":
        raise ValueError("--quantization gguf runs on CPU only; on CUDA serve with "
                         "--gguf-dequantize")
    if not is_gguf or gguf_dequantize:
        return ""
    if quantization is None and device == "cuda":
        return ""  # the dequantizing load, as before: the kept kernels are CPU ones
    return "gguf"
