# SPDX-License-Identifier: Apache-2.0
"""Block-level views of the compact layout (format.h): block sizes, compaction, reassembly.

A payload is a sequence of 32-row blocks; ``block_base[b]`` says where block b starts and the
block's length follows from its ``row_units``. Files always hold the *compact* form (blocks in
order, back to back, ``block_base`` increasing). Row updates in the store append re-encoded
blocks past the end (a spill area), which leaves holes and a non-monotone ``block_base``; these
helpers turn any such layout back into the compact one.
"""

from __future__ import annotations

import dataclasses

import torch

from ibpembed.codec import CompressedTable
from ibpembed.layout import PAYLOAD_PAD, ROWS_PER_BLOCK

# Blocks summed per step in block_bytes: widening all of row_units to int64 at once would take
# 8 bytes per row of scratch memory.
_SUM_STEP_BLOCKS = 1 << 16


def block_bytes(row_units: torch.Tensor, unit_bytes: int) -> torch.Tensor:
    """int64 [B]: the byte length of each block's slots."""
    blocks = row_units.view(-1, ROWS_PER_BLOCK)
    total = torch.empty(blocks.shape[0], dtype=torch.int64)
    for begin in range(0, blocks.shape[0], _SUM_STEP_BLOCKS):
        step = blocks[begin : begin + _SUM_STEP_BLOCKS]
        total[begin : begin + step.shape[0]] = step.to(torch.int64).sum(1)
    return total * unit_bytes


def payload_end(table: CompressedTable) -> int:
    """Bytes of the payload the index addresses (the pad excluded)."""
    return int(table.block_base[-1])


def is_compact(table: CompressedTable) -> bool:
    """True when blocks lie in order, back to back, from offset 0, followed by the pad only."""
    lengths = block_bytes(table.row_units, table.unit_bytes)
    starts = torch.cumsum(lengths, 0) - lengths
    end = int(lengths.sum())
    return (
        bool(torch.equal(table.block_base[:-1], starts))
        and int(table.block_base[-1]) == end
        and table.payload.numel() == end + PAYLOAD_PAD
    )


def assemble(
    sources: list[torch.Tensor],
    source_of_block: torch.Tensor,
    offset_of_block: torch.Tensor,
    lengths: torch.Tensor,
    *,
    reserve: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy blocks from several payload buffers into one new compact buffer.

    Parameters
    ----------
    sources : uint8 1-D buffers the blocks are read from.
    source_of_block : int64 [B], index into ``sources`` of each block.
    offset_of_block : int64 [B], byte offset of each block in its source.
    lengths : int64 [B], byte length of each block.
    reserve : extra zero bytes allocated past the pad, for later spills.

    Returns
    -------
    (buffer, block_base): the buffer is uint8 [end + PAYLOAD_PAD + reserve] and zero past ``end``;
    ``block_base`` is int64 [B + 1] with the end as its last entry.
    """
    starts = torch.cumsum(lengths, 0) - lengths
    end = int(lengths.sum())
    buffer = torch.zeros(end + PAYLOAD_PAD + reserve, dtype=torch.uint8)
    block_base = torch.cat([starts, torch.tensor([end], dtype=torch.int64)])
    # Copy whole runs of blocks that are already adjacent in one source: after a few updates a
    # table is a handful of runs, so this is a few large memcpys rather than one per block.
    contiguous = (source_of_block[1:] == source_of_block[:-1]) & (
        offset_of_block[:-1] + lengths[:-1] == offset_of_block[1:]
    )
    breaks = torch.nonzero(~contiguous).flatten() + 1
    run_starts = [0, *breaks.tolist()]
    run_ends = [*breaks.tolist(), lengths.numel()]
    for first, stop in zip(run_starts, run_ends, strict=True):
        src = sources[int(source_of_block[first])]
        src_begin = int(offset_of_block[first])
        dst_begin = int(starts[first])
        size = int(starts[stop - 1] + lengths[stop - 1]) - dst_begin
        buffer[dst_begin : dst_begin + size] = src[src_begin : src_begin + size]
    return buffer, block_base


def compact(table: CompressedTable, *, reserve: int = 0) -> tuple[CompressedTable, torch.Tensor]:
    """The same table in the compact layout, and the buffer (with ``reserve`` spare bytes) under it.

    The returned table's payload is a view of the buffer covering exactly ``end + PAYLOAD_PAD``.
    """
    lengths = block_bytes(table.row_units, table.unit_bytes)
    buffer, block_base = assemble(
        [table.payload],
        torch.zeros_like(lengths),
        table.block_base[:-1],
        lengths,
        reserve=reserve,
    )
    end = int(block_base[-1])
    return (
        dataclasses.replace(table, payload=buffer[: end + PAYLOAD_PAD], block_base=block_base),
        buffer,
    )
