# SPDX-License-Identifier: Apache-2.0
"""A table's layout for a GPU that reads it zero-copy over PCIe: one that never costs more on
the wire than raw rows.

A warp's zero-copy read becomes one PCIe request per 128-byte line it touches, carrying the
32-byte sectors it touches. Compact slots start at any unit offset, so a compressed slot touches
about half a line more than a raw row at a multiple of its size, which eats most of what
compression saves at 256-1024-byte rows (docs/cuda.md, *What compression saves on the wire*).
Two remedies, neither a format change:

- **Line-aware placement** (:func:`line_aware`): a slot starts at the next 32-byte boundary
  where that lowers the lines it touches. format.h lets a compressed slot be longer than its
  encoding as long as it stays shorter than a raw slot, so the gap goes to the slot before it
  (whose decoders read only its encoding), at a point or two of host savings.
- **Raw where compression loses** (:func:`for_gpu`): when even the best compressed layout
  touches more sectors than the raw rows (64-byte fp32 rows: about 0.73 times the sectors
  saved), the table is stored raw.

``pack --for-gpu`` applies :func:`for_gpu` and records its decision and why in the file's meta
(``gpu_layout``), which ``inspect`` prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ibpembed import layout
from ibpembed._ops import ops
from ibpembed.codec import CompressedTable

SECTOR = 32
LINE = 128


@dataclass(frozen=True)
class WireCost:
    """Sectors and lines a gather of every row once touches, for a layout and for raw rows at
    multiples of the row size (the raw layout)."""

    sectors: int
    lines: int
    raw_sectors: int
    raw_lines: int

    @property
    def sector_ratio(self) -> float:
        """Raw sectors per compressed sector: > 1 when the layout saves wire bytes."""
        return self.raw_sectors / self.sectors

    @property
    def line_ratio(self) -> float:
        """Raw lines per compressed line: > 1 when the layout saves PCIe requests."""
        return self.raw_lines / self.lines


def slot_offsets(t: CompressedTable) -> tuple[np.ndarray, np.ndarray]:
    """Every row's slot offset in the payload and its size, in bytes (int64 [num_rows] each)."""
    sizes = t.row_units.numpy().astype(np.int64) * t.unit_bytes
    blocks = sizes.reshape(-1, layout.ROWS_PER_BLOCK)
    within = np.cumsum(blocks, axis=1) - blocks
    offsets = t.block_base.numpy()[: blocks.shape[0], None] + within
    return offsets.reshape(-1)[: t.num_rows], sizes[: t.num_rows]


def _touched(offsets: np.ndarray, sizes: np.ndarray, unit: int) -> int:
    return int(((offsets % unit + sizes + unit - 1) // unit).sum())


def wire_cost(t: CompressedTable) -> WireCost:
    offsets, sizes = slot_offsets(t)
    raw = np.arange(t.num_rows, dtype=np.int64) * t.row_bytes
    row = np.full(t.num_rows, t.row_bytes, dtype=np.int64)
    return WireCost(
        sectors=_touched(offsets, sizes, SECTOR),
        lines=_touched(offsets, sizes, LINE),
        raw_sectors=_touched(raw, row, SECTOR),
        raw_lines=_touched(raw, row, LINE),
    )


def line_aware(t: CompressedTable) -> CompressedTable:
    """``t`` with each slot moved to the next 32-byte boundary where that lowers the lines it
    touches and the slot before it can grow by the gap (it is compressed and stays shorter than a
    raw slot). Compact, with the same rows bit for bit; the padding bytes are zero.

    Each slot's place depends on where the one before it ended, so the placement is one
    sequential pass: the ``ibp_line_aware`` op (csrc/ops/layout_ops.cpp), about 0.12 us a row
    with the copy, where a Python loop took 2-3.5 us."""
    payload, block_base, row_units = ops.ibp_line_aware(
        t.payload,
        t.block_base,
        t.row_units,
        t.row_bytes,
        t.unit_bytes,
        t.num_rows,
    )
    return dataclasses.replace(
        t, payload=payload, block_base=block_base, row_units=row_units, hot=None
    )


def for_gpu(
    t: CompressedTable, raw: Callable[[], CompressedTable]
) -> tuple[CompressedTable, dict[str, Any]]:
    """The layout a GPU should read: ``t`` as it is, line-aware (:func:`line_aware`, where that
    touches fewer lines), or ``raw()`` (the table stored raw) when the better compressed layout
    touches more 32-byte sectors than raw rows. With the decision and why, for the file's meta."""
    compact = wire_cost(t)
    padded_table = line_aware(t)
    padded = wire_cost(padded_table)
    best, cost, name = (
        (padded_table, padded, "line-aware")
        if padded.lines < compact.lines
        else (t, compact, "compact")
    )
    facts = {
        "sector_ratio": round(cost.sector_ratio, 4),
        "line_ratio": round(cost.line_ratio, 4),
        "compact_line_ratio": round(compact.line_ratio, 4),
        "host_bytes_ratio": round(t.raw_bytes / (best.payload_bytes + best.index_bytes), 4),
    }
    if cost.sector_ratio < 1:
        why = (
            f"stored raw: its best compressed layout ({name}) touches {1 / cost.sector_ratio:.2f}x "
            "the 32-byte sectors of raw rows, so a GPU would read more over PCIe"
        )
        return raw(), {"layout": "raw", "reason": why, **facts}
    if name == "line-aware":
        why = (
            f"line-aware: slots moved to 32-byte boundaries touch {padded.lines:,} lines, "
            f"not {compact.lines:,} (raw rows: {compact.raw_lines:,})"
        )
    else:
        why = "compact: moving slots to 32-byte boundaries would not lower the lines they touch"
    return best, {"layout": name, "reason": why, **facts}
