# SPDX-License-Identifier: Apache-2.0
"""ibpembed: lossless Invariant-Bit-Packing compressed embedding tables and lookups."""

from importlib.metadata import PackageNotFoundError, version

from ibpembed.codec import CompressedTable, compress, cpu_path

__all__ = ["CompressedTable", "compress", "cpu_path"]
try:  # one source: clients/python/VERSION, read by both packages' builds
    __version__ = version("ibpembed")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "unknown"
