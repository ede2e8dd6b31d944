# SPDX-License-Identifier: Apache-2.0
"""The live table store: versioned snapshots of compressed tables, reloads and row updates.

>>> store = TableStore.load("tables/")            # a packed table set (manifest + .ibpt files)
>>> with store.acquire() as snap:                 # one consistent version for the whole lookup
...     name, table = snap.table_for_feature("user_id")
...     rows = table.gather(ids)
>>> store.reload()                                # publish the directory's new manifest, if any
>>> store.update_rows("t_user", ids, new_rows)    # re-encode rows, publish atomically

Versioning. A ``TableSnapshot`` is immutable. ``reload`` and ``update_rows`` build the next
snapshot off to the side and publish it with one pointer swap under a lock, so a lookup that holds
a snapshot sees exactly one version from start to end and readers never wait for writers. An old
snapshot lives as long as a lookup holds it; when the last holder leaves, the store drops it and
its memory (mmap or buffer) is released by reference counting.

Kept versions. A store keeps the last ``keep_versions`` published snapshots, not just the newest,
and ``acquire(version)`` hands out any of them: a frontend pins a request to the version its dense
model was trained with, and a request split across row shards reads one version on every shard
while the shards reload one after another. Version numbers come from the table set's manifest
(``table_set_version``, one more at every pack), so every server of a set gives the same content
the same number; a set whose manifest has no number, or a number not newer than the newest held
(row updates and ``put_table`` number their versions locally, one past the newest), gets the next
number here, so one number never names two contents in one store. Tables shared by kept versions
(a reload keeps unchanged tables) are held once.

Row updates (copy-on-write per 32-row block, into a spill area: :mod:`ibpembed.tables.updates`)
publish the updated table as the next version, like a reload. Updates live in memory: ``save``
writes them out; ``reload`` replaces updated tables with their files.

Devices. A store built for a GPU (``device="cuda"``) places every table of a snapshot it
publishes for the CUDA kernels (``placement.place_table``): the snapshot owns copies of the
index, bitmask and masks on the device and the device alias of the payload, registered in place.
A reload or row update publishes new copies with its new snapshot; tables it did not change keep
theirs. ``snapshot.tables`` stays the host tables (what ``save``, updates and accounting read);
kernels read ``snapshot.kernel_table(name)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ibpembed import layout
from ibpembed.codec import CompressedTable, CompressedTableSet, serve_payload_bytes
from ibpembed.errors import VersionNotHeld
from ibpembed.tables import tier_versions
from ibpembed.tables import writer as tw
from ibpembed.tables.manifest import ManifestEntry, RowRange, load_table_set_meta
from ibpembed.tables.mapped_files import MappedFiles
from ibpembed.tables.pack import save_table_set
from ibpembed.tables.placement import HostAliases, cuda_register, maps_shared, place_table
from ibpembed.tables.updates import RowUpdates


@dataclass(frozen=True)
class TableBytes:
    """Memory of one table, by kind (the four kinds are disjoint).

    Attributes
    ----------
    raw : bytes of the uncompressed table (rows x row bytes).
    stored : bytes of the buffer under the payload: those the current version addresses
        (compressed and raw slots, spilled blocks and the holes they left, the decoder's pad)
        and, once rows were updated, the spill area's spare room past them (allocated and
        zero-filled, shared by later versions).
    index : random-access index (block bases and per-row slot sizes).
    metadata : compressed-row bitmask and the per-position masks.
    hot : decoded copies of hot rows kept for CPU lookups (``CompressedTable.with_hot_rows``),
        with their ids and directory; 0 without them.
    """

    raw: int
    stored: int
    index: int
    metadata: int
    hot: int = 0

    @property
    def total(self) -> int:
        """Host bytes of the table, its decoded tier included."""
        return self.stored + self.index + self.metadata + self.hot

    @property
    def savings(self) -> float:
        """1 - total / raw."""
        return layout.savings(self.total, self.raw)

    @property
    def ratio(self) -> float:
        """raw / total (compression ratio)."""
        return self.raw / self.total


def _buffers(table: CompressedTable) -> list[tuple[int, int]]:
    """(address, bytes) of each buffer under the table's tensors, its tier's included. Buffers
    are told apart by address: a storage object is a fresh wrapper at every call."""
    tensors = [table.payload, table.block_base, table.row_units, table.bitmask]
    tensors += [table.mask, table.bitval]
    if table.hot is not None:
        tensors += [table.hot.ids, table.hot.directory, table.hot.rows]
    storages = [t.untyped_storage() for t in tensors]
    return [(s.data_ptr(), s.nbytes()) for s in storages if s.nbytes()]


class PoolingFeature(NamedTuple):
    """A feature served from a snapshot's pooling set (see ``TableSnapshot.pooling_features``)."""

    position: int  # of its table in the pooling set
    dim: int  # width of its pooled rows
    table: str
    rows: int  # of its table


