# SPDX-License-Identifier: Apache-2.0
"""The server's malloc settings take on glibc, and 0 leaves malloc alone."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from ibpembed.server.memory import keep_freed_memory

GLIBC = platform.libc_ver()[0] == "glibc"


def test_zero_leaves_malloc_alone() -> None:
    assert keep_freed_memory(0) is False


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_large_blocks_come_from_the_heap_after_the_settings() -> None:
    """A freed 8 MiB block is handed out again (same address) once the settings took; with
    glibc's defaults at process start such a block is a fresh mapping, released on free."""
    script = """
import ctypes, ctypes.util, sys
from ibpembed.server.memory import keep_freed_memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
assert keep_freed_memory(256)
a = libc.malloc(8 << 20); libc.free(a)
b = libc.malloc(8 << 20); libc.free(b)
print(int(a == b))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "1"
