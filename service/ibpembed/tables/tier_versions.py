# SPDX-License-Identifier: Apache-2.0
"""Versions of a table's decoded tier that share one buffer: row updates and tier refreshes move
the rows of the directory words they change, not the tier.

A tier (``HotRows``) finds a row through its rank directory: per 64 table rows a bit word and
the slot of the word's first held row, the word's held rows at consecutive slots in row order
(csrc/include/ibpembed/tier.h). Nothing asks the words to sit in row order, so a new version
of the tier can keep every word it does not change where it is and write each word it changes,
its held rows with their current bits, to spare slots past every slot a published version
reads. The new version costs a copy of the directory (0.25 bytes per table row), of the ids
(8 bytes per tier row) and of at most 64 rows per changed word; older versions, which lookups
may still hold or pin, keep reading their own slots of the same buffer, never written again.

A row update changes the words of the tier rows it updates (their new bits); a refresh, the
words where rows enter or leave. Rows that leave stay in the buffer unread; when the spare slots
(an eighth of the tier's rows, ``codec.tier_spare_rows``, priced in every tier budget; a tier
of every row gets them at its first row update) run out, the tier is built again in a fresh
buffer, its rows copied from the old one.

:class:`TierSpares` tracks, per table, the buffer whose spare slots its current version may
append to; :func:`updated` and :func:`retiered` build the versions. The store publishes them
(:meth:`ibpembed.tables.store.TableStore.update_rows`, ``set_hot_rows``).
"""

from __future__ import annotations

import dataclasses

import torch

from ibpembed._ops import ops
from ibpembed.codec import TIER_SPARE_FRACTION, TIER_WORD_ROWS, CompressedTable, HotRows


