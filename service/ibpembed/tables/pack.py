# SPDX-License-Identifier: Apache-2.0
"""Writing table sets: pack tables into a directory and publish its manifest.

A table set is published by its manifest (format: :mod:`ibpembed.tables.manifest`). Table files
are content-named (``<table>.<header checksum>.ibpt``) and written before the manifest, and the
manifest is replaced atomically last, so a crash at any point leaves the previous manifest
pointing at its own intact files; new files only become live with the new manifest. Once the
new manifest is in place, the table files the previous one named and the new one does not are
removed, with what killed packs left (content-named table files, temporaries); files of any other
name stay. Each publication gets the next ``table_set_version`` (see the manifest module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ibpembed import codec
from ibpembed.codec import CompressedTable
from ibpembed.tables import atomic
from ibpembed.tables import format as tf
from ibpembed.tables import writer as tw
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import (
    LOCK_FILE,
    MANIFEST,
    MAX_TABLE_SET_VERSION,
    SHARD_MAP,
    Manifest,
    ManifestEntry,
    RowRange,
    TableSetError,
    read_manifest,
    shard_count,
    split_rows,
)


@contextlib.contextmanager
def _pack_lock(directory: Path) -> Iterator[None]:
    """One writer per directory: a second concurrent pack fails instead of interleaving."""
    with open(directory / LOCK_FILE, "a+b") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TableSetError(f"{directory}: another pack is writing this table set") from None
        yield


@contextlib.contextmanager
def _unpublished_removed_on_error(directory: Path, written: list[tw.PackedTable]) -> Iterator[None]:
    """On a failure (a full disk, an interrupt), delete the table files this pack wrote.

    They are complete but no manifest names them; left behind they would only be swept by the
    next successful pack, filling a disk that is already full. A file the current manifest
    names (an unchanged table has the same content name) stays.
    """
    try:
        yield
    except BaseException:
        try:
            live: set[str] | None = {e.file for e in read_manifest(directory).tables.values()}
        except TableSetError:
            # No manifest yet: nothing names these files. An unreadable one: leave them be.
            live = None if (directory / MANIFEST).exists() else set()
        if live is not None:
            for packed in written:
                if packed.path.name not in live:
                    packed.path.unlink(missing_ok=True)
        raise


def published_version(directory: Path) -> int:
    """The ``table_set_version`` of ``directory``'s manifest; 0 when there is none yet, or when
    it was written before versions were numbered."""
    if not (directory / MANIFEST).exists():
        return 0
    return read_manifest(directory).table_set_version


def next_version(directory: Path) -> int:
    """The version a pack into ``directory`` publishes: one more than its manifest's."""
    return published_version(directory) + 1


def _check_newer(directory: Path, version: int) -> None:
    if not 1 <= version <= MAX_TABLE_SET_VERSION:
        raise TableSetError(f"table set version must be in [1, 2^64), got {version}")
    current = published_version(directory)
    if version <= current:
        raise TableSetError(
            f"{directory / MANIFEST}: cannot publish version {version}: the set is at version "
            f"{current} and versions only grow (servers would refuse it)"
        )


def _publish(directory: Path, manifest: Manifest) -> None:
    """Replace the manifest, then remove the files of this tool that no manifest refers to any
    more: those the replaced manifest named, table files a killed pack left under their content
    names, and temporaries. Any other file stays (a directory may hold ``.ibpt`` files of its
    own, written by ``writer.pack_table``)."""
    previous = (
        {e.file for e in read_manifest(directory).tables.values()}
        if (directory / MANIFEST).exists()
        else set()
    )
    atomic.write_bytes_atomic(directory / MANIFEST, manifest.to_json())
    live = {e.file for e in manifest.tables.values()}
    for path in directory.iterdir():
        stale_table = (
            path.suffix == tf.SUFFIX
            and path.name not in live
            and (path.name in previous or _content_named(path))
        )
        stale_temp = path.name.startswith(".") and atomic.TEMP_MARKER in path.name
        if stale_table or stale_temp:
            path.unlink(missing_ok=True)


_CONTENT_NAME = re.compile(r"\.([0-9a-f]{16})" + re.escape(tf.SUFFIX) + "$")


