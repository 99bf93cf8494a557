"""Writing a DownloadProfile stream to disk, each file checked against its sha256."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from sglang_admin.client.errors import DownloadError
from sglang_admin.pb import common_pb2 as pb


class ProfileWriter:
    """Writes DownloadProfile chunks under one directory, checking each file's offsets
    and sha256; a file is renamed into place only once its digest matched."""

    def __init__(self, dest_dir: str | os.PathLike[str]) -> None:
        self.dest = Path(dest_dir)
        self.written: list[Path] = []
        self._name: str | None = None
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._size = 0

    def _path(self, name: str) -> Path:
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts:
            raise DownloadError(f"refusing unsafe file name {name!r}")
        return self.dest.joinpath(*rel.parts)

    def add(self, chunk: pb.ProfileFileChunk) -> None:
        """Append one chunk; on a file's last chunk verify and publish it."""
        if self._name != chunk.file_name:
            if self._name is not None:
                raise DownloadError(f"{self._name}: ended without its last chunk")
            path = self._path(chunk.file_name)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._name = chunk.file_name
            self._file = open(f"{path}.part", "wb")  # noqa: SIM115 - closed at the last chunk
            self._hash = hashlib.sha256()
            self._size = 0
        if chunk.offset != self._size:
            raise DownloadError(
                f"{chunk.file_name}: chunk at offset {chunk.offset}, expected {self._size}"
            )
        assert self._file is not None
        self._file.write(chunk.data)
        self._hash.update(chunk.data)
        self._size += len(chunk.data)
        if chunk.last:
            self._finish_file(chunk.sha256)

    def _finish_file(self, expected: str) -> None:
        assert self._name is not None and self._file is not None
        path = self._path(self._name)
        self._file.close()
        digest = self._hash.hexdigest()
        if expected.lower() != digest:
            os.unlink(f"{path}.part")
            raise DownloadError(
                f"{self._name}: sha256 {digest} does not match the server's {expected or '(none)'}"
            )
        os.replace(f"{path}.part", path)
        self.written.append(path)
        self._name = None
        self._file = None

    def close(self) -> list[Path]:
        """The files written; raises if the stream stopped in the middle of a file."""
        if self._name is not None:
            assert self._file is not None
            self._file.close()
            os.unlink(f"{self._path(self._name)}.part")
            raise DownloadError(f"{self._name}: stream ended before its last chunk")
        return self.written
