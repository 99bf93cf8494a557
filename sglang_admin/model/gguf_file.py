"""A GGUF file read and checked: its header, metadata and tensor table (no tensor data), with
a one-line :class:`GgufError` for a file this server cannot serve. The ``gguf`` package is
imported only when a file is opened."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# general.architecture -> the Hugging Face architecture served for it
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


class GgufError(ValueError):
    """A GGUF file cannot be served; the message says why in one line.

    ``code`` is the gRPC status an update from it answers with: INVALID_ARGUMENT for a file
    that is not a readable GGUF, FAILED_PRECONDITION for a readable one this server cannot
    serve (an architecture, quant type or tokenizer it does not support).
    """

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


def has_gguf_magic(path: str) -> bool:
    """Whether the file starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@dataclass
class GgufFile:
    """The parts of a GGUF file the conversion needs, checked."""

    path: str
    arch: str  # general.architecture
    metadata: dict[str, Any]
    reader: Any  # gguf.GGUFReader

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)


def _field_value(field: Any) -> Any:
    value = field.contents()
    return value


def open_gguf(path: str) -> GgufFile:
    """Read and check a GGUF file's header, metadata and tensor table (no tensor data yet).

    A truncated or corrupt file is INVALID_ARGUMENT; an architecture, quant type or
    tokenizer this server does not serve is FAILED_PRECONDITION; each names the problem.
    """
    import gguf

    name = os.path.basename(path)
    if not has_gguf_magic(path):
        raise GgufError(f"{name}: not a GGUF file (no GGUF magic at its start)")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # noqa: BLE001 - the reader raises whatever numpy does
        raise GgufError(f"{name}: cannot read the GGUF file, truncated or corrupt "
                        f"({type(exc).__name__}: {exc})") from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = _field_value(field)
        except Exception as exc:  # noqa: BLE001
            raise GgufError(f"{name}: metadata {key!r} is unreadable ({exc})") from None
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(
            f"{name}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}",
            "FAILED_PRECONDITION",
        )
    # a file cut short: the last tensor's data must lie inside it
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise GgufError(f"{name}: truncated: tensor {tensor.name} ends at byte {end}, "
                            f"the file has {size}")
    supported = dequantizable_types()
    for tensor in reader.tensors:
        qtype = gguf.GGMLQuantizationType(int(tensor.tensor_type))
        if qtype not in supported:
            raise GgufError(
                f"{name}: tensor {tensor.name} has quant type {qtype.name}, which the gguf "
                f"package cannot dequantize (supported: {', '.join(t.name for t in supported)})",
                "FAILED_PRECONDITION",
            )
    if "tokenizer.ggml.tokens" not in metadata or "tokenizer.ggml.model" not in metadata:
        raise GgufError(f"{name}: the metadata holds no tokenizer (tokenizer.ggml.model and "
                        "tokenizer.ggml.tokens)", "FAILED_PRECONDITION")
    if metadata["tokenizer.ggml.model"] != "gpt2":
        raise GgufError(
            f"{name}: tokenizer model {metadata['tokenizer.ggml.model']!r} is not supported "
            "(only byte-level BPE, 'gpt2')", "FAILED_PRECONDITION")
    if "tokenizer.ggml.merges" not in metadata:
        raise GgufError(f"{name}: the BPE tokenizer in the metadata has no merges "
                        "(tokenizer.ggml.merges)", "FAILED_PRECONDITION")
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GgufError(f"{name}: RoPE scaling ({scaling or 'rope_freqs'}) in a GGUF file is "
                        "not supported", "FAILED_PRECONDITION")
    return GgufFile(path, arch, metadata, reader)


def dequantizable_types() -> list[Any]:
    """The GGML tensor types the installed gguf package turns into floats."""
    import gguf
    from gguf import quants

    out = [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16]
    traits = getattr(quants, "_type_traits", {})
    for qtype in gguf.GGMLQuantizationType:
        if qtype in out:
            continue
        cls = traits.get(qtype)
        if cls is not None and "dequantize_blocks" in vars(cls):
            out.append(qtype)
    return out
