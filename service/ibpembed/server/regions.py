# SPDX-License-Identifier: Apache-2.0
"""Same-host shared-memory regions that lookups write their outputs into (and read inputs from).

A frontend creates a POSIX shm object, registers ``[offset, offset + byte_size)`` of it under a
name, and names that region in its lookups; the values then never cross the socket (the response
carries dtype, shape and where each feature's values start). The caller owns the memory: the
server opens it once at registration, never resizes or unlinks it, and closes its descriptor on
unregister and at shutdown.

NOTE(regions): the server never maps a region. A caller can shrink its shm object at any time,
and an access through a mapping past the new end faults with SIGBUS, which would kill the server
(a check of the size before the access still races with the truncation). Outputs are written with
``pwritev`` and inputs read with ``pread`` on the descriptor instead: past the end of a shrunk
object a read returns short (an error for the request) and a write extends the object again,
neither can fault. It costs nothing extra: writing through a mapping would copy the values into
the page cache just the same. Each request still checks the object's size and link count
(``fstat``) first, so a region that shrank or was unlinked fails the request with a clear status.

Regions are transport-neutral: errors are :mod:`ibpembed.errors`, an owner is an opaque string
the transport derives from the caller's credentials.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ibpembed.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)

# POSIX shm names as glibc's shm_open takes them: one leading "/", then a file name of /dev/shm.
_SHM_NAME = re.compile(r"/[^/\x00]{1,254}")
SHM_DIR = "/dev/shm"
MAX_REGION_NAME_CHARS = 256
# Open descriptors per caller: each region holds one.
MAX_REGIONS_PER_OWNER = 256
# Each feature's values start at a multiple of this from the region's start, so that the views a
# client makes over them are aligned for any dtype and for SIMD loads.
VALUE_ALIGN = 64
# Linux's IOV_MAX: buffers one pwritev takes.
_IOV_MAX = 1024


@dataclass(frozen=True)
class RegionInfo:
    """A registered region: POSIX shm (the only kind this server opens)."""

    name: str
    shm_name: str
    offset: int
    byte_size: int


class Region:
    """One registered region: an open descriptor of the caller's shm object and its window.

    Requests take a use (:meth:`acquire`) for as long as they read or write it; the descriptor is
    closed when the region is released and its last use ends, so an unregister during a request
    never lets the request write through a reused descriptor number into another file.
    """

    def __init__(self, owner: str, info: RegionInfo, fd: int) -> None:
        self.owner = owner
        self.info = info
        self._fd = fd
        self._lock = threading.Lock()
        self._uses = 0
        self._released = False

    def acquire(self, field: str) -> None:
        with self._lock:
            if self._released:
                raise NotFound(f"{field}: region {self.info.name!r} was unregistered")
            self._uses += 1

    def release_use(self) -> None:
        with self._lock:
            self._uses -= 1
            close = self._released and self._uses == 0
        if close:
            os.close(self._fd)

    def release(self) -> None:
        """Unregistered: close now, or when the last request using it ends."""
        with self._lock:
            if self._released:
                return
            self._released = True
            close = self._uses == 0
        if close:
            os.close(self._fd)

    def check(self, field: str) -> None:
        """The shm object still exists and still holds the whole region."""
        st = os.fstat(self._fd)
        if st.st_nlink == 0:
            raise NotFound(
                f"{field}: shm {self.info.shm_name!r} of region {self.info.name!r} was unlinked;"
                " unregister the region"
            )
        end = self.info.offset + self.info.byte_size
        if st.st_size < end:
            raise InvalidArgument(
                field,
                f"shm {self.info.shm_name!r} of region {self.info.name!r} shrank to "
                f"{st.st_size} bytes; the region needs {end}",
            )

    def write(
        self, start: int, buffers: Sequence[bytes | memoryview | np.ndarray], field: str
    ) -> None:
        """``buffers`` back to back from byte ``start`` of the region (bounds checked by the
        caller against the region's size)."""
        position = self.info.offset + start
        # Byte-shaped, so that lengths below are byte counts (a numpy array's len() is not).
        pending = [b if isinstance(b, bytes) else memoryview(b).cast("B") for b in buffers]
        while pending:
            batch = pending[:_IOV_MAX]
            try:
                written = os.pwritev(self._fd, batch, position)
            except OSError as exc:  # e.g. ENOSPC: /dev/shm full after the object was shrunk
                raise FailedPrecondition(
                    f"{field}: writing to shm {self.info.shm_name!r} failed: {exc.strerror}"
                ) from None
            if written <= 0:
                raise FailedPrecondition(f"{field}: shm {self.info.shm_name!r} took no bytes")
            position += written
            # Drop what was written (a short write leaves part of a buffer).
            done = 0
            while done < len(batch) and written >= len(batch[done]):
                written -= len(batch[done])
                done += 1
            if written:
                pending[done] = memoryview(pending[done])[written:]
            del pending[:done]

    def read(self, start: int, size: int, field: str) -> bytes:
        """``size`` bytes from byte ``start`` of the region."""
        parts = []
        position, left = self.info.offset + start, size
        while left:
            try:
                chunk = os.pread(self._fd, left, position)
            except OSError as exc:
                raise FailedPrecondition(
                    f"{field}: reading shm {self.info.shm_name!r} failed: {exc.strerror}"
                ) from None
            if not chunk:
                raise InvalidArgument(
                    field, f"shm {self.info.shm_name!r} ended before the request's inputs"
                )
            parts.append(chunk)
            position += len(chunk)
            left -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)


