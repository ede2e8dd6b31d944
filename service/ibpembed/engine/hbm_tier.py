# SPDX-License-Identifier: Apache-2.0
"""The HBM tier: copies of each table's hottest rows in GPU memory, read by the CUDA kernels in
the same launch as the rows they read zero-copy from host memory.

A tier of one table version (:class:`DeviceTier`) is two or three tensors on the GPU:

- ``directory``, int64 [2 * ceil(num_rows / 64)]: the residency map, the rank directory of the
  CPU's decoded tier (csrc/include/ibpembed/tier.h ``rank_slot``): per 64 rows a bit word (set:
  the tier holds the row) and the slot of the word's first held row; slots follow row ids. 16
  bytes per 64 rows (0.25 per row), whatever the tier's size;
- ``payload``, uint8: the slots back to back, 16-byte aligned, with the codec's pad;
- the form (``--hbm-tier-form``): ``decoded``, a slot holds the decoded row at a fixed stride
  (``row_bytes`` rounded up to 16; read like a raw row, no decode), or ``compressed``, the row's
  slot as the table stores it (1/(1-s) times the rows in the same bytes, decoded in the kernel
  like a host row), found through ``slot_offset``, int64 [slots + 1].

A slot is an exact copy of what the table version serves for its row, so results never depend
on the tier, and a tier is only ever used with the table version it was built from
(:class:`HbmTiers` keys it by the table object): a row update or a reload makes a new version,
which is served from host memory until its own tier is published. Rows are chosen by the CPU hot
tier's admission policy (:class:`ibpembed.engine.tier.AdmissionPolicy`); :class:`HbmTier` spends
``--hbm-tier`` (:mod:`ibpembed.tables.tier_budget`) on them.

Hit and miss counts are kept by the kernels in a device counter array per tier
(:class:`TierCounters`) and read on the metrics interval with an asynchronous copy, never a sync
per request.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ibpembed.codec import CompressedTable, CompressedTableSet, Pooling, tier_directory_bytes
from ibpembed.engine.tier import DEFAULT_WINDOW_IDS, STEP_S, AdmissionPolicy
from ibpembed.engine_defaults import DEFAULT_FORM, FORMS, TierForm
from ibpembed.tables.store import TableSnapshot, TableStore
from ibpembed.tables.tier_budget import TableSize, TierBudget, TierPlan

# The codec's pad: the kernels' 16-byte reads of a slot's last window may pass its end.
PAYLOAD_PAD = 16
# Bytes per compressed tier row besides its slot: its slot offset (decoded slots need none).
OFFSET_BYTES_PER_ROW = 8
# Slots copied per step of a compressed tier's build.
BUILD_CHUNK_ROWS = 1 << 16


def parse_form(form: str) -> TierForm:
    """``--hbm-tier-form``; ValueError naming the forms."""
    if form not in FORMS:
        raise ValueError(f"hbm tier form must be one of {', '.join(FORMS)}, got {form!r}")
    return form


def _round16(n: int) -> int:
    return (n + 15) & ~15


def slot_bytes_per_row(table: CompressedTable, form: TierForm) -> float:
    """Mean tier bytes of one row of ``table`` in ``form``: its slot (and a compressed slot's
    offset)."""
    if form == "decoded":
        return _round16(table.row_bytes)
    return table.payload_bytes / max(table.num_rows, 1) + OFFSET_BYTES_PER_ROW


def map_bytes(table: CompressedTable) -> int:
    """GPU bytes of a tier's residency map (its rank directory), whatever the tier's size."""
    return tier_directory_bytes(table.num_rows)


def _fixed_bytes(table: CompressedTable, form: TierForm) -> int:
    """GPU bytes of a tier of ``table`` whatever its rows: the residency map, the pad and (the
    compressed form) the slot offsets' closing entry."""
    closing = OFFSET_BYTES_PER_ROW if form == "compressed" else 0
    return map_bytes(table) + PAYLOAD_PAD + closing


def tier_bytes(table: CompressedTable, form: TierForm, rows: int) -> int:
    """GPU bytes of a tier of ``rows`` rows (0 for none): exact for the decoded form, the
    table's mean slot for the compressed one."""
    if rows <= 0:
        return 0
    return _fixed_bytes(table, form) + int(rows * slot_bytes_per_row(table, form))


