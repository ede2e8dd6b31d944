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

Proof of write access. The server usually runs with more rights than a caller (another user, or
a caller on another host that only names a file), and opening an object is what the server can
do, not what the caller can: a region registered on the server's say-so alone lets a caller read
and overwrite any shm object the server can open (another frontend's buffers, a colocated
inference server's). So a registration completes only once the caller has proven it can write
the object: :meth:`RegionRegistry.challenge` issues a random nonce bound to the caller, the
object and the offset, the caller writes it at the region's first bytes, and
:meth:`RegionRegistry.register` reads it back from the descriptor it will keep. A nonce serves
one attempt and expires after NONCE_TTL_S. No error message carries bytes read from a region.

Regions are transport-neutral: errors are :mod:`ibpembed.errors`, an owner is an opaque string
the transport derives from the caller's credentials.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
import threading
import time
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
# Open descriptors of all callers together (the default of ``--max-regions``): well under the
# usual 1,024-descriptor limit, so table reloads and connections keep theirs.
MAX_REGIONS = 512
# A registration's proof of write access: random bytes, one attempt each, valid this long.
NONCE_BYTES = 16
NONCE_TTL_S = 60
# Outstanding nonces per caller: bounds the memory of a caller that asks and never registers.
MAX_CHALLENGES_PER_OWNER = 64
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
        # Byte-shaped, so that lengths below are byte counts (a numpy array's len() is not). An
        # array goes through its .data: numpy's stubs make an array a buffer from Python 3.12 on.
        pending = [
            b if isinstance(b, bytes) else (b.data if isinstance(b, np.ndarray) else b).cast("B")
            for b in buffers
        ]
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


@dataclass(frozen=True)
class _Challenge:
    """A nonce issued to ``owner`` for the region at ``offset`` of ``shm_name``."""

    owner: str
    shm_name: str
    offset: int
    expires: float  # time.monotonic()


def _check_shm_name(shm_name: str) -> None:
    if not _SHM_NAME.fullmatch(shm_name) or shm_name in ("/.", "/.."):
        raise InvalidArgument(
            "shm_name",
            f"{shm_name[:64]!r} is not a POSIX shm name ('/' then 1-254 characters, no '/')",
        )


class RegionRegistry:
    """Every registered region of one server, by name (names are unique per server).

    ``max_regions``: regions of all callers together (each holds a descriptor); a caller holds
    at most MAX_REGIONS_PER_OWNER of them.
    """

    def __init__(self, max_regions: int = MAX_REGIONS) -> None:
        if max_regions < 1:
            raise ValueError(f"max_regions must be >= 1, got {max_regions}")
        self.max_regions = max_regions
        self._lock = threading.Lock()
        # Keyed by (owner, name): each identity names its regions in a namespace of its own, so
        # no caller can take a name another needs, or learn which names another has taken.
        self._regions: dict[tuple[str, str], Region] = {}
        self._challenges: dict[bytes, _Challenge] = {}

    def challenge(self, owner: str, shm_name: str, offset: int) -> bytes:
        """A fresh nonce that ``owner`` writes at ``offset`` of ``shm_name`` to register a
        region there (:meth:`register`)."""
        _check_shm_name(shm_name)
        now = time.monotonic()
        with self._lock:
            for nonce in [n for n, c in self._challenges.items() if c.expires <= now]:
                del self._challenges[nonce]
            pending = sum(c.owner == owner for c in self._challenges.values())
            if pending >= MAX_CHALLENGES_PER_OWNER:
                raise ResourceExhausted(
                    f"shm_name: {pending} nonces of this caller are outstanding; register with"
                    f" them or let them expire ({NONCE_TTL_S} s)"
                )
            nonce = secrets.token_bytes(NONCE_BYTES)
            self._challenges[nonce] = _Challenge(owner, shm_name, offset, now + NONCE_TTL_S)
        return nonce

    def _take_challenge(self, owner: str, shm_name: str, offset: int, nonce: bytes) -> None:
        """Consume ``nonce``: it must be one issued to ``owner`` for this object and offset."""
        if not nonce:
            raise FailedPrecondition(
                "nonce: a registration needs proof that the caller can write the memory: call"
                " ChallengeRegion, write its nonce at the region's first bytes, send it here"
            )
        with self._lock:
            issued = self._challenges.pop(nonce, None)
        if (
            issued is None
            or issued.expires <= time.monotonic()
            or (issued.owner, issued.shm_name, issued.offset) != (owner, shm_name, offset)
        ):
            raise PermissionDenied(
                "nonce: not a nonce this server issued to this caller for this shm_name and"
                " offset, or it expired or was used; call ChallengeRegion again"
            )

    def register(
        self,
        owner: str,
        name: str,
        shm_name: str,
        offset: int,
        byte_size: int,
        nonce: bytes,
    ) -> RegionInfo:
        """Open ``shm_name`` and register ``[offset, offset + byte_size)`` of it as ``name``,
        once the object holds ``nonce`` (from :meth:`challenge`) at ``offset``."""
        if not name or len(name) > MAX_REGION_NAME_CHARS:
            raise InvalidArgument("name", f"must be 1 to {MAX_REGION_NAME_CHARS} characters")
        _check_shm_name(shm_name)
        if byte_size <= 0:
            raise InvalidArgument("byte_size", "must be > 0")
        if byte_size < len(nonce):
            raise InvalidArgument("byte_size", f"must be >= {len(nonce)} (the nonce's bytes)")
        # Spent only once the arguments hold: a malformed request is no attempt.
        self._take_challenge(owner, shm_name, offset, nonce)
        with self._lock:
            self._check_room(owner, name)
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
            # Read from the descriptor the region keeps: the object proven is the one served.
            held = os.pread(fd, len(nonce), offset)
            if not hmac.compare_digest(held, nonce):
                raise PermissionDenied(
                    f"nonce: {shm_name!r} does not hold the nonce at offset {offset}: only"
                    " memory the caller has written it into can be registered"
                )
            info = RegionInfo(name, shm_name, offset, byte_size)
            region = Region(owner, info, fd)
            with self._lock:
                self._check_room(owner, name)  # again: concurrent calls may have taken it
                self._regions[owner, name] = region
        except BaseException:
            os.close(fd)
            raise
        return info

    def _check_room(self, owner: str, name: str) -> None:
        """``name`` is free, and the caller and the server may hold one more region (under
        the lock)."""
        if (owner, name) in self._regions:
            raise AlreadyExists(f"name: region {name!r} is already registered")
        if sum(r.owner == owner for r in self._regions.values()) >= MAX_REGIONS_PER_OWNER:
            raise ResourceExhausted(
                f"name: at most {MAX_REGIONS_PER_OWNER} regions per caller; unregister some"
            )
        if len(self._regions) >= self.max_regions:
            raise ResourceExhausted(
                f"name: this server holds its limit of {self.max_regions} regions"
                " (--max-regions); unregister some"
            )

    def get(self, owner: str, name: str, field: str) -> Region:
        """The caller's region ``name``, with a use taken (``release_use`` when done)."""
        with self._lock:
            region = self._regions.get((owner, name))
        if region is None:
            raise NotFound(f"{field}: no region {name!r} is registered")
        region.acquire(field)
        return region

    def unregister(self, owner: str, name: str) -> int:
        """Release ``name`` (or every region of ``owner`` for an empty name); returns how many."""
        with self._lock:
            if name:
                region = self._regions.pop((owner, name), None)
                if region is None:
                    raise NotFound(f"name: no region {name!r} is registered")
                released = [region]
            else:
                released = [r for r in self._regions.values() if r.owner == owner]
                for region in released:
                    del self._regions[owner, region.info.name]
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