class RegionRegistry:
    """Every registered region of one server, by name (names are unique per server)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}

    def register(
        self, owner: str, name: str, shm_name: str, offset: int, byte_size: int
    ) -> RegionInfo:
        """Open ``shm_name`` and register ``[offset, offset + byte_size)`` of it as ``name``."""
        if not name or len(name) > MAX_REGION_NAME_CHARS:
            raise InvalidArgument("name", f"must be 1 to {MAX_REGION_NAME_CHARS} characters")
        if not _SHM_NAME.fullmatch(shm_name) or shm_name in ("/.", "/.."):
            raise InvalidArgument(
                "shm_name",
                f"{shm_name[:64]!r} is not a POSIX shm name ('/' then 1-254 characters, no '/')",
            )
        if byte_size <= 0:
            raise InvalidArgument("byte_size", "must be > 0")
        with self._lock:
            existing = self._regions.get(name)
            if existing is not None:
                if existing.owner != owner:
                    raise PermissionDenied(f"name: region {name!r} belongs to another caller")
                raise AlreadyExists(f"name: region {name!r} is already registered")
            if sum(r.owner == owner for r in self._regions.values()) >= MAX_REGIONS_PER_OWNER:
                raise ResourceExhausted(
                    f"name: at most {MAX_REGIONS_PER_OWNER} regions per caller; unregister some"
                )
        path = SHM_DIR + shm_name
        try:
            # O_NOFOLLOW: a symlink planted in /dev/shm must not redirect writes to another file.
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise NotFound(f"shm_name: no shared memory {shm_name!r} on this host") from None
        except PermissionError:
            raise PermissionDenied(
                f"shm_name: the server may not open {shm_name!r} for writing"
            ) from None
        except OSError as exc:
            raise InvalidArgument("shm_name", f"cannot open {shm_name!r}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument("shm_name", f"{shm_name!r} is not a shared memory object")
            if offset + byte_size > st.st_size:
                raise InvalidArgument(
                    "byte_size",
                    f"offset {offset} + byte_size {byte_size} is past the end of {shm_name!r}"
                    f" ({st.st_size} bytes)",
                )
            info = RegionInfo(name, shm_name, offset, byte_size)
            region = Region(owner, info, fd)
            with self._lock:
                if name in self._regions:  # registered by a concurrent call meanwhile
                    raise AlreadyExists(f"name: region {name!r} is already registered")
                self._regions[name] = region
        except BaseException:
            os.close(fd)
            raise
        return info

    def get(self, owner: str, name: str, field: str) -> Region:
        """The caller's region ``name``, with a use taken (``release_use`` when done)."""
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"{field}: no region {name!r} is registered")
        if region.owner != owner:
            raise PermissionDenied(f"{field}: region {name!r} belongs to another caller")
        region.acquire(field)
        return region

    def unregister(self, owner: str, name: str) -> int:
        """Release ``name`` (or every region of ``owner`` for an empty name); returns how many."""
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None:
                    raise NotFound(f"name: no region {name!r} is registered")
                if region.owner != owner:
                    raise PermissionDenied(f"name: region {name!r} belongs to another caller")
                released = [self._regions.pop(name)]
            else:
                released = [r for r in self._regions.values() if r.owner == owner]
                for region in released:
                    del self._regions[region.info.name]
        for region in released:
            region.release()
        return len(released)

    def list(self, owner: str) -> list[RegionInfo]:
        with self._lock:
            return sorted(
                (r.info for r in self._regions.values() if r.owner == owner), key=lambda i: i.name
            )

    def close(self) -> None:
        """Release every region (server stop)."""
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for region in regions:
            region.release()


def output_layout(start: int, sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets (from the region's start) of values of ``sizes`` bytes written from ``start``,
    each aligned to VALUE_ALIGN, and the end of the last."""
    offsets = []
    position = start
    for size in sizes:
        position = -(-position // VALUE_ALIGN) * VALUE_ALIGN
        offsets.append(position)
        position += size
    return offsets, position