def _content_named(path: Path) -> bool:
    """Whether ``path`` is a table file under the content name a pack gives it, ``<stem>.<header
    checksum>.ibpt``: the checksum in its name is the one in its header."""
    match = _CONTENT_NAME.search(path.name)
    if match is None:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(tf.HEADER.size)
    except OSError:
        return False
    return (
        len(head) == tf.HEADER.size
        and head.startswith(tf.MAGIC)
        and tf.HEADER.unpack(head)[-1] == int(match[1], 16)
    )


def _entry(
    packed: tw.PackedTable,
    pooling: str | None,
    features: tuple[str, ...],
    rows: RowRange | None = None,
) -> ManifestEntry:
    row_start, total_rows = (0, None) if rows is None or rows.is_whole else (rows.start, rows.total)
    return ManifestEntry(
        file=packed.path.name,
        header_xxh3=f"{packed.header_xxh3:016x}",
        num_rows=packed.num_rows,
        dim=packed.dim,
        dtype=packed.dtype,
        quant=packed.quant,
        pooling=pooling,
        feature_names=features,
        row_start=row_start,
        total_rows=total_rows,
    )


def _source_meta(source: TableSource, features: tuple[str, ...], rows: RowRange) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "feature_names": list(features),
        "pooling": source.pooling,
        "origin": source.origin,
    }
    if source.layout is not None:
        meta["layout"] = source.layout
    if not rows.is_whole:
        meta["row_start"], meta["total_rows"] = rows.start, rows.total
    return meta


def pack_table_set(
    directory: str | os.PathLike[str],
    table_set: TableSet,
    *,
    fit: codec.FitOptions | None = None,
    progress: Callable[[TableSource], Callable[[int], None] | None] | None = None,
    on_table: Callable[[tw.PackedTable], None] | None = None,
    shard: tuple[int, int] | None = None,
    merge: bool = False,
    table_set_version: int | None = None,
    for_gpu: bool = False,
    **options: Any,
) -> list[tw.PackedTable]:
    """Pack every table of a set into ``directory`` and publish its manifest.

    Tables are packed one after another, each in bounded memory (``format.pack_table``). The
    previous manifest and its files stay valid until the new manifest replaces it.

    Parameters
    ----------
    fit : how to fit every table (``codec.FitOptions``); each table's ``quant`` is its source's.
    progress : given a table (its rows sliced to the shard's range), returns a per-step
        callback (rows done) or None.
    on_table : called with each table's report as soon as it is written.
    shard : ``(k, N)``: pack only shard k's rows of each table (:func:`split_rows`), fitted on
        those rows alone; a table with no row in the range is left out of this shard's set.
    merge : keep the tables of the set already in ``directory`` (and their features) and add or
        replace only these; by default the new manifest lists only these tables.
    table_set_version : the version to publish; None = the next (:func:`next_version`). Must be
        newer than the directory's: servers refuse a reload to an older or equal number.
    for_gpu : every table laid out for a GPU's zero-copy reads (``writer.pack_table``).
    options : ``codec.FitOptions`` fields (``sample_rows=None``...), replacing those of ``fit``.

    Raises
    ------
    TableSetError
        with ``merge``, when the directory's manifest cannot be read, or a feature a kept table
        serves is also claimed by a packed table (``TableSet.extra_features`` may remap it).
    """
    fit = dataclasses.replace(fit or codec.FitOptions(), **options)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    reports: list[tw.PackedTable] = []
    entries: dict[str, ManifestEntry] = {}
    with _pack_lock(directory), _unpublished_removed_on_error(directory, reports):
        version = next_version(directory) if table_set_version is None else table_set_version
        _check_newer(directory, version)
        shards = shard_count(directory) if merge and shard is None else None
        if shards is not None:  # the tables to keep are in the shards, not here
            raise TableSetError(
                f"{directory / SHARD_MAP}: the set has {shards} shards; a merge must keep them "
                f"(--shards {shards})"
            )
        kept = kept_for_merge(directory, table_set) if merge else Manifest({}, {})
        mapping = table_set.features()
        for source in table_set.tables:
            # Its own features, less those `--feature` maps to another table.
            own = tuple(f for f in source.features if mapping[f] == source.name)
            num_rows = source.weight.shape[0]
            rows = (
                RowRange.whole(num_rows)
                if shard is None
                else split_rows(num_rows, shard[1])[shard[0]]
            )
            if rows.start == rows.end:
                continue
            # A row slice of a contiguous tensor is itself contiguous: no copy.
            part = dataclasses.replace(source, weight=source.weight[rows.start : rows.end])
            packed = tw.pack_table(
                directory,
                part.weight,
                name=source.name,
                content_named=True,
                fit=dataclasses.replace(fit, quant=source.quant),
                meta=_source_meta(source, own, rows),
                progress=progress(part) if progress else None,
                for_gpu=for_gpu,
            )
            entries[source.name] = _entry(packed, source.pooling, own, rows)
            reports.append(packed)
            if on_table is not None:
                on_table(packed)
        tables = {**kept.tables, **entries}
        # A repacked table keeps the features that mapped to it, unless this shard left it out.
        carried = {f: t for f, t in kept.features.items() if t in tables}
        features = {f: t for f, t in mapping.items() if t in entries}
        _publish(
            directory,
            Manifest(
                tables=tables,
                features={**carried, **features},
                table_set_version=version,
            ),
        )
    return reports