@dataclass(frozen=True)
class TableSnapshot:
    """One published version of the whole table set. Never changes after publication."""

    version: int
    tables: Mapping[str, CompressedTable]
    features: Mapping[str, str]  # feature -> table
    # Global rows of the tables that are row shards; a table not listed is whole.
    shards: Mapping[str, RowRange] = dataclasses.field(default_factory=dict)
    # Each table as the kernels of the store's device read it (``placement.place_table``); on
    # the CPU the tables themselves.
    placed: Mapping[str, CompressedTable] = dataclasses.field(default_factory=dict)

    def kernel_table(self, name: str) -> CompressedTable:
        """Table ``name`` as this snapshot's kernels read it (its device copies on a GPU)."""
        placed = self.placed.get(name)
        return placed if placed is not None else self.tables[name]

    @functools.cached_property
    def pooling_set(self) -> tuple[CompressedTableSet, Mapping[str, int]]:
        """This version's poolable tables as its kernels read them (on a GPU, their device
        copies), registered for one-call pooled lookups, and each one's position in the set.
        Built on first use."""
        names = [name for name, table in self.tables.items() if table.poolable]
        return CompressedTableSet([self.kernel_table(n) for n in names]), {
            n: i for i, n in enumerate(names)
        }

    @functools.cached_property
    def pooling_features(self) -> Mapping[str, PoolingFeature]:
        """The features whose tables are in :attr:`pooling_set` whole (not row shards), so that
        a pooled lookup of them needs no id translation. Built on first use."""
        _, position = self.pooling_set
        features = {}
        for feature, name in self.features.items():
            if name in position and name not in self.shards:
                table = self.tables[name]
                features[feature] = PoolingFeature(
                    position[name], table.pooled_dim, name, table.num_rows
                )
        return features

    def row_range(self, name: str) -> RowRange:
        """Global rows ``table`` holds here: its shard's range, or all its rows."""
        rows = self.shards.get(name)
        return rows if rows is not None else RowRange.whole(self.tables[name].num_rows)

    def table_for_feature(self, feature: str) -> tuple[str, CompressedTable]:
        """(table name, table) serving ``feature``.

        Raises
        ------
        KeyError
            naming the feature, when no table serves it.
        """
        try:
            name = self.features[feature]
        except KeyError:
            raise KeyError(f"unknown feature '{feature}'") from None
        return name, self.tables[name]


def _mapping(table: CompressedTable) -> int:
    """What a table reads its rows from: its payload's memory, shared by the versions of the
    table that decoded tiers make (another object each) and distinct for a fresh buffer."""
    return table.payload.untyped_storage().data_ptr()


def _without(snap: TableSnapshot, tables: set[str]) -> TableSnapshot:
    """``snap`` under its number without ``tables`` and the features they serve."""
    return TableSnapshot(
        snap.version,
        _frozen({n: t for n, t in snap.tables.items() if n not in tables}),
        _frozen({f: n for f, n in snap.features.items() if n not in tables}),
        _frozen({n: r for n, r in snap.shards.items() if n not in tables}),
        _frozen({n: t for n, t in snap.placed.items() if n not in tables}),
    )


def _frozen(mapping: Mapping) -> Mapping:
    return types.MappingProxyType(dict(mapping))


def _shards(entries: Mapping[str, ManifestEntry]) -> Mapping[str, RowRange]:
    """Row ranges of the manifest entries that are shards of a larger table."""
    return _frozen({n: e.row_range for n, e in entries.items() if not e.row_range.is_whole})


def _check_features(tables: Mapping[str, CompressedTable], features: Mapping[str, str]) -> None:
    for feature, table in features.items():
        if table not in tables:
            raise KeyError(f"feature '{feature}' maps to unknown table '{table}'")


