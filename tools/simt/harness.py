# SPDX-License-Identifier: Apache-2.0
"""Builds the host SIMT emulation of the CUDA kernels and calls it on CPU tensors.

`build()` compiles simt_kernels.cpp (the kernels of csrc/cuda, force-including simt.h) and
simt_selftest.cpp into one shared library with the system C++ compiler; `EmulatedKernels` wraps
its C entry points the way the CUDA op bindings wrap the real launches: the gather's ids are
sorted first and `perm` sends each row back to its request position.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ibpembed import CompressedTable
from ibpembed._ops import INT8_ROWWISE_CODE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CXX = os.environ.get("CXX", "g++")
SOURCES = ("simt_kernels.cpp", "simt_selftest.cpp")

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int
_TABLE_ARGS = [_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I]
_LAUNCH_ARGS = [_I, _I, _I, ctypes.c_char_p, _I]
_MESSAGE_BYTES = 1024


def build(out_dir: Path) -> Path:
    """Compiles the emulator library into out_dir; raises with the compiler's output on failure."""
    lib = out_dir / "libibpembed_simt.so"
    command = [
        CXX,
        "-std=c++20",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unknown-pragmas",  # the kernels' #pragma unroll
        "-ffp-contract=off",  # no FMA: the kernels round every multiply and add
        "-fPIC",
        "-shared",
        "-pthread",
        "-DIBPEMBED_SIMT",
        "-include",
        str(HERE / "simt.h"),
        f"-I{ROOT / 'csrc' / 'include'}",
        f"-I{HERE / 'include'}",
        *(str(HERE / s) for s in SOURCES),
        "-o",
        str(lib),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"building the SIMT emulator failed:\n{result.stderr}")
    return lib


class EmulationError(RuntimeError):
    """The emulator stopped a launch: divergent collectives, a deadlock, an out-of-bounds copy."""


@dataclass(frozen=True)
class Grid:
    """The launch shape: the kernels loop over their work with a grid stride."""

    blocks: int = 2
    warps: int = 2
    async_copies: bool = True


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class EmulatedKernels:
    """The gather and pooled CUDA kernels, run by the emulator on a CompressedTable's tensors."""

    def __init__(self, lib_path: Path) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.simt_gather.argtypes = [*_TABLE_ARGS, _P, _P, _I64, _P, *_LAUNCH_ARGS]
        self.lib.simt_pooled.argtypes = [
            *_TABLE_ARGS,
            *(_I, _I, _P, _P, _I64, _I64, _P, _P),
            *_LAUNCH_ARGS,
        ]
        self.lib.simt_selftest.argtypes = [_I, ctypes.c_char_p, _I]

    @staticmethod
    def _table_args(c: CompressedTable) -> list:
        # The kernels stage 16-byte-aligned windows of the payload, as the CUDA op insists.
        assert c.payload.data_ptr() % 16 == 0, "payload must be 16-byte aligned"
        return [
            _ptr(c.payload),
            c.payload.numel(),
            _ptr(c.block_base),
            _ptr(c.row_units),
            _ptr(c.bitmask),
            _ptr(c.mask),
            _ptr(c.bitval),
            c.bitval.numel(),
            c.num_rows,
            c.row_bytes,
            c.unit_bytes,
            c.chunk_bits,
        ]

    def _launch(
        self, entry: Callable[..., int], c: CompressedTable, args: tuple, grid: Grid
    ) -> int:
        """Calls an entry point with the table, its own arguments and the grid; returns the
        kernel's error word or raises EmulationError."""
        message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        launch = (grid.blocks, grid.warps, int(grid.async_copies), message, _MESSAGE_BYTES)
        rc = entry(*self._table_args(c), *args, *launch)
        if rc < 0:
            raise EmulationError(message.value.decode())
        return rc

    def gather(
        self,
        c: CompressedTable,
        ids: torch.Tensor | None,
        grid: Grid = Grid(),
        *,
        sort: bool = True,
    ) -> tuple[torch.Tensor, int]:
        """Rows [n, row_bytes] uint8 and the kernel's error word; ids None: the whole table.
        ``sort=False`` passes the ids as they come and no perm, as the CUDA op does for
        gathers below IBPEMBED_CUDA_SORT_MIN_IDS ids."""
        if ids is None:
            sorted_ids, perm, n = None, None, c.num_rows
        elif not sort:
            sorted_ids, perm, n = ids.to(torch.int64).contiguous(), None, ids.numel()
        else:
            sorted_ids, perm = torch.sort(ids.to(torch.int64).contiguous())
            n = ids.numel()
        out = torch.zeros(n, c.row_bytes, dtype=torch.uint8)
        args = (_ptr(sorted_ids), _ptr(perm), n, _ptr(out))
        return out, self._launch(self.lib.simt_gather, c, args, grid)

    def pooled(
        self,
        c: CompressedTable,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        dtype_code: int,
        pooling_code: int,
        grid: Grid = Grid(),
    ) -> tuple[torch.Tensor, int]:
        """Pooled rows [B, D] float32 and the kernel's error word."""
        ids = ids.to(torch.int64).contiguous()
        offsets = offsets.to(torch.int64).contiguous()
        bags = offsets.numel() - 1
        # Row-wise int8 rows pool the codes after their 4-byte scale and bias.
        dim = c.row_bytes - 4 if dtype_code == INT8_ROWWISE_CODE else c.dim
        out = torch.full((bags, dim), float("nan"))  # every element must be written
        args = (
            dtype_code,
            pooling_code,
            _ptr(ids),
            _ptr(offsets),
            bags,
            ids.numel(),
            _ptr(weights),
            _ptr(out),
        )
        return out, self._launch(self.lib.simt_pooled, c, args, grid)

    def selftest(self, case: int) -> tuple[int, str]:
        """Runs one of simt_selftest.cpp's toy kernels: (its result, the emulator's failure)."""
        message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        result = self.lib.simt_selftest(case, message, _MESSAGE_BYTES)
        return result, message.value.decode()
