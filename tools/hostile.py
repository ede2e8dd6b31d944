# SPDX-License-Identifier: Apache-2.0
"""Hostile inputs the server's tests and the security campaign share: another process's shm
object that no caller may reach, and request messages no client library would build."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator

# 32 bytes the victim process keeps at the start of its shm object.
SECRET = b"victim-secret-0123456789abcdef!!"
# The victim: creates an object only its user may open, holds it until stdin ends.
_VICTIM = """
import os, sys
fd = os.open("/dev/shm" + sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 1 << 16)
os.pwrite(fd, sys.argv[2].encode(), 0)
print("ready", flush=True)
sys.stdin.read()
os.unlink("/dev/shm" + sys.argv[1])
"""


@contextlib.contextmanager
def victim_object() -> Iterator[str]:
    """The shm name of another process's object holding SECRET (mode 0600, its user only),
    removed with the process on exit."""
    name = f"/ibpembed-victim-{uuid.uuid4().hex[:10]}"
    process = subprocess.Popen(
        [sys.executable, "-c", _VICTIM, name, SECRET.decode()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready = process.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the victim process did not create {name}: {ready!r}")
        yield name
    finally:
        process.stdin.close()
        process.wait(timeout=30)


def _varint(value: int) -> bytes:
    # Not server/wire.py's encoder: a probe of the server builds its bytes without its code.
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def feature_names_request(count: int) -> bytes:
    """A serialized LookupRequest naming ``count`` features (f0, f1, ...) with no ids, written
    directly: building a million of them through protobuf takes longer than the server does."""

    def feature(name: bytes) -> bytes:
        inner = b"\x0a" + _varint(len(name)) + name
        return b"\x1a" + _varint(len(inner)) + inner

    return b"".join(feature(b"f%d" % i) for i in range(count))
