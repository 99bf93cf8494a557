"""A GGUF file's tokenizer as Hugging Face files: tokenizer.json (byte-level BPE, built with
the ``tokenizers`` library) and tokenizer_config.json (the chat template, special tokens)."""

from __future__ import annotations

from typing import Any, Protocol


class GgufMetadata(Protocol):
    """What the tokenizer reads of an opened GGUF file (model/gguf.py's GgufFile)."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def arch_key(self, key: str, default: Any = None) -> Any: ...


# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> the split that runs before the byte-level mapping (None: GPT-2's)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for
    the characters from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1),
                 *range(0xAE, 0xFF + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_tokenizer(g: GgufMetadata) -> Any:
    """A ``tokenizers.Tokenizer`` for the byte-level BPE vocabulary in the metadata: the
    merges, the split ``tokenizer.ggml.pre`` names, control tokens as special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    tokens: list[str] = list(g.get("tokenizer.ggml.tokens"))
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))
               for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _PRE_SPLITS.get(str(g.get("tokenizer.ggml.pre", "")))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    types = list(g.get("tokenizer.ggml.token_type") or [])
    control = [t for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= letters]
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def tokenizer_config(g: GgufMetadata) -> dict[str, Any]:
    """tokenizer_config.json: the chat template and the special tokens by name."""
    tokens: list[str] = list(g.get("tokenizer.ggml.tokens"))

    def token(key: str) -> str | None:
        index = g.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(g.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(g.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(g.arch_key("context_length", 2048)),
        "clean_up_tokenization_spaces": False,
    }
    template = g.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = str(template)
    return cfg