def kept_for_merge(directory: Path, table_set: TableSet) -> Manifest:
    """The part of ``directory``'s set a merging pack keeps: every table it does not repack,
    and every feature it does not remap, including those of the tables it repacks (an empty set
    when there is no manifest yet)."""
    if not (directory / MANIFEST).exists():
        return Manifest({}, {})
    current = read_manifest(directory)
    packed = {source.name for source in table_set.tables}
    tables = {n: e for n, e in current.tables.items() if n not in packed}
    features = {f: t for f, t in current.features.items() if t in tables}
    explicit = table_set.extra_features
    for source in table_set.tables:
        for feature in source.features:
            if feature in features and feature not in explicit:
                raise TableSetError(
                    f"{directory / MANIFEST}: feature '{feature}' of table '{source.name}' is "
                    f"already served by table '{features[feature]}', which this merge keeps "
                    f"(map it explicitly with --feature {feature}={source.name})"
                )
    return Manifest(tables, {f: t for f, t in current.features.items() if f not in explicit})


def save_table_set(
    directory: str | os.PathLike[str],
    tables: Mapping[str, CompressedTable],
    features: Mapping[str, str],
    pooling: Mapping[str, str | None] | None = None,
    row_ranges: Mapping[str, RowRange] | None = None,
    meta: Mapping[str, Mapping[str, Any]] | None = None,
    table_set_version: int | None = None,
) -> list[tw.PackedTable]:
    """Write already compressed tables (e.g. a store snapshot with row updates) as a table set.

    ``row_ranges`` gives the global rows of tables that are shards (default: whole tables).
    ``meta`` gives more fields for a table's meta section (the ``origin`` and ``layout`` of the
    file it was loaded from, as read): the fields the writers set themselves (name, quant,
    source checksum, features, pooling) replace theirs, and a row range in it is dropped (a
    shard's comes from ``row_ranges``). ``table_set_version``: as for :func:`pack_table_set`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pooling = pooling or {}
    row_ranges = row_ranges or {}
    meta = meta or {}
    by_table: dict[str, list[str]] = {name: [] for name in tables}
    for feature, owner in features.items():
        by_table[owner].append(feature)
    reports = []
    entries: dict[str, ManifestEntry] = {}
    with _pack_lock(directory):
        version = next_version(directory) if table_set_version is None else table_set_version
        _check_newer(directory, version)
        for name, table in tables.items():
            rows = row_ranges.get(name, RowRange.whole(table.num_rows))
            extra = {
                k: v for k, v in meta.get(name, {}).items() if k not in ("row_start", "total_rows")
            }
            file_meta: dict[str, Any] = {
                **extra,
                "feature_names": by_table[name],
                "pooling": pooling.get(name),
            }
            if not rows.is_whole:
                file_meta["row_start"], file_meta["total_rows"] = rows.start, rows.total
            packed = tw.write_table(directory, table, name=name, meta=file_meta, content_named=True)
            entries[name] = _entry(packed, pooling.get(name), tuple(by_table[name]), rows)
            reports.append(packed)
        _publish(
            directory,
            Manifest(tables=entries, features=dict(features), table_set_version=version),
        )
    return reports
