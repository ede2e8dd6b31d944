# SPDX-License-Identifier: Apache-2.0
"""Row updates of compressed tables: copy-on-write per 32-row block, into a spill area.

The compact layout addresses rows through per-block bases, so an updated row moves with its whole
block: the affected blocks are decoded, the new rows put in, the blocks re-encoded with the
table's existing masks (``ibp_compress``, so the table stays lossless whatever the new values) and
appended to a spill area past the end of the payload; the new version's index points at them.
Bytes a published version can read are never written, which is what makes the update atomic
without reader locks (an in-place overwrite, even of a same-size slot, would be seen half-done by
a concurrent lookup). The spill area is spare capacity of one buffer shared by successive
versions; when it is full, when block 0 changes (the layout pins block 0 at offset 0) or on the
first update of a memory-mapped table, the table is compacted into a fresh buffer with new spare
room (and its masks copied, so nothing of a mapped file stays referenced). Each update also copies
the small index (about 1.4 bytes per row).

A decoded tier's rows take their new bits the same way, in spare slots of a buffer the versions
share (:mod:`ibpembed.tables.tier_versions`).

:class:`RowUpdates` builds the updated tables; publishing them is the caller's
(:meth:`ibpembed.tables.store.TableStore.update_rows`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ibpembed import layout
from ibpembed._ops import ops
from ibpembed.codec import CompressedTable
from ibpembed.tables import _layout, tier_versions

# Spare payload bytes a compaction reserves for later spills: this fraction of the payload, and
# at least enough for a few updates like the one that triggered it.
SPILL_FRACTION = 8
MIN_SPILL_BYTES = 1 << 16


@dataclass(frozen=True, eq=False)
class Spill:
    """The buffer under ``table``'s payload; bytes past the payload's end are free."""

    table: CompressedTable
    buffer: torch.Tensor


class RowUpdates:
    """The spill buffers of a store's updated tables, by table name.

    Not locked: the store calls every method under its write lock, which also keeps two updates
    from appending to one spare area at once.
    """

    def __init__(self) -> None:
        self._spill: dict[str, Spill] = {}

    def __contains__(self, name: str) -> bool:
        """Whether table ``name`` has row updates held only in memory."""
        return name in self._spill

    def prepare(
        self,
        name: str,
        old: CompressedTable,
        ids: torch.Tensor,
        rows: torch.Tensor,
        tier_spare: torch.Tensor | None,
    ) -> tuple[Spill, torch.Tensor | None] | None:
        """Table ``name`` (held as ``old``) with rows ``ids`` replaced by ``rows``, with the
        buffer under its payload, and the one under its tier's rows (``tier_spare``:
        ``TierSpares.spare`` of ``old``); None when ``ids`` is empty. Checks the arguments first
        (TypeError, ValueError). Pass the spill to :meth:`commit`, the tier's buffer to
        ``TierSpares.commit``, once the table is published."""
        ids, rows = _check_update(old, ids, rows)
        if ids.numel() == 0:
            return None
        update = _apply(old, ids, rows, self._spill.get(name))
        hot, tier = tier_versions.updated(old, ids, rows, tier_spare)
        return Spill(dataclasses.replace(update.table, hot=hot), update.buffer), tier

    def commit(self, name: str, update: Spill) -> None:
        """``update`` is published: later updates of ``name`` append to its spare area."""
        self._spill[name] = update

    def republished(self, name: str, old: CompressedTable, new: CompressedTable) -> None:
        """``new``, read from the same payload as ``old`` (other decoded tiers), replaced it."""
        spill = self._spill.get(name)
        if spill is not None and spill.table is old:
            # Same payload: later row updates keep appending to its spare area.
            self._spill[name] = Spill(new, spill.buffer)

    def forget(self, name: str) -> None:
        """Table ``name`` was replaced by one without these updates."""
        self._spill.pop(name, None)

    def clear(self) -> None:
        """Every table was replaced (a reload)."""
        self._spill.clear()


def _apply(
    old: CompressedTable, ids: torch.Tensor, rows: torch.Tensor, spill: Spill | None
) -> Spill:
    """The table with the rows replaced (its tier still ``old``'s), and the buffer under its
    payload."""
    blocks = torch.unique(torch.div(ids, layout.ROWS_PER_BLOCK, rounding_mode="floor"))
    # Every row of the affected blocks, in order; only the table's last block can be short,
    # and it sorts last, so these rows form whole blocks of a small table of their own.
    block_rows = (
        blocks[:, None] * layout.ROWS_PER_BLOCK + torch.arange(layout.ROWS_PER_BLOCK)
    ).flatten()
    block_rows = block_rows[block_rows < old.num_rows]
    decoded = old.gather(block_rows).view(torch.uint8).reshape(block_rows.numel(), -1)
    decoded[torch.searchsorted(block_rows, ids)] = rows.view(torch.uint8).reshape(ids.numel(), -1)
    payload, base, units, bitmask = ops.ibp_compress(
        decoded, old.chunk_bits, old.mask, old.bitval, old.unit_bytes
    )
    row_units = old.row_units.clone()
    row_units.view(-1, layout.ROWS_PER_BLOCK)[blocks] = units.view(-1, layout.ROWS_PER_BLOCK)
    new_bitmask = old.bitmask.clone()
    new_bitmask[blocks] = bitmask
    added = int(base[-1])
    end = _layout.payload_end(old)
    start = end + layout.PAYLOAD_PAD  # past the pad the previous version may read ahead into
    mask, bitval = old.mask, old.bitval
    if (
        spill is not None
        and spill.table is old
        and int(blocks[0]) != 0
        and start + added + layout.PAYLOAD_PAD <= spill.buffer.numel()
    ):
        buffer = spill.buffer
        buffer[start : start + added] = payload[:added]
        block_base = old.block_base.clone()
        block_base[blocks] = base[:-1] + start
        block_base[-1] = start + added
    else:
        lengths = _layout.block_bytes(row_units, old.unit_bytes)
        source = torch.zeros_like(lengths)
        source[blocks] = 1
        offsets = old.block_base[:-1].clone()
        offsets[blocks] = base[:-1]
        reserve = max(end // SPILL_FRACTION, 8 * (added + layout.PAYLOAD_PAD), MIN_SPILL_BYTES)
        buffer, block_base = _layout.assemble(
            [old.payload, payload],
            source,
            offsets,
            lengths,
            reserve=reserve,
        )
        # The masks too get memory of their own: views of a mapped file would keep the
        # whole mapping (and the file's disk space, once a pack deletes it) alive.
        mask, bitval = old.mask.clone(), old.bitval.clone()
    new_end = int(block_base[-1])
    table = dataclasses.replace(
        old,
        payload=buffer[: new_end + layout.PAYLOAD_PAD],
        block_base=block_base,
        row_units=row_units,
        bitmask=new_bitmask,
        mask=mask,
        bitval=bitval,
    )
    return Spill(table, buffer)


def _check_update(
    table: CompressedTable, ids: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError("ids must be an integer tensor")
    if not isinstance(rows, torch.Tensor):
        raise TypeError("rows must be a tensor")
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    ids = ids.to(device="cpu", dtype=torch.int64)
    if rows.dtype != table.dtype or tuple(rows.shape) != (ids.numel(), table.dim):
        raise ValueError(
            f"rows must be {table.dtype} [{ids.numel()}, {table.dim}], got {rows.dtype} "
            f"{list(rows.shape)}"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.num_rows):
        raise ValueError(f"ids must lie in [0, {table.num_rows})")
    order = torch.argsort(ids)
    ids = ids[order]
    if bool((ids[1:] == ids[:-1]).any()):
        raise ValueError("ids must be distinct (the new value of a repeated id is ambiguous)")
    return ids, rows.detach().to("cpu")[order].contiguous()
