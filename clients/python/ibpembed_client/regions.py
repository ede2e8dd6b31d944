# SPDX-License-Identifier: Apache-2.0
"""Same-host shared memory for lookups: outputs written by the server straight into the
frontend's memory, returned as numpy views (no copy, no bytes on the socket).

>>> with SharedMemoryRegion.create("/frontend-0", 64 << 20) as shm, LookupClient(target) as c:
...     c.register_region("out", shm)
...     result = c.lookup(features, output_region="out")    # views into shm
...     dense = np.concatenate([result[f] for f in features], axis=1)   # the one copy, if any

The region is the caller's: it creates, sizes and unlinks the shm object; the server only opens
it while registered, and only once the caller has proven it can write it (``register_region``
writes a server-issued nonce at the region's first bytes; they are the caller's again after).
A result's arrays are views of the region and are overwritten by the next lookup that writes
the same bytes: copy what must outlive that, or give concurrent lookups disjoint parts
(``OutputRegion(name, offset, byte_size)``).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from dataclasses import dataclass

import numpy as np

from ibpembed_client.v1 import lookup_pb2 as pb

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class OutputRegion:
    """Where a lookup writes its outputs: ``[offset, offset + byte_size)`` of registered region
    ``name`` (``byte_size=0``: to the region's end)."""

    name: str
    offset: int = 0
    byte_size: int = 0


class SharedMemoryRegion:
    """A POSIX shared-memory object mapped into this process.

    Parameters
    ----------
    shm_name : POSIX name, ``"/"`` then a file name.
    size : bytes of the object (mapped whole).
    owner : whether :meth:`close` unlinks it (objects made by :meth:`create`).
    """

    def __init__(self, shm_name: str, size: int, *, owner: bool = False) -> None:
        if not shm_name.startswith("/") or "/" in shm_name[1:] or len(shm_name) < 2:
            raise ValueError(f"{shm_name!r} is not a POSIX shm name ('/name')")
        self.shm_name = shm_name
        self.size = size
        self.owner = owner
        fd = os.open(SHM_DIR + shm_name, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # One export of the mapping, sliced per result: np.frombuffer on the mmap per feature
        # cost more than the rest of a B=1 response's decoding.
        self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)

    @classmethod
    def create(cls, shm_name: str, size: int, *, mode: int = 0o600) -> SharedMemoryRegion:
        """A new object of ``size`` bytes, unlinked again by :meth:`close`. ``mode``: its
        permissions (default this user only; a server running as another user needs its group
        or others to read and write, e.g. ``0o660`` with a shared group)."""
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(SHM_DIR + shm_name, flags, mode)
        try:
            os.fchmod(fd, mode)  # exactly ``mode``: open() applied the umask
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(SHM_DIR + shm_name)
            raise
        os.close(fd)
        return cls(shm_name, size, owner=True)

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A view of ``shape`` ``dtype`` values from byte ``offset`` of the object."""
        dtype = np.dtype(dtype)
        end = offset + math.prod(shape) * dtype.itemsize
        if offset < 0 or end > self.size:
            raise ValueError(f"bytes [{offset}, {end}) are outside the {self.size}-byte object")
        return self._bytes[offset:end].view(dtype).reshape(shape)

    def write(self, offset: int, data: bytes | memoryview | np.ndarray) -> int:
        """Copy ``data`` to byte ``offset`` (inputs for ``input_region`` lookups); returns the
        end offset."""
        if isinstance(data, np.ndarray):
            # Its memoryview: numpy's stubs make an array a buffer from Python 3.12 on.
            data = np.ascontiguousarray(data).data
        raw = memoryview(data).cast("B")
        end = offset + raw.nbytes
        if offset < 0 or end > self.size:
            raise ValueError(f"bytes [{offset}, {end}) are outside the {self.size}-byte object")
        self._mmap[offset:end] = raw
        return end

    def close(self) -> None:
        """Unmap (and unlink, for the owner). Arrays still viewing the memory keep the mapping
        alive until they are gone; reading them afterwards is safe, the data stays."""
        # numpy views still exporting the buffer keep it mapped (BufferError) until they go.
        self._bytes = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mmap.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR + self.shm_name)
            self.owner = False

    def __enter__(self) -> SharedMemoryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def challenge_request(registration: pb.RegisterRegionRequest) -> pb.ChallengeRegionRequest:
    """The ChallengeRegion request for a registration: the same object and offset."""
    return pb.ChallengeRegionRequest(shm_name=registration.shm_name, offset=registration.offset)


def prove_write_access(memory: SharedMemoryRegion, offset: int, nonce: bytes) -> bytes:
    """Write the server's ``nonce`` at byte ``offset`` of ``memory`` (the region's first
    bytes), where the server reads it back before it registers the region; returns it for
    ``RegisterRegionRequest.nonce``."""
    if not nonce:
        raise ValueError("the server sent no nonce: it predates proof of write access")
    memory.write(offset, nonce)
    return nonce