class TierSpares:
    """The buffer under each table's current tier, by table name, whose slots past the current
    version's rows no published version reads.

    Not locked: the store calls every method under its write lock, and builds each new version
    from its current one, so the current version's rows always end where the buffer's written
    slots do (a version built and never published wrote past them, which nothing reads).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def spare(self, name: str, current: CompressedTable) -> torch.Tensor | None:
        """The buffer ``current`` (table ``name``'s current version) may append to, if any."""
        buffer = self._buffers.get(name)
        return buffer if _heads(current.hot, buffer) else None

    def commit(self, name: str, buffer: torch.Tensor | None) -> None:
        """A version of ``name`` whose tier heads ``buffer`` (None: none to append to) is
        published."""
        if buffer is None:
            self._buffers.pop(name, None)
        else:
            self._buffers[name] = buffer

    def forget(self, name: str) -> None:
        """Table ``name`` was replaced: its next version starts a buffer of its own."""
        self._buffers.pop(name, None)

    def clear(self) -> None:
        """Every table was replaced (a reload)."""
        self._buffers.clear()


def updated(
    old: CompressedTable, ids: torch.Tensor, rows: torch.Tensor, spare: torch.Tensor | None
) -> tuple[HotRows | None, torch.Tensor | None]:
    """``old``'s tier after rows ``ids`` (distinct, in range) became ``rows``, and the buffer
    under its rows. Tier rows take their new bits (whether the row is now stored compressed or
    raw, the tier row is exact); the tier is ``old``'s unless one of its rows changed.
    ``spare``: ``TierSpares.spare`` of ``old``."""
    hot = old.hot
    if hot is None:
        return None, None
    at = torch.searchsorted(hot.ids, ids).clamp(max=hot.count - 1)
    held = hot.ids[at] == ids
    if not bool(held.any()):
        return hot, spare
    changed = ids[held]
    new_bits = rows.view(torch.uint8).reshape(ids.numel(), -1)[held]
    words = torch.unique(torch.div(changed, TIER_WORD_ROWS, rounding_mode="floor"))
    moved = hot.ids[_word_rows(hot.ids, words)]
    used = hot.rows.shape[0]
    if spare is None or used + moved.numel() > spare.shape[0]:
        # Spare slots even for a tier of every row: it is being updated.
        rebuilt = _rebuilt(old, hot.ids, hot.coverage, hot.count // TIER_SPARE_FRACTION)
        if rebuilt is not None:
            rebuilt.rows[at[held]] = new_bits  # not yet published: nothing reads it
        return rebuilt, _buffer_of(rebuilt)
    spare[used : used + moved.numel()] = hot.rows[hot.slots(moved)]
    spare[used + torch.searchsorted(moved, changed)] = new_bits
    directory = _directory_copy(old, hot)
    directory[2 * words + 1] = used + _starts(moved, words)
    return dataclasses.replace(hot, directory=directory, rows=spare[: used + moved.numel()]), spare


def retiered(
    old: CompressedTable, ids: torch.Tensor, coverage: float, spare: torch.Tensor | None
) -> tuple[CompressedTable, torch.Tensor | None]:
    """``old`` with a tier of rows ``ids`` (``CompressedTable.with_hot_rows``'s arguments), and
    the buffer under its rows. ``spare``: ``TierSpares.spare`` of ``old``."""
    ids = old.tier_selection(ids)
    hot = old.hot
    if hot is None or ids.numel() == 0 or old.without_hot_rows()._raw_rows_as_tier[1] is not None:
        fresh = old.with_hot_rows(ids, coverage=coverage)  # a first tier, or none
        return fresh, _buffer_of(fresh.hot)
    directory = _directory_copy(old, hot)
    after = old.rank_directory(ids)
    words = torch.nonzero(directory[0::2] != after[0::2]).flatten()  # rows enter or leave
    if words.numel() == 0:
        return dataclasses.replace(old, hot=dataclasses.replace(hot, coverage=coverage)), spare
    moved = ids[_word_rows(ids, words)]
    used = hot.rows.shape[0]
    if spare is None or used + moved.numel() > spare.shape[0]:
        rebuilt = _rebuilt(old, ids, coverage)
        return dataclasses.replace(old, hot=rebuilt), _buffer_of(rebuilt)
    # Rows the tier holds are copied from it, the others decoded.
    spare[used : used + moved.numel()] = ops.ibp_gather(*old.op_args(), moved, *old._tier_args())
    directory[2 * words] = after[2 * words]
    directory[2 * words + 1] = used + _starts(moved, words)
    new = HotRows(ids, directory, spare[: used + moved.numel()], coverage)
    return dataclasses.replace(old, hot=new), spare


def _rebuilt(
    old: CompressedTable, ids: torch.Tensor, coverage: float, spare_rows: int | None = None
) -> HotRows | None:
    """A tier of rows ``ids`` in a fresh buffer, read through ``old``'s tier, with
    ``spare_rows`` spare slots (``with_hot_rows``' default: ``codec.tier_spare_rows``); None
    where the payload serves as a tier of every row (all its rows raw at one stride)."""
    return old.with_hot_rows(ids, coverage=coverage, spare_rows=spare_rows).hot


def _buffer_of(hot: HotRows | None) -> torch.Tensor | None:
    """The whole buffer whose head holds ``hot``'s rows (spare slots included)."""
    if hot is None:
        return None
    stride = hot.rows.shape[1]
    slots = hot.rows.untyped_storage().nbytes() // stride
    return torch.empty(0, dtype=torch.uint8).set_(
        hot.rows.untyped_storage(), 0, (slots, stride), (stride, 1)
    )


def _directory_copy(table: CompressedTable, hot: HotRows) -> torch.Tensor:
    """A copy of ``hot``'s directory for a new version to change, made explicit for a tier of
    every row (which has none)."""
    return hot.directory.clone() if hot.directory.numel() else table.rank_directory(hot.ids)


def _word_rows(ids: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Positions in ``ids`` (sorted) of the rows in directory words ``words`` (sorted)."""
    first = torch.searchsorted(ids, words * TIER_WORD_ROWS)
    counts = torch.searchsorted(ids, (words + 1) * TIER_WORD_ROWS) - first
    offsets = torch.cumsum(counts, 0) - counts
    return torch.repeat_interleave(first - offsets, counts) + torch.arange(int(counts.sum()))


def _starts(rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Where each of ``words`` starts in ``rows``, the sorted rows of those words."""
    return torch.searchsorted(rows, words * TIER_WORD_ROWS)


def _heads(hot: HotRows | None, buffer: torch.Tensor | None) -> bool:
    """Whether ``hot``'s rows are the head of ``buffer``."""
    return hot is not None and buffer is not None and hot.rows.data_ptr() == buffer.data_ptr()
