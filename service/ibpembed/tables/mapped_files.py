# SPDX-License-Identifier: Apache-2.0
"""Which served table files were changed in place (truncated, or overwritten) since they were
mapped.

A table file is served from a memory mapping of it. ``ibpembed pack`` never writes a served
file (it writes new files and renames the manifest over the old one), but an operator's ``cp``
over the file, ``truncate`` or a non-atomic sync writes the inode that is mapped: pages past a
new, shorter end fault with SIGBUS on access (which :mod:`ibpembed.tables.mapping_guard` turns
into zero pages and a refusal), and rewritten pages serve other rows than the ones published.
A file replaced by a new inode (rename, unlink) is harmless:
the mapping keeps the old one. So the identity, size and modification time of each file are
recorded when it is mapped, and a file whose inode is still the one at its path but whose size
or time changed is damaged: its table must not be read again. :class:`MappedFiles` keeps those
records for a store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FileStamp:
    """A table file as it was when it was mapped."""

    path: Path
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp | None:
        """``path``'s stamp now; None when it cannot be read (then it is not watched)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def change(self) -> str | None:
        """How the mapped file was changed in place since, or None (unchanged, or replaced by
        another file, which leaves the mapped one intact)."""
        now = FileStamp.of(self.path)
        if now is None or (now.device, now.inode) != (self.device, self.inode):
            return None
        if now.size != self.size:
            return f"its file {self.path} changed size in place ({self.size} -> {now.size} bytes)"
        if now.mtime_ns != self.mtime_ns:
            return f"its file {self.path} was rewritten in place"
        return None


class MappedFiles:
    """The files held tables were mapped from, as they were then, each with the memory its table
    reads (a key the caller gives: its payload's address), not the table itself, which would
    keep its mapping alive.

    Not locked: the store calls it under its write lock.
    """

    def __init__(self) -> None:
        self._files: dict[Path, tuple[int, FileStamp]] = {}

    def watch(self, path: Path, key: int) -> None:
        """Record ``path`` as just mapped into memory ``key``; a file that cannot be read is not
        watched."""
        stamp = FileStamp.of(path)
        if stamp is None:
            return
        # Memory of a table no longer held may be mapped again for this one.
        self._files = {p: w for p, w in self._files.items() if w[0] != key}
        self._files[stamp.path] = (key, stamp)

    def changed(self, held: set[int]) -> dict[int, str]:
        """The keys among ``held`` whose files were changed in place, with how; their files are
        not watched any more."""
        # Files no held version reads any more (replaced by a reload, compacted by a row update)
        # are not watched.
        self._files = {p: w for p, w in self._files.items() if w[0] in held}
        damaged: dict[int, str] = {}
        for path, (key, stamp) in list(self._files.items()):
            why = stamp.change()
            if why is not None:
                damaged[key] = why
                del self._files[path]
        return damaged
