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
from typing import TYPE_CHECKING

import torch

from ibpembed import CompressedTable
from ibpembed.layout import INT8_ROWWISE_CODE

if TYPE_CHECKING:
    from ibpembed.engine.hbm_tier import TierArrays

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


class _DeviceTier(ctypes.Structure):
    """csrc/cuda/kernels.h's DeviceTier."""

    _fields_ = [
        ("dir", _P),
        ("slot_offset", _P),
        ("payload", _P),
        ("payload_bytes", _I64),
        ("num_slots", _I64),
        ("counters", _P),
    ]


@dataclass(frozen=True)
class Tier:
    """An HBM tier as the kernels read it (host tensors here): the rank directory, the
    compressed form's slot offsets (None: decoded), the payload and the slot count
    (``ibpembed.engine.hbm_tier.TierArrays``), and an int64 [2] tensor the kernels add their
    hits and misses to."""

    directory: torch.Tensor
    slot_offset: torch.Tensor | None
    payload: torch.Tensor
    num_slots: int
    counters: torch.Tensor

    @classmethod
    def of(cls, arrays: TierArrays, counters: torch.Tensor | None = None) -> Tier:
        """The tier of ``arrays`` (its tensors, not copies), counting into ``counters`` (a
        new zero array when None)."""
        if counters is None:
            counters = torch.zeros(2, dtype=torch.int64)
        return cls(arrays.directory, arrays.slot_offset, arrays.payload, arrays.num_slots, counters)

    def struct(self) -> _DeviceTier:
        assert self.payload.data_ptr() % 16 == 0, "a tier's payload must be 16-byte aligned"
        return _DeviceTier(
            self.directory.data_ptr(),
            None if self.slot_offset is None else self.slot_offset.data_ptr(),
            self.payload.data_ptr(),
            self.payload.numel(),
            self.num_slots,
            self.counters.data_ptr(),
        )


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
        self.lib.simt_gather.argtypes = [*_TABLE_ARGS, _P, _P, _P, _I64, _P, _I, *_LAUNCH_ARGS]
        # Per-table arrays (payload .. unit_bytes), chunk_bits, dtypes, single, the parts, the
        # batch, then the launch.
        self.lib.simt_pooled.argtypes = [
            _I,
            *([_P] * 11),
            _I,
            _P,
            _P,
            _I,
            _I,
            _P,
            _P,
            _P,
            _P,
            _I,
            _P,
            _P,
            _I64,
            _I64,
            _P,
            *_LAUNCH_ARGS,
        ]
        self.lib.simt_selftest.argtypes = [_I, ctypes.c_char_p, _I]
        self.lib.simt_launch_shape.argtypes = [_I, _I64, _I, _I64, ctypes.POINTER(_I)]
        self.lib.simt_launch_shape.restype = _I64

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
        decode: bool = True,
        tier: Tier | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Rows [n, row_bytes] uint8 and the kernel's error word; ids None: the whole table.
        ``sort=False`` passes the ids as they come and no perm, as the CUDA op does for
        gathers below IBPEMBED_CUDA_SORT_MIN_IDS ids. ``decode=False``: the copy-without-decode
        mode (IBPEMBED_CUDA_DECODE=copy), a compressed row's slot bytes at the front of its
        output row (the rest stays zero). ``tier``: the table's HBM tier."""
        if ids is None:
            sorted_ids, perm, n = None, None, c.num_rows
        elif not sort:
            sorted_ids, perm, n = ids.to(torch.int64).contiguous(), None, ids.numel()
        else:
            sorted_ids, perm = torch.sort(ids.to(torch.int64).contiguous())
            n = ids.numel()
        out = torch.zeros(n, c.row_bytes, dtype=torch.uint8)
        tier_struct = None if tier is None else tier.struct()
        tier_arg = None if tier_struct is None else ctypes.cast(ctypes.pointer(tier_struct), _P)
        args = (tier_arg, _ptr(sorted_ids), _ptr(perm), n, _ptr(out), int(decode))
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
        *,
        tier: Tier | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Pooled rows [B, D] float32 and the kernel's error word: one table, passed by value,
        as the op of one table launches the kernel; with a ``tier``, as a set of one table."""
        bags = offsets.numel() - 1
        outs, error = self.pooled_tables(
            [(c, dtype_code)],
            [(0, 0, bags)],
            ids,
            offsets,
            weights,
            pooling_code,
            grid,
            # The op of one table reads no tier: a tier comes with a set's launch.
            single=tier is None,
            tiers=None if tier is None else [tier],
        )
        return outs[0], error

    def pooled_tables(
        self,
        tables: list[tuple[CompressedTable, int]],
        parts: list[tuple[int, int, int]],
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        pooling_code: int,
        grid: Grid = Grid(),
        *,
        single: bool = False,
        tiers: list[Tier | None] | None = None,
    ) -> tuple[list[torch.Tensor], int]:
        """One launch over several tables of one chunk width (``tables``: (table, dtype code)),
        as lookup_pooled_tables launches it: part k = (table index, first bag, bag count) pools
        those bags of the batch. ``tiers``: each table's HBM tier (or None). Returns each
        part's [bag count, D] float32 and the error word."""
        ids = ids.to(torch.int64).contiguous()
        offsets = offsets.to(torch.int64).contiguous()
        chunk_bits = {c.chunk_bits for c, _ in tables}
        assert len(chunk_bits) == 1, "one launch decodes one chunk width"
        for c, _ in tables:
            assert c.payload.data_ptr() % 16 == 0, "payload must be 16-byte aligned"

        def dim(c: CompressedTable, code: int) -> int:
            # Row-wise int8 rows pool the codes after their 4-byte scale and bias.
            return c.row_bytes - 4 if code == INT8_ROWWISE_CODE else c.dim

        outs = [  # every element must be written
            torch.full((count, dim(*tables[t])), float("nan")) for t, _, count in parts
        ]

        def pointers(ts: list[torch.Tensor]) -> ctypes.Array:
            return (ctypes.c_void_p * len(ts))(*(t.data_ptr() for t in ts))

        def int64s(values: list[int]) -> ctypes.Array:
            return (ctypes.c_int64 * len(values))(*values)

        cs = [c for c, _ in tables]
        tier_array = None
        if tiers is not None:
            none = _DeviceTier(None, None, None, 0, 0, None)
            tier_array = (_DeviceTier * len(tiers))(
                *(none if t is None else t.struct() for t in tiers)
            )
        args = (
            len(tables),
            pointers([c.payload for c in cs]),
            int64s([c.payload.numel() for c in cs]),
            pointers([c.block_base for c in cs]),
            pointers([c.row_units for c in cs]),
            pointers([c.bitmask for c in cs]),
            pointers([c.mask for c in cs]),
            pointers([c.bitval for c in cs]),
            int64s([c.bitval.numel() for c in cs]),
            int64s([c.num_rows for c in cs]),
            int64s([c.row_bytes for c in cs]),
            int64s([c.unit_bytes for c in cs]),
            chunk_bits.pop(),
            None if tier_array is None else ctypes.cast(tier_array, _P),
            (ctypes.c_int * len(tables))(*(code for _, code in tables)),
            int(single),
            len(parts),
            (ctypes.c_int32 * len(parts))(*(t for t, _, _ in parts)),
            int64s([first for _, first, _ in parts]),
            int64s([count for _, _, count in parts]),
            pointers(outs),
            pooling_code,
            _ptr(ids),
            _ptr(offsets),
            offsets.numel() - 1,
            ids.numel(),
            _ptr(weights),
        )
        message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        launch = (grid.blocks, grid.warps, int(grid.async_copies), message, _MESSAGE_BYTES)
        rc = self.lib.simt_pooled(*args, *launch)
        if rc < 0:
            raise EmulationError(message.value.decode())
        return outs, rc

    def launch_shape(
        self, max_warps: int, resident_blocks: int, sms: int, work_items: int
    ) -> tuple[int, int]:
        """(warps per block, blocks) the CUDA launchers pick (csrc/cuda/launch_shape.h)."""
        warps = _I(0)
        blocks = self.lib.simt_launch_shape(
            max_warps, resident_blocks, sms, work_items, ctypes.byref(warps)
        )
        return warps.value, blocks

    def selftest(self, case: int) -> tuple[int, str]:
        """Runs one of simt_selftest.cpp's toy kernels: (its result, the emulator's failure)."""
        message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        result = self.lib.simt_selftest(case, message, _MESSAGE_BYTES)
        return result, message.value.decode()
