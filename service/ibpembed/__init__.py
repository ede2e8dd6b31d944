# SPDX-License-Identifier: Apache-2.0
"""ibpembed: lossless Invariant-Bit-Packing compressed embedding tables and lookups."""

from ibpembed.codec import CompressedTable, compress, cpu_path

__all__ = ["CompressedTable", "compress", "cpu_path"]
__version__ = "0.1.0"