def tier_capacity(table: CompressedTable, form: TierForm, budget_bytes: int) -> int:
    """Rows of ``table`` a tier of ``budget_bytes`` holds (the residency map paid first)."""
    left = budget_bytes - _fixed_bytes(table, form)
    if left <= 0:
        return 0
    return min(table.num_rows, int(left // slot_bytes_per_row(table, form)))


def slot_spans(table: CompressedTable, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte offset, byte size) of each of ``rows``' slots in the table's payload, from its
    index (block_base, row_units) as the kernels find them."""
    rows = rows.to(torch.int64)
    block = rows >> 5
    units = table.row_units.to(torch.int64).view(-1, 32)
    # Units before each row in its block: an exclusive prefix sum over the block's 32 sizes.
    before = torch.cumsum(units, dim=1) - units
    in_block = rows & 31
    offset = table.block_base[block] + table.unit_bytes * before[block, in_block]
    size = table.unit_bytes * units[block, in_block]
    return offset, size


@dataclass(frozen=True)
class TierArrays:
    """A tier's tensors (see the module docstring), on one device."""

    directory: torch.Tensor
    slot_offset: torch.Tensor | None  # the compressed form's; None: decoded
    payload: torch.Tensor
    rows: torch.Tensor  # int64, sorted: the rows of the tier, slot i holds rows[i]

    @property
    def decoded(self) -> bool:
        return self.slot_offset is None

    @property
    def num_slots(self) -> int:
        return self.rows.numel()

    @property
    def nbytes(self) -> int:
        offsets = 0 if self.slot_offset is None else self.slot_offset.nbytes
        return self.directory.nbytes + offsets + self.payload.nbytes

    def to(self, device: torch.device) -> TierArrays:
        return TierArrays(
            self.directory.to(device),
            None if self.slot_offset is None else self.slot_offset.to(device),
            self.payload.to(device),
            self.rows,
        )


def build_tier(table: CompressedTable, rows: torch.Tensor, form: TierForm) -> TierArrays:
    """The tier of ``rows`` (distinct, in range) of ``table``, built on the host from the table
    version it will serve with."""
    rows = torch.unique(rows.to(device="cpu", dtype=torch.int64))  # sorted
    if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= table.num_rows):
        raise IndexError(f"tier rows must lie in [0, {table.num_rows}) of the table")
    n = rows.numel()
    directory = table.rank_directory(rows)  # the CPU tier's layout: tier.h rank_slot
    if form == "decoded":
        stride = _round16(table.row_bytes)
        payload = torch.zeros(n * stride + PAYLOAD_PAD, dtype=torch.uint8)
        if n:
            decoded = table.gather(rows).cpu().contiguous().view(torch.uint8)
            payload[: n * stride].view(n, stride)[:, : table.row_bytes] = decoded.view(n, -1)
        return TierArrays(directory, None, payload, rows)
    offset, size = slot_spans(table, rows)
    slot_offset = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(size, 0, out=slot_offset[1:])
    total = int(slot_offset[-1])
    payload = torch.zeros(total + PAYLOAD_PAD, dtype=torch.uint8)
    source_payload = table.payload.cpu()
    # Byte i of slot s comes from payload byte offset[s] + i: one gather per chunk of slots
    # (its byte index, 8 bytes per byte copied, stays small).
    for first in range(0, n, BUILD_CHUNK_ROWS):
        part = slice(first, min(n, first + BUILD_CHUNK_ROWS))
        start, end = int(slot_offset[part.start]), int(slot_offset[part.stop])
        if end == start:
            continue
        sizes = size[part]
        within = torch.arange(start, end, dtype=torch.int64) - torch.repeat_interleave(
            slot_offset[part], sizes
        )
        payload[start:end] = source_payload[torch.repeat_interleave(offset[part], sizes) + within]
    return TierArrays(directory, slot_offset, payload, rows)


class TierCounters:
    """A tier's hit and miss counts: an int64 [2] array the kernels add to on the device, read
    with an asynchronous copy into pinned memory (:meth:`poll`, on the metrics interval), so no
    request waits for them. On the CPU (tests, the emulator) the copy is a plain read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.device_counts = torch.zeros(2, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self._host = torch.zeros(2, dtype=torch.int64, pin_memory=pinned)
        self._event = torch.cuda.Event() if pinned else None
        self._copied = False
        self._last = (0, 0)

    def poll(self) -> tuple[int, int]:
        """(hits, misses) as of the previous poll's copy, and queue the next copy."""
        if self._event is None:
            return int(self.device_counts[0]), int(self.device_counts[1])
        if self._copied and not self._event.query():
            return self._last
        self._last = (int(self._host[0]), int(self._host[1]))
        self._host.copy_(self.device_counts, non_blocking=True)
        self._event.record()
        self._copied = True
        return self._last


@dataclass(frozen=True)
class DeviceTier:
    """A published tier: its arrays on the GPU, the table version they copy, its counters."""

    table: CompressedTable
    arrays: TierArrays
    counters: TierCounters


class HbmTiers:
    """The published tiers by table name, swapped whole (one reference assignment) so that a
    lookup sees a tier and its table version together or no tier."""

    def __init__(self) -> None:
        self._tiers: Mapping[str, DeviceTier] = {}
        self._lock = threading.Lock()  # writers only: readers take the current mapping

    def get(
        self, name: str, table: CompressedTable, tiers: Mapping[str, DeviceTier] | None = None
    ) -> DeviceTier | None:
        """The tier to read ``table`` with: only one built from this very table version; from
        ``tiers`` (a :meth:`current` mapping) when given, else the one published now."""
        tier = (self._tiers if tiers is None else tiers).get(name)
        return tier if tier is not None and tier.table is table else None

    def publish(self, name: str, tier: DeviceTier | None) -> None:
        with self._lock:
            tiers = dict(self._tiers)
            if tier is None:
                tiers.pop(name, None)
            else:
                tiers[name] = tier
            self._tiers = tiers

    def current(self) -> Mapping[str, DeviceTier]:
        return self._tiers


def gather(table: CompressedTable, ids: torch.Tensor, tier: DeviceTier | None) -> torch.Tensor:
    """``table.gather(ids)`` on the GPU, rows the tier holds read from it (one launch)."""
    if tier is None:
        return table.gather(ids)
    a = tier.arrays
    raw = torch.ops.ibpembed.ibp_gather_hbm(
        *table.op_args(),
        ids.to(torch.int64).contiguous(),
        a.directory,
        a.slot_offset,
        a.payload,
        a.num_slots,
        tier.counters.device_counts,
    )
    return table._as_rows(raw)


class TieredTableSet:
    """A GPU :class:`~ibpembed.codec.CompressedTableSet` whose tables are read through their
    HBM tiers (``None``: that table has none): one launch per chunk width, as the set's."""

    def __init__(self, table_set: CompressedTableSet, tiers: list[DeviceTier | None]) -> None:
        self.table_set = table_set
        self.tiers = tiers  # kept alive with the handle that points into them
        self._handle = torch.classes.ibpembed.TierSet()
        for tier in tiers:
            if tier is None:
                self._handle.add(table_set._handle, None, None, None, 0, None)
                continue
            a = tier.arrays
            self._handle.add(
                table_set._handle,
                a.directory,
                a.slot_offset,
                a.payload,
                a.num_slots,
                tier.counters.device_counts,
            )
        # One copy of every tier's pointers to the GPU and one wait, for the whole set.
        self._handle.upload()

    def lookup(
        self,
        table_bags: torch.Tensor,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        pooling: Pooling = "sum",
    ) -> tuple[list[torch.Tensor], list[float]]:
        """As :meth:`CompressedTableSet.lookup` (the same arguments, checks and results)."""
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        values, seconds = torch.ops.ibpembed.lookup_pooled_tables_hbm(
            self.table_set._handle,
            self._handle,
            ids.to(torch.int64).contiguous(),
            offsets.to(torch.int64).contiguous(),
            table_bags.to(torch.int64).contiguous(),
            None if weights is None else weights.contiguous(),
            0 if pooling == "sum" else 1,
        )
        return values, seconds.tolist()


class HbmTier(AdmissionPolicy):
    """Online admission into the HBM tier (the CPU hot tier's policy, see
    :class:`~ibpembed.engine.tier.AdmissionPolicy`), publishing :class:`DeviceTier` s into
    :attr:`tiers`.

    Parameters
    ----------
    store : the tables (a GPU store: its tables' small tensors on ``device``).
    budget : ``--hbm-tier``: GPU bytes per table (a share of its raw bytes, or bytes for the
        table set); must not be ``off``.
    form : ``--hbm-tier-form``.
    device : the GPU the tiers live on (the CPU in tests).
    refresh_s, step_s, window_ids : the policy's (:class:`AdmissionPolicy`).
    """

    def __init__(
        self,
        store: TableStore,
        *,
        budget: TierBudget | str,
        form: str = DEFAULT_FORM,
        device: torch.device | str = "cuda",
        refresh_s: float = 30.0,
        step_s: float = STEP_S,
        window_ids: int = DEFAULT_WINDOW_IDS,
    ) -> None:
        # Before the policy's own set-up, which asks capacity() what each table's budget buys.
        self.form = parse_form(form)
        self.device = torch.device(device)
        super().__init__(
            store,
            budget=budget,
            refresh_s=refresh_s,
            step_s=step_s,
            window_ids=window_ids,
            thread_name="ibpembed-hbm-tier",
        )
        self.tiers = HbmTiers()
        # Per table, across publications: the counts a tier's kernels add up only ever grow.
        self._counters: dict[str, TierCounters] = {}
        # The last pooling set made (a snapshot's, with the tiers then published).
        self._sets: (
            tuple[
                CompressedTableSet,
                Mapping[str, DeviceTier],
                CompressedTableSet | TieredTableSet,
                int,  # the version of the snapshot it was made for
            ]
            | None
        ) = None

    def capacity(self, table: CompressedTable, share: float) -> int:
        if self.budget.kind == "all":
            return table.num_rows
        return tier_capacity(table, self.form, self.budget.table_bytes(TableSize.of(table), share))

    def _within_budget(self, table: CompressedTable, rows: np.ndarray) -> np.ndarray:
        """``rows`` (sorted), less the largest slots where their tier would exceed the table's
        budget: the compressed form is priced at the table's mean slot, and the hot rows the
        policy picks can be larger (stored raw). Dropping the largest keeps the most rows."""
        if self.form != "compressed" or self.budget.kind == "all" or rows.size == 0:
            return rows
        with self.store.acquire() as snapshot:
            total = sum(t.raw_bytes for t in snapshot.tables.values()) or 1
        budget = self.budget.table_bytes(TableSize.of(table), table.raw_bytes / total)
        room = budget - _fixed_bytes(table, self.form)
        _, size = slot_spans(table, torch.from_numpy(rows))
        cost = size + OFFSET_BYTES_PER_ROW
        if int(cost.sum()) <= room:
            return rows
        order = torch.argsort(cost, stable=True)
        fits = int((torch.cumsum(cost[order], 0) <= room).sum())
        return np.sort(rows[order[:fits].numpy()])

    def held(self, name: str, table: CompressedTable) -> np.ndarray | None:
        tier = self.tiers.get(name, table)
        return None if tier is None else tier.arrays.rows.numpy()

    def lost(self, name: str, table: CompressedTable) -> bool:
        # A row update or a reload made a new table version: its tier is built from it.
        return self.tiers.get(name, table) is None

    def step(self) -> None:
        """A step of the policy, then a new tier at once for every table whose version
        changed (a row update, a reload): until it is built that version reads host memory."""
        super().step()
        with self.store.acquire() as snapshot:
            current = dict(snapshot.tables)
        # A table a reload dropped: its tier would keep the old table and its GPU arrays alive.
        for gone in set(self.tiers.current()) - set(current):
            self.tiers.publish(gone, None)
            self._counters.pop(gone, None)
        # Likewise the last request's pooling set, once its version is not the newest: until the
        # next request it would keep that version's tables (and their device copies) alive.
        made = self._sets
        if made is not None and made[3] != self.store.version:
            self._sets = None
        with self._lock:
            states = dict(self._tables)
        lost = [
            name
            for name, state in states.items()
            if state.cached > 0 and name in current and self.lost(name, current[name])
        ]
        if lost:
            self.publish(lost, only=lost)

    def install(self, name: str, table: CompressedTable, rows: np.ndarray, coverage: float) -> int:
        rows = self._within_budget(table, rows)
        if rows.size == 0:
            self.tiers.publish(name, None)
            return 0
        arrays = build_tier(table, torch.from_numpy(rows), self.form).to(self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # in place before it is read
        counters = self._counters.get(name)
        if counters is None:
            counters = self._counters[name] = TierCounters(self.device)
        self.tiers.publish(name, DeviceTier(table, arrays, counters))
        return arrays.num_slots

    def plan(self) -> dict[str, TierPlan]:
        with self.store.acquire() as snapshot:
            tables = dict(snapshot.tables)
        total = sum(t.raw_bytes for t in tables.values()) or 1
        out = {}
        for name, table in tables.items():
            rows = self.capacity(table, table.raw_bytes / total)
            out[name] = TierPlan(rows, tier_bytes(table, self.form, rows))
        return out

    def tier_of(self, snap: TableSnapshot, name: str) -> DeviceTier | None:
        """The published tier of table ``name`` of ``snap``'s very version, if any (tiers are
        keyed by the host table; the kernels read its placed copy, with :func:`gather`)."""
        return self.tiers.get(name, snap.tables[name])

    def table_set(self, snap: TableSnapshot) -> CompressedTableSet | TieredTableSet:
        """``snap``'s pooling set read through the tiers published for its very table versions;
        the set itself when none is."""
        table_set, position = snap.pooling_set
        current = self.tiers.current()
        cached = self._sets
        if cached is not None and cached[0] is table_set and cached[1] is current:
            return cached[2]
        names = sorted(position, key=position.__getitem__)
        # From the one mapping the set is cached under: a publication meanwhile makes another.
        tiers = [self.tiers.get(n, snap.tables[n], current) for n in names]
        made: CompressedTableSet | TieredTableSet = table_set
        if any(t is not None for t in tiers):
            made = TieredTableSet(table_set, tiers)
        self._sets = (table_set, current, made, snap.version)
        return made

    def counts(self, names: Collection[str] | None = None) -> dict[str, tuple[int, int]]:
        """(hits, misses) the kernels counted per table's published tier (see
        :class:`TierCounters`: as of the previous call)."""
        return {
            name: tier.counters.poll()
            for name, tier in self.tiers.current().items()
            if names is None or name in names
        }