class TableStore:
    """Name -> compressed table, published as immutable, versioned snapshots.

    Thread-safe: any number of threads may ``acquire`` while one ``reload``/``update_rows``
    runs (writers are serialised among themselves).
    """

    def __init__(
        self,
        tables: Mapping[str, CompressedTable],
        features: Mapping[str, str],
        *,
        directory: Path | None = None,
        entries: Mapping[str, ManifestEntry] | None = None,
        metas: Mapping[str, Mapping[str, Any]] | None = None,
        verify: bool = False,
        prefetch: bool = False,
        version: int = 1,
        keep_versions: int = 1,
        device: torch.device | str = "cpu",
        aliases: HostAliases | None = None,
    ) -> None:
        _check_features(tables, features)
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self._lock = threading.Lock()  # guards _current and _holders; held for a few lines only
        self._write_lock = threading.Lock()  # one writer (reload / update / put) at a time
        self._holders: dict[int, int] = {}
        self._directory = directory
        self._entries = dict(entries or {})
        # What ``save`` writes back of each table beyond its rows, kept across row updates
        # (``_entries`` forgets an updated table): the model's pooling and the file's metadata.
        self._pooling = {n: e.pooling for n, e in self._entries.items()}
        self._meta = {n: dict(m) for n, m in (metas or {}).items()}
        self._verify = verify
        self._prefetch = prefetch
        self.device = torch.device(device)
        if aliases is None and self.device.type == "cuda":
            aliases = HostAliases(cuda_register(self.device))
        self._aliases = aliases
        self._updates = RowUpdates()
        self._tiers = tier_versions.TierSpares()
        self._keep = keep_versions
        self._current = TableSnapshot(
            version,
            _frozen(tables),
            _frozen(features),
            _shards(self._entries),
            self._placed(tables, TableSnapshot(0, {}, {})),
        )
        # Published snapshots still served on request, oldest first; the last is _current.
        self._kept: list[TableSnapshot] = [self._current]
        self._size_staged_reads(tables)
        # The files mapped tables were read from, keyed by the memory each table reads (_mapping).
        self._files = MappedFiles()
        # Feature -> why the table serving it was withdrawn (its file changed under it).
        self.refused: dict[str, str] = {}
        if directory is not None:
            self._watch_files(directory, self._entries, tables)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_tables(
        cls,
        tables: Mapping[str, CompressedTable],
        features: Mapping[str, str] | None = None,
        *,
        device: torch.device | str = "cpu",
    ) -> TableStore:
        """A store over in-memory tables; by default each table serves the feature of its name.
        ``device``: where the kernels run (see the module docstring)."""
        return cls(
            tables, features if features is not None else {n: n for n in tables}, device=device
        )

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        *,
        verify: bool = False,
        prefetch: bool = False,
        keep_versions: int = 1,
        progress: Callable[[int, int], None] | None = None,
        device: torch.device | str = "cpu",
        aliases: HostAliases | None = None,
    ) -> TableStore:
        """A store over a packed table set (manifest + ``.ibpt`` files), memory-mapped.

        Parameters
        ----------
        verify : also hash every payload at load (and at every reload).
        prefetch : read every payload into the page cache at load (and at every reload), so
            the first lookups do not wait on storage; from a cold cache the load then takes
            about as long as reading the payloads (see ``format.read_table``).
        keep_versions : published versions kept for pinned lookups (``acquire(version)``).
        progress : ``progress(tables loaded, tables)`` as the load goes (for a loading gauge).
        device : where the kernels run; ``"cuda"`` places every table for the CUDA kernels
            (see the module docstring).
        aliases : the registry of payload aliases for a GPU (default: ``cudaHostRegister`` in
            place, ``placement.HostAliases``).
        """
        directory = Path(directory)
        manifest, tables, metas = load_table_set_meta(
            directory,
            verify=verify,
            prefetch=prefetch,
            shared=maps_shared(torch.device(device)),
            progress=progress,
        )
        return cls(
            tables,
            manifest.features,
            directory=directory,
            entries=manifest.tables,
            metas=metas,
            verify=verify,
            prefetch=prefetch,
            version=manifest.table_set_version or 1,
            keep_versions=keep_versions,
            device=device,
            aliases=aliases,
        )

    def _placed(
        self, tables: Mapping[str, CompressedTable], previous: TableSnapshot
    ) -> Mapping[str, CompressedTable]:
        """Every table placed for this store's device: the device copies of ``previous`` for
        tables it holds unchanged (the same object), new ones for the rest."""
        if self.device.type == "cpu":
            return _frozen(tables)
        placed = {}
        for name, table in tables.items():
            kept = previous.tables.get(name) is table and name in previous.placed
            placed[name] = (
                previous.placed[name] if kept else place_table(table, self.device, self._aliases)
            )
        return _frozen(placed)

    def _size_staged_reads(self, tables: Mapping[str, CompressedTable]) -> None:
        """CPU lookups copy rows into a stage rather than prefetch them once the tables they
        serve outgrow the last-level cache (``codec.serve_payload_bytes``)."""
        if self.device.type == "cpu":
            serve_payload_bytes(sum(t.stored_bytes for t in tables.values()))

    # -- reading ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def acquire(self, version: int = 0) -> Iterator[TableSnapshot]:
        """Hold a snapshot for the duration of a ``with`` block: the current one (``version``
        0), or the kept one of that number (:class:`VersionNotHeld` otherwise)."""
        with self._lock:
            snapshot = self._current
            if version and version != snapshot.version:
                kept = next((s for s in self._kept if s.version == version), None)
                if kept is None:
                    raise VersionNotHeld(version, tuple(s.version for s in self._kept))
                snapshot = kept
            self._holders[snapshot.version] = self._holders.get(snapshot.version, 0) + 1
        try:
            yield snapshot
        finally:
            with self._lock:
                left = self._holders[snapshot.version] - 1
                if left:
                    self._holders[snapshot.version] = left
                else:
                    del self._holders[snapshot.version]

    @property
    def version(self) -> int:
        return self._current.version

    @property
    def keep_versions(self) -> int:
        return self._keep

    def versions_held(self) -> tuple[int, ...]:
        """The versions ``acquire`` serves, oldest first (the last is :attr:`version`)."""
        with self._lock:
            return tuple(s.version for s in self._kept)

    def older_versions_bytes(self) -> int:
        """Host bytes held only for kept versions older than the current one: the buffers of
        their tables (payload, index, metadata, tier) that the current version does not share,
        each counted once. A row update shares the payload's buffer and replaces the rest, so
        buffers are compared one by one, not table by table."""
        with self._lock:
            kept = list(self._kept)
        current = {ptr for t in kept[-1].tables.values() for ptr, _ in _buffers(t)}
        older = {
            ptr: nbytes
            for snapshot in kept[:-1]
            for table in snapshot.tables.values()
            for ptr, nbytes in _buffers(table)
            if ptr not in current
        }
        return sum(older.values())

    def live_versions(self) -> set[int]:
        """The current version and every older one a lookup still holds."""
        with self._lock:
            return {self._current.version, *self._holders}

    def accounting(self) -> dict[str, TableBytes]:
        """Per table of the current version: raw, stored, index, metadata and hot-row bytes."""
        return {
            name: TableBytes(
                t.raw_bytes,
                t.resident_payload_bytes,
                t.index_bytes,
                t.metadata_bytes,
                t.hot_bytes,
            )
            for name, t in self._current.tables.items()
        }

    # -- writing ---------------------------------------------------------------------------------
    def _publish(
        self,
        tables: Mapping[str, CompressedTable],
        features: Mapping[str, str],
        shards: Mapping[str, RowRange] | None = None,
        *,
        same_rows: bool = False,
        version: int = 0,
    ) -> None:
        """Publish the next snapshot; ``shards`` default: the current ranges of kept tables.

        ``same_rows``: every table holds the same rows as before (only decoded tiers changed),
        so the snapshot keeps the current version number: versions number table contents.
        ``version``: the number a manifest gave the set; used when it is newer than the newest
        held, else the snapshot takes the next number (see the module's *Kept versions*).
        """
        if shards is None:
            shards = {n: r for n, r in self._current.shards.items() if n in tables}
        newest = self._current.version
        number = newest if same_rows else version if version > newest else newest + 1
        # Placed before the swap: a placement that fails (device memory runs out) publishes
        # nothing.
        placed = self._placed(tables, self._current)
        snapshot = TableSnapshot(
            number, _frozen(tables), _frozen(features), _frozen(shards), placed
        )
        with self._lock:
            self._current = snapshot
            if same_rows:
                self._kept[-1] = snapshot
            else:
                self._kept = [*self._kept, snapshot][-self._keep :]
        self._size_staged_reads(tables)

    def reload(self, directory: str | os.PathLike[str] | None = None) -> bool:
        """Load a table set and publish it as the next version, all or nothing.

        Tables whose manifest entry is unchanged (same file, same checksum, no row updates since)
        are kept as they are rather than mapped again. A set identical to the one serving (same
        tables, features and row ranges, and no newer ``table_set_version``) publishes nothing:
        versions number table contents.

        Parameters
        ----------
        directory : the table set to load; default the one this store was loaded from.

        Returns
        -------
        Whether a new version was published.

        Raises
        ------
        ValueError
            (``TableSetError``, ``TableFileError``) when the set cannot be loaded; the previous
            version keeps serving.
        """
        with self._write_lock:
            if directory is None and self._directory is None:
                raise ValueError("this store was not loaded from a directory: pass one to reload")
            target = Path(directory) if directory is not None else self._directory
            assert target is not None
            current = self._current.tables

            def reuse(name: str, entry: ManifestEntry) -> CompressedTable | None:
                kept = target == self._directory and self._entries.get(name) == entry
                return current.get(name) if kept and name not in self._updates else None

            manifest, tables, metas = load_table_set_meta(
                target,
                verify=self._verify,
                prefetch=self._prefetch,
                shared=maps_shared(self.device),
                reuse=reuse,
            )
            fresh = {n: t for n, t in tables.items() if t is not current.get(n)}
            shards = _shards(manifest.tables)
            renumbered = manifest.table_set_version > self._current.version
            unchanged = (
                not fresh
                and not renumbered  # the same tables under a new number are a new version
                and tables.keys() == current.keys()
                and dict(manifest.features) == dict(self._current.features)
                and dict(shards) == dict(self._current.shards)
            )
            if not unchanged:
                # Placing the tables on a device may fail (its memory runs out): the entries
                # below must keep describing what is published, or the next reload would
                # "reuse" old tables.
                self._publish(tables, manifest.features, shards, version=manifest.table_set_version)
                self._updates.clear()
                self._tiers.clear()
            if not unchanged:
                # Files of tables no held version serves any more are not watched (nor kept).
                self._watch_files(target, manifest.tables, fresh)
                served = manifest.features
                self.refused = {f: why for f, why in self.refused.items() if f not in served}
            self._directory = target
            self._entries = dict(manifest.tables)
            self._pooling = {n: e.pooling for n, e in manifest.tables.items()}
            self._meta = {
                n: dict(metas[n]) if n in metas else self._meta.get(n, {}) for n in manifest.tables
            }
            return not unchanged

    def _watch_files(
        self,
        directory: Path,
        entries: Mapping[str, ManifestEntry],
        tables: Mapping[str, CompressedTable],
    ) -> None:
        """Record the files ``tables`` were just mapped from, for :meth:`check_files`."""
        for name, table in tables.items():
            entry = entries.get(name)
            if entry is not None:
                self._files.watch(directory / entry.file, _mapping(table))

    def check_files(self) -> dict[str, str]:
        """Withdraw every held table whose file was changed in place since it was mapped
        (:mod:`ibpembed.tables.mapped_files`): each held version is republished, under its
        number, without it, and lookups of its features are refused with :attr:`refused`'s
        reason instead of reading pages that may fault or hold other rows. A reload (SIGHUP,
        or a new manifest) maps the file again. Returns the tables withdrawn now, with why.

        The engine runs it at once when a lookup reads corrupt rows; a lookup that faults on a
        truncated file is refused by :mod:`ibpembed.tables.mapping_guard` until then.
        """
        with self._write_lock:
            held = {_mapping(t) for snap in self._kept for t in snap.tables.values()}
            damaged = self._files.changed(held)  # mapping -> why
            if not damaged:
                return {}
            withdrawn: dict[str, str] = {}
            kept = []
            for snap in self._kept:
                gone = {n for n, t in snap.tables.items() if _mapping(t) in damaged}
                for name in gone:
                    withdrawn[name] = damaged[_mapping(snap.tables[name])]
                kept.append(_without(snap, gone) if gone else snap)
            for feature, name in self._current.features.items():
                if name in withdrawn:
                    self.refused[feature] = f"table {name!r} is withdrawn: {withdrawn[name]}"
            with self._lock:
                self._kept = kept
                self._current = kept[-1]
            return withdrawn

    @property
    def directory(self) -> Path | None:
        """The table set this store was loaded (or last reloaded) from; None for in-memory
        tables."""
        return self._directory

    def put_table(
        self, name: str, table: CompressedTable, features: Mapping[str, str] | None = None
    ) -> None:
        """Publish a new version with ``table`` added or replaced (and optional feature changes).

        A replaced table keeps its features and pooling (``save`` writes them), not the metadata
        of the file it was loaded from (its origin and layout describe the old rows).
        """
        with self._write_lock:
            tables = {**self._current.tables, name: table}
            merged = {**self._current.features, **(features or {})}
            if name not in self._current.tables and not features:
                merged.setdefault(name, name)
            _check_features(tables, merged)
            # A table put in by hand is whole: it replaces any shard of the same name.
            shards = {n: r for n, r in self._current.shards.items() if n != name}
            self._publish(tables, merged, shards)
            self._entries.pop(name, None)
            self._meta.pop(name, None)
            self._updates.forget(name)
            self._tiers.forget(name)

    def set_hot_rows(self, table: str, ids: torch.Tensor, *, coverage: float = 0.0) -> int:
        """Keep decoded copies of rows ``ids`` of ``table`` for CPU lookups (replacing any
        earlier ones; empty ``ids`` drops them). Lookups return the same rows either way, so the
        snapshot keeps its version. Returns the number of rows cached (rows stored raw are
        taken too: ``CompressedTable.with_hot_rows``). A table with a tier gets a new version of
        it, which rewrites only the directory words where rows enter or leave
        (:mod:`ibpembed.tables.tier_versions`). ``coverage``: see ``HotRows``.

        Raises
        ------
        KeyError
            for an unknown table.
        IndexError
            for ids outside the table's rows.
        """
        with self._write_lock:
            current = self._current.tables
            if table not in current:
                raise KeyError(f"unknown table '{table}'")
            spare = self._tiers.spare(table, current[table])
            new, tier = tier_versions.retiered(current[table], ids, coverage, spare)
            self._publish({**current, table: new}, self._current.features, same_rows=True)
            self._updates.republished(table, current[table], new)
            self._tiers.commit(table, tier)
            return new.hot.count if new.hot is not None else 0

    def update_rows(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Replace rows ``ids`` of ``table`` with ``rows``, bit for bit, in one new version.

        Parameters
        ----------
        ids : [n] distinct integer row ids, each in [0, num_rows) of the table as held here
            (for a row shard: global id - ``row_range(table).start``).
        rows : [n, dim] tensor of the table's dtype (uint8 for int8_rowwise tables).

        Raises
        ------
        KeyError
            for an unknown table.
        TypeError, ValueError
            for ids or rows that do not fit the table; nothing is published then.
        """
        with self._write_lock:
            current = self._current.tables
            if table not in current:
                raise KeyError(f"unknown table '{table}'")
            spare = self._tiers.spare(table, current[table])
            prepared = self._updates.prepare(table, current[table], ids, rows, spare)
            if prepared is None:  # no ids: nothing to publish
                return
            update, tier = prepared
            self._publish({**current, table: update.table}, self._current.features)
            # Recorded only once published: after a failed publish the next update starts again
            # from the published table, whose spare area this one's bytes are still part of.
            self._updates.commit(table, update)
            self._tiers.commit(table, tier)
            self._entries.pop(table, None)  # it no longer matches its file (_pooling, _meta stay)

    def save(self, directory: str | os.PathLike[str]) -> list[tw.PackedTable]:
        """Write the current version (row updates included) as a table set: each table with its
        features, row range, pooling and the metadata of the file it was loaded from."""
        with contextlib.ExitStack() as held:
            with self._write_lock:  # the version and what describes its tables, together
                snapshot = held.enter_context(self.acquire())
                pooling = {n: self._pooling.get(n) for n in snapshot.tables}
                meta = {n: dict(self._meta.get(n, {})) for n in snapshot.tables}
            return save_table_set(
                directory, snapshot.tables, snapshot.features, pooling, snapshot.shards, meta
            )
