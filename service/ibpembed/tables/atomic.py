# SPDX-License-Identifier: Apache-2.0
"""Atomic file replacement: a temporary file next to the target, fsynced, renamed over it.

A crash at any moment leaves either the old file or the new one under the final name, and the
directory's fsync makes the rename itself survive a power cut.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO

TEMP_MARKER = ".tmp-"  # temporary files are ".<stem>.tmp-<pid>-<random>"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicWriter:
    """A temporary file in the target's directory that becomes the target only on ``commit``.

    Used as a context manager: leaving the block without ``commit`` (an exception) removes the
    temporary file. ``commit`` fsyncs the data, renames it into place and fsyncs the directory, so
    the rename itself survives a power cut.
    """

    def __init__(self, directory: str | os.PathLike[str], stem: str) -> None:
        self.directory = Path(directory)
        nonce = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.temp_path = self.directory / f".{stem}{TEMP_MARKER}{nonce}"
        self.file: BinaryIO = open(self.temp_path, "xb")  # noqa: SIM115  (closed in commit/exit)
        self._committed = False

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._committed:
            self.file.close()
            self.temp_path.unlink(missing_ok=True)

    def commit(self, final_path: str | os.PathLike[str]) -> Path:
        final_path = Path(final_path)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.temp_path, final_path)
        self._committed = True
        _fsync_dir(final_path.parent)
        return final_path


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write a small file (a manifest) atomically."""
    path = Path(path)
    with AtomicWriter(path.parent, path.name) as writer:
        writer.file.write(data)
        return writer.commit(path)
