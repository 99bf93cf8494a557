"""The tokenizer bundle: which files, zip safety as the SMG gateway checks it, chunking."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import random
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from sglang_admin.server.tokenizer_bundle import (
    MAX_ENTRIES,
    NoTokenizerFiles,
    TokenizerBundle,
    build_bundle,
    iter_chunks,
    tokenizer_dir,
)


def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}}}))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    (d / "config.json").write_text("{}")
    (d / "generation_config.json").write_text("{}")
    (d / "special_tokens_map.json").write_text("{}")
    (d / "merges.txt").write_text("a b\n")
    (d / "template.jinja").write_text("{{ messages }}")
    (d / "model.safetensors").write_bytes(b"\0" * 1024)  # weights stay out
    (d / "README.md").write_text("not a tokenizer file")
    sub = d / "nested"
    sub.mkdir()
    (sub / "tokenizer.json").write_text("{}")  # only the directory's own files
    return d


def entries(data: bytes) -> list[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.testzip() is None
        return zf.namelist()


def test_bundle_holds_the_tokenizer_files_at_the_root(tmp_path: Path) -> None:
    bundle = build_bundle(model_dir(tmp_path))
    names = entries(bundle.data)
    assert names == list(bundle.names)
    assert set(names) == {
        "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
        "special_tokens_map.json", "merges.txt", "template.jinja",
    }
    for name in names:  # the gateway refuses absolute and `..` paths
        path = PurePosixPath(name)
        assert not path.is_absolute() and ".." not in path.parts and len(path.parts) == 1
    assert len(names) <= MAX_ENTRIES
    assert bundle.sha256 == hashlib.sha256(bundle.data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(bundle.data)) as zf:
        assert json.loads(zf.read("tokenizer_config.json"))["chat_template"] == "{{ x }}"


def test_bundle_is_reproducible(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    assert build_bundle(d).sha256 == build_bundle(d).sha256


def test_no_tokenizer_files_is_an_error_naming_the_directory(tmp_path: Path) -> None:
    d = tmp_path / "weights-only"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0")
    with pytest.raises(NoTokenizerFiles, match="weights-only"):
        build_bundle(d)
    with pytest.raises(NoTokenizerFiles, match="cannot be read"):
        build_bundle(tmp_path / "missing")


def test_symlinked_files_are_followed(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "abc").write_text("{}")
    d = tmp_path / "snapshot"
    d.mkdir()
    (d / "tokenizer.json").symlink_to(blobs / "abc")
    assert entries(build_bundle(d).data) == ["tokenizer.json"]


def test_chunks_carry_the_digest_on_the_last_only(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (d / "vocab.json").write_bytes(random.Random(0).randbytes(300_000))  # incompressible
    bundle = build_bundle(d)
    chunks = list(iter_chunks(bundle, chunk_size=100_000))
    assert len(chunks) > 1
    assert all(len(data) <= 100_000 for data, _ in chunks)
    assert [digest for _, digest in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1][1] == bundle.sha256
    assert b"".join(data for data, _ in chunks) == bundle.data


def test_async_bundle_is_built_once(tmp_path: Path, monkeypatch) -> None:
    import sglang_admin.server.tokenizer_bundle as tb

    calls = []
    real = tb.build_bundle

    def counting(directory):
        calls.append(directory)
        return real(directory)

    monkeypatch.setattr(tb, "build_bundle", counting)
    tok = TokenizerBundle(model_dir(tmp_path))

    async def run() -> None:
        results = await asyncio.gather(*(tok.get() for _ in range(5)))
        assert len({r.sha256 for r in results}) == 1
        await tok.get()

    asyncio.run(run())
    assert len(calls) == 1


def test_tokenizer_dir_prefers_the_flag_then_the_model_directory(tmp_path: Path) -> None:
    assert tokenizer_dir(None, "/models/m") == "/models/m"
    assert tokenizer_dir("rel/tok", "/models/m") == os.path.abspath("rel/tok")
    assert tokenizer_dir(None, None) is None
