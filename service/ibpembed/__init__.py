# SPDX-License-Identifier: Apache-2.0
"""ibpembed: lossless Invariant-Bit-Packing compressed embedding tables and lookups."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["CompressedTable", "FitOptions", "compress", "cpu_path"]
try:  # one source: clients/python/VERSION, read by both packages' builds
    __version__ = version("ibpembed")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "unknown"


def __getattr__(name: str) -> Any:
    # The codec imports torch (over a second): loaded on first use, so that `ibpembed --help`,
    # `--version` and the torch-free parts of the package start without it.
    if name in __all__:
        return getattr(importlib.import_module("ibpembed.codec"), name)
    raise AttributeError(f"module 'ibpembed' has no attribute {name!r}")
