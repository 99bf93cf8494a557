"""The model's tokenizer files as one zip archive, for the `GetTokenizer` RPC.

A router that cannot read the worker's tokenizer directory (another host) asks for it
over gRPC: a stream of zip bytes whose last chunk carries the hex SHA-256 of the whole
archive. The SMG gateway checks that digest, refuses archives with more than 50 entries
or with absolute or `..` paths, and extracts the files into a directory it loads the
tokenizer from, so every file sits at the archive root.

The archive is built once per directory (file reads and deflate run in a worker thread,
off the event loop) and served from memory afterwards. Entries carry a fixed timestamp,
so the same files always give the same bytes and the same digest.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHUNK_SIZE = 512 * 1024  # bytes per GetTokenizerChunk (well under gRPC's 4 MiB default)
MAX_ENTRIES = 50  # the gateway refuses archives with more entries
MAX_FILE_BYTES = 256 * 1024 * 1024  # a tokenizer file larger than this is not one
MAX_TOTAL_BYTES = 400 * 1024 * 1024  # the gateway refuses more than 500 MiB uncompressed
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)  # fixed entry timestamps: reproducible archives

# Files taken by exact name: tokenizers of every common format, the chat template, and the
# model config files a router reads next to them (special tokens, EOS ids, architecture).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)
# Files taken by suffix: tiktoken vocabularies and chat templates under other names.
TOKENIZER_SUFFIXES = (".tiktoken", ".jinja")
# Without one of these the directory holds no tokenizer (config files alone are not one).
TOKENIZER_CORE = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "vocab.txt",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "tiktoken.model",
    }
)


class NoTokenizerFiles(Exception):
    """The directory has no tokenizer files to bundle; the message says which directory."""


@dataclass(frozen=True)
class Bundle:
    """A built archive: its bytes, hex SHA-256 and the names of its entries."""

    data: bytes
    sha256: str
    names: tuple[str, ...]


def tokenizer_file_names(directory: Path) -> list[str]:
    """Names of the files in `directory` that go into the bundle, in archive order.

    Only regular files (symlinks to regular files count: a Hugging Face cache snapshot
    is made of them) directly in `directory`, at most MAX_ENTRIES of them.
    """
    try:
        entries = sorted(os.listdir(directory))
    except OSError as exc:
        raise NoTokenizerFiles(
            f"tokenizer directory {str(directory)!r} cannot be read: {exc.strerror}"
        ) from None
    present = {name for name in entries if (directory / name).is_file()}
    names = [name for name in TOKENIZER_FILES if name in present]
    names += [n for n in entries if n in present and n.endswith(TOKENIZER_SUFFIXES)
              and n not in names]
    if not TOKENIZER_CORE.intersection(names) and not any(
        n.endswith(".tiktoken") for n in names
    ):
        raise NoTokenizerFiles(
            f"model directory {str(directory)!r} has no tokenizer files (looked for "
            "tokenizer.json, tokenizer_config.json, vocab/merges, tokenizer.model, *.tiktoken)"
        )
    return names[:MAX_ENTRIES]


def build_bundle(directory: str | os.PathLike[str]) -> Bundle:
    """Zip the tokenizer files of `directory` (blocking: run it in a thread)."""
    root = Path(directory)
    names = tokenizer_file_names(root)
    buf = io.BytesIO()
    total = 0
    kept: list[str] = []
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            path = root / name
            size = path.stat().st_size
            if size > MAX_FILE_BYTES or total + size > MAX_TOTAL_BYTES:
                continue
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, path.read_bytes())
            total += size
            kept.append(name)
    if not kept:
        raise NoTokenizerFiles(f"tokenizer files in {str(root)!r} are too large to bundle")
    data = buf.getvalue()
    return Bundle(data, hashlib.sha256(data).hexdigest(), tuple(kept))


def iter_chunks(bundle: Bundle, chunk_size: int = CHUNK_SIZE) -> Iterator[tuple[bytes, str]]:
    """(data, sha256) pieces of the archive in order; only the last carries the digest."""
    data = bundle.data
    for start in range(0, len(data), chunk_size):
        end = min(start + chunk_size, len(data))
        yield data[start:end], bundle.sha256 if end == len(data) else ""


class TokenizerBundle:
    """The archive of one directory, built on first use in a thread and then kept.

    Concurrent first callers share one build. A failed build is not kept: the next call
    tries again (the files may have been fixed).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._bundle: Bundle | None = None
        self._lock: asyncio.Lock | None = None

    async def get(self) -> Bundle:
        if self._bundle is not None:
            return self._bundle
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._bundle is None:
                self._bundle = await asyncio.to_thread(build_bundle, self.directory)
        return self._bundle


def tokenizer_dir(tokenizer_path: str | None, model_tokenizer_path: str | None) -> str | None:
    """The worker's tokenizer directory: --tokenizer-path (absolute), else the one found
    in the model directory (ModelInfo.tokenizer_path); None when neither is known. What GetModelInfo and
    GetServerInfo report and GetTokenizer serves (the latter falls back to the model
    directory to say what is missing there)."""
    if tokenizer_path:
        return os.path.abspath(tokenizer_path)
    return model_tokenizer_path or None


_BUNDLES: dict[Path, TokenizerBundle] = {}


def bundle_for(directory: str | os.PathLike[str]) -> TokenizerBundle:
    """The process-wide bundle of `directory` (a server serves one model: one entry)."""
    key = Path(directory).resolve()
    bundle = _BUNDLES.get(key)
    if bundle is None:
        bundle = _BUNDLES[key] = TokenizerBundle(key)
    return bundle
