# SPDX-License-Identifier: Apache-2.0
"""Table sets: a directory of ``.ibpt`` files and the ``manifest.json`` that names them.

A table set is published by its manifest. Table files are content-named
(``<table>.<header checksum>.ibpt``) and written before the manifest, and the manifest is
replaced atomically last, so a crash at any point leaves the previous manifest pointing at its own
intact files; new files only become live with the new manifest. Files no manifest references
(and temporaries of killed writers) are removed after the new manifest is in place.

Manifest (JSON)::

    {"format": "ibpembed.table_set", "version": 1,
     "tables": {"<table>": {"file": "<table>.<xxh3>.ibpt", "header_xxh3": "<16 hex>",
                            "num_rows": N, "dim": D, "dtype": "float32", "quant": null,
                            "pooling": "sum", "feature_names": ["f1", ...]}, ...},
     "features": {"<feature>": "<table>", ...}}

Row shards (manifest version 2). ``ibpembed pack --shards N`` splits every table into N
contiguous row ranges and writes one table set per shard (``shard-<k>-of-<N>/``); each entry of
a shard's manifest then also records ``"row_start"`` and ``"total_rows"``: the file holds global
rows ``[row_start, row_start + num_rows)`` of a table of ``total_rows`` rows. Version 2 is written
only when some entry is such a range, so whole-table sets stay version 1 (and byte for byte what
they were); a version-1 reader refuses a shard instead of serving its rows under the wrong ids.
Next to the shard directories, ``shard_map.json`` (:data:`SHARD_MAP`) lists every table's ranges
and the shards' addresses, for clients (``ibpembed_client.shards``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ibpembed import codec
from ibpembed.codec import CompressedTable
from ibpembed.tables import atomic
from ibpembed.tables import format as tf
from ibpembed.tables import writer as tw
from ibpembed.tables.importers import TableSet, TableSource

MANIFEST = "manifest.json"
FORMAT_NAME = "ibpembed.table_set"
MANIFEST_VERSION = 1
SHARDED_MANIFEST_VERSION = 2  # entries may hold a row range of a larger table
LOCK_FILE = ".pack.lock"
SHARD_MAP = "shard_map.json"
SHARD_MAP_FORMAT = "ibpembed.shard_map"
SHARD_MAP_VERSION = 1


class TableSetError(ValueError):
    """A table set that cannot be loaded: names the directory (or manifest) and the table."""


@dataclass(frozen=True)
class RowRange:
    """Global rows ``[start, end)`` of a table of ``total`` rows that one table set holds."""

    start: int
    end: int
    total: int

    @classmethod
    def whole(cls, num_rows: int) -> RowRange:
        return cls(0, num_rows, num_rows)

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.end == self.total


def split_rows(num_rows: int, shards: int) -> list[RowRange]:
    """The row range of each of ``shards`` shards of a ``num_rows``-row table.

    Contiguous and balanced: shard k holds ``[k * N // S, (k + 1) * N // S)``, so shard sizes
    differ by at most one row and a range is empty only when the table has fewer rows than there
    are shards. NOTE(sharding): contiguous ranges rather than ``id % S`` keep each shard's file a
    plain slice of the source (packed, fitted and verified like any table) and make routing a
    binary search over S boundaries; the cost is that hot ids clustered in one range load one
    shard more, which a hashed split would spread.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    bounds = [k * num_rows // shards for k in range(shards + 1)]
    return [RowRange(bounds[k], bounds[k + 1], num_rows) for k in range(shards)]


def shard_directory(index: int, count: int) -> str:
    """Directory name of shard ``index`` of ``count`` under a sharded pack's output."""
    return f"shard-{index}-of-{count}"


@dataclass(frozen=True)
class ManifestEntry:
    """One table of a set, as the manifest records it.

    ``row_start`` and ``total_rows`` are set for a shard: the file holds global rows
    ``[row_start, row_start + num_rows)`` of a ``total_rows``-row table. ``total_rows`` None
    means the file is the whole table.
    """

    file: str
    header_xxh3: str
    num_rows: int
    dim: int
    dtype: str
    quant: str | None
    pooling: str | None
    feature_names: tuple[str, ...]
    row_start: int = 0
    total_rows: int | None = None

    @property
    def row_range(self) -> RowRange:
        total = self.num_rows if self.total_rows is None else self.total_rows
        return RowRange(self.row_start, self.row_start + self.num_rows, total)


@dataclass(frozen=True)
class Manifest:
    tables: Mapping[str, ManifestEntry]
    features: Mapping[str, str]  # feature -> table

    def to_json(self) -> bytes:
        tables = {}
        for name, e in self.tables.items():
            entry = {**asdict(e), "feature_names": list(e.feature_names)}
            if e.row_range.is_whole:
                del entry["row_start"], entry["total_rows"]
            tables[name] = entry
        sharded = any(not e.row_range.is_whole for e in self.tables.values())
        body = {
            "format": FORMAT_NAME,
            "version": SHARDED_MANIFEST_VERSION if sharded else MANIFEST_VERSION,
            "tables": tables,
            "features": dict(self.features),
        }
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Parse and check a table set's manifest (not the table files).

    Raises
    ------
    TableSetError
        for a missing or malformed manifest (naming the table and the field at fault: a missing,
        unknown or mistyped field, or a ``file`` that is not a plain ``.ibpt`` name in the
        set's directory), an unknown version, or a feature naming a table the manifest does not
        list.
    """
    path = Path(directory) / MANIFEST
    try:
        body = json.loads(path.read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        raise TableSetError(f"{path}: no manifest; is this a packed table set?") from None
    except OSError as exc:
        raise TableSetError(f"{path}: cannot read the manifest: {exc.strerror}") from None
    except ValueError as exc:
        raise TableSetError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise TableSetError(f"{path}: not an ibpembed table set manifest")
    version = body.get("version")
    if version not in (MANIFEST_VERSION, SHARDED_MANIFEST_VERSION):
        raise TableSetError(
            f"{path}: unknown manifest version {version!r} "
            f"(this reader knows versions {MANIFEST_VERSION} and {SHARDED_MANIFEST_VERSION})"
        )
    for key in ("tables", "features"):
        if not isinstance(body.get(key), dict):
            raise TableSetError(
                f"{path}: malformed manifest: field '{key}' must be a JSON object, "
                f"got {body.get(key)!r}"
            )
    tables = {name: _parse_entry(path, name, entry) for name, entry in body["tables"].items()}
    features: dict[str, str] = {}
    for feature, table in body["features"].items():
        if not isinstance(table, str):
            raise TableSetError(
                f"{path}: feature '{feature}' must map to a table name, got {table!r}"
            )
        features[feature] = table
    for name, entry in tables.items():
        rows = entry.row_range
        if version == MANIFEST_VERSION and entry.total_rows is not None:
            raise TableSetError(f"{path}: table '{name}': a row range needs manifest version 2")
        if not 0 <= rows.start < rows.end <= rows.total:
            raise TableSetError(
                f"{path}: table '{name}': row range [{rows.start}, {rows.end}) does not lie in "
                f"a table of {rows.total} rows"
            )
    for feature, table in features.items():
        if table not in tables:
            raise TableSetError(
                f"{path}: feature '{feature}' maps to table '{table}', which the "
                "manifest does not list"
            )
    return Manifest(tables=tables, features=features)


def _is_count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_file_name(value: Any) -> bool:
    """A plain ``.ibpt`` file name: no directory part, not hidden, so it stays in the set."""
    return (
        isinstance(value, str)
        and value.endswith(tf.SUFFIX)
        and not value.startswith(".")
        and not any(c in value for c in ("/", "\\", "\0"))
    )


# Each entry field: (check, what it must be). Fields with a default may be left out.
_ENTRY_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "file": (_is_file_name, "a plain file name ending in .ibpt, in the set's directory"),
    "header_xxh3": (
        lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{16}", v) is not None,
        "16 lowercase hex digits",
    ),
    "num_rows": (lambda v: _is_count(v, 1), "a positive integer"),
    "dim": (lambda v: _is_count(v, 1), "a positive integer"),
    "dtype": (lambda v: isinstance(v, str), "a dtype name"),
    "quant": (lambda v: v is None or isinstance(v, str), "null or a string"),
    "pooling": (lambda v: v is None or isinstance(v, str), "null or a string"),
    "feature_names": (
        lambda v: isinstance(v, list) and all(isinstance(f, str) for f in v),
        "a list of strings",
    ),
    "row_start": (lambda v: _is_count(v, 0), "a non-negative integer"),
    "total_rows": (lambda v: v is None or _is_count(v, 1), "null or a positive integer"),
}
_ENTRY_DEFAULTS = {"row_start": 0, "total_rows": None}


def _parse_entry(path: Path, name: str, raw: Any) -> ManifestEntry:
    """One manifest entry, every field type-checked (TableSetError naming the field)."""
    where = f"{path}: table '{name}'"
    if not isinstance(raw, dict):
        raise TableSetError(f"{where}: the entry must be a JSON object, got {raw!r}")
    unknown = sorted(set(raw) - _ENTRY_FIELDS.keys())
    if unknown:
        raise TableSetError(f"{where}: unknown field(s) {unknown}")
    values: dict[str, Any] = {}
    for key, (check, expected) in _ENTRY_FIELDS.items():
        if key not in raw and key not in _ENTRY_DEFAULTS:
            raise TableSetError(f"{where}: field '{key}' is missing")
        value = raw.get(key, _ENTRY_DEFAULTS.get(key))
        if not check(value):
            raise TableSetError(f"{where}: field '{key}' must be {expected}, got {value!r}")
        values[key] = value
    return ManifestEntry(**{**values, "feature_names": tuple(values["feature_names"])})


def check_entry(
    manifest_path: str | os.PathLike[str], name: str, entry: ManifestEntry, loaded: tf.TableFile
) -> None:
    """Check that ``loaded`` is the file ``entry`` describes: its header checksum and name, and
    the rows, width, dtype, quantisation and row range its header and metadata record.

    Raises
    ------
    TableSetError
        naming the manifest, the table, the field and both values.
    """
    if f"{loaded.header.header_xxh3:016x}" != entry.header_xxh3 or loaded.name != name:
        raise TableSetError(
            f"{manifest_path}: table '{name}': {loaded.path} does not match its entry (header "
            f"checksum or name differs: the file was replaced after the manifest was written)"
        )
    header, meta = loaded.header, loaded.meta
    in_file = {
        "num_rows": header.num_rows,
        "dim": header.dim,
        "dtype": tf.dtype_name(loaded.table.dtype),
        "quant": loaded.table.quant,
        "row_start": meta.get("row_start", 0),
        "total_rows": meta.get("total_rows", header.num_rows),
    }
    in_manifest = {
        "num_rows": entry.num_rows,
        "dim": entry.dim,
        "dtype": entry.dtype,
        "quant": entry.quant,
        "row_start": entry.row_start,
        "total_rows": entry.row_range.total,
    }
    for key, value in in_manifest.items():
        if value != in_file[key]:
            raise TableSetError(
                f"{manifest_path}: table '{name}': {key} is {value!r} in the manifest but "
                f"{in_file[key]!r} in {loaded.path}"
            )


def load_table_set(
    directory: str | os.PathLike[str],
    *,
    verify: bool = False,
    reuse: Callable[[str, ManifestEntry], CompressedTable | None] | None = None,
) -> tuple[Manifest, dict[str, CompressedTable]]:
    """Load every table a manifest lists (all or nothing).

    Parameters
    ----------
    verify : also hash every payload (see ``format.read_table``).
    reuse : returns an already loaded table for an entry that did not change, or None; lets a
        reload skip unchanged files.

    Raises
    ------
    TableSetError
        for a bad manifest or a table file missing or not matching its manifest entry
        (``check_entry``).
    format.TableFileError
        for a corrupt table file (naming the file and section).
    """
    manifest, tables, _ = load_table_set_meta(directory, verify=verify, reuse=reuse)
    return manifest, tables


def load_table_set_meta(
    directory: str | os.PathLike[str],
    *,
    verify: bool = False,
    prefetch: bool = False,
    reuse: Callable[[str, ManifestEntry], CompressedTable | None] | None = None,
) -> tuple[Manifest, dict[str, CompressedTable], dict[str, Mapping[str, Any]]]:
    """``load_table_set``, and the meta section of every table it read from its file (tables
    ``reuse`` returned are not read, so have none). ``prefetch``: see ``format.read_table``."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    tables: dict[str, CompressedTable] = {}
    metas: dict[str, Mapping[str, Any]] = {}
    for name, entry in manifest.tables.items():
        previous = reuse(name, entry) if reuse is not None else None
        if previous is not None:
            tables[name] = previous
            continue
        path = directory / entry.file
        if not path.is_file():
            raise TableSetError(f"{directory / MANIFEST}: table '{name}': file {path} is missing")
        loaded = tf.read_table(path, verify=verify, prefetch=prefetch)
        check_entry(directory / MANIFEST, name, entry, loaded)
        tables[name] = loaded.table
        metas[name] = loaded.meta
    return manifest, tables, metas


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
        for packed in written if live is not None else ():
            if packed.path.name not in live:
                packed.path.unlink(missing_ok=True)
        raise


def _publish(directory: Path, manifest: Manifest) -> None:
    """Replace the manifest, then remove files no manifest refers to any more."""
    atomic.write_bytes_atomic(directory / MANIFEST, manifest.to_json())
    live = {e.file for e in manifest.tables.values()}
    for path in directory.iterdir():
        stale_table = path.suffix == tf.SUFFIX and path.name not in live
        stale_temp = path.name.startswith(".") and atomic.TEMP_MARKER in path.name
        if stale_table or stale_temp:
            path.unlink(missing_ok=True)


def _entry(
    packed: tw.PackedTable,
    pooling: str | None,
    features: tuple[str, ...],
    rows: RowRange | None = None,
) -> ManifestEntry:
    sharded = rows is not None and not rows.is_whole
    return ManifestEntry(
        file=packed.path.name,
        header_xxh3=f"{packed.header_xxh3:016x}",
        num_rows=packed.num_rows,
        dim=packed.dim,
        dtype=packed.dtype,
        quant=packed.quant,
        pooling=pooling,
        feature_names=features,
        row_start=rows.start if sharded else 0,
        total_rows=rows.total if sharded else None,
    )


def _source_meta(source: TableSource, rows: RowRange) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "feature_names": list(source.features),
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
    method: codec.Method = "ibpembed",
    sample_rows: int | None = codec.DEFAULT_SAMPLE_ROWS,
    seed: int = 0,
    align: int | None = codec.DEFAULT_ALIGN,
    chunk_bits: int | None = None,
    code_bits: int | None = None,
    progress: Callable[[TableSource], Callable[[int], None] | None] | None = None,
    on_table: Callable[[tw.PackedTable], None] | None = None,
    shard: tuple[int, int] | None = None,
    merge: bool = False,
) -> list[tw.PackedTable]:
    """Pack every table of a set into ``directory`` and publish its manifest.

    Tables are packed one after another, each in bounded memory (``writer.pack_table``). The
    previous manifest and its files stay valid until the new manifest replaces it.

    Parameters
    ----------
    progress : given a table (its rows sliced to the shard's range), returns a per-step
        callback (rows done) or None.
    on_table : called with each table's report as soon as it is written.
    shard : ``(k, N)``: pack only shard k's rows of each table (:func:`split_rows`), fitted on
        those rows alone; a table with no row in the range is left out of this shard's set.
    merge : keep the tables of the set already in ``directory`` (and their features) and add or
        replace only these; by default the new manifest lists only these tables.

    Raises
    ------
    TableSetError
        with ``merge``, when the directory's manifest cannot be read, or a feature a kept table
        serves is also claimed by a packed table (``TableSet.extra_features`` may remap it).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    reports = []
    entries: dict[str, ManifestEntry] = {}
    with _pack_lock(directory), _unpublished_removed_on_error(directory, reports):
        kept = _kept_for_merge(directory, table_set) if merge else Manifest({}, {})
        for source in table_set.tables:
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
                quant=source.quant,
                method=method,
                sample_rows=sample_rows,
                seed=seed,
                align=align,
                chunk_bits=chunk_bits,
                code_bits=code_bits,
                meta=_source_meta(source, rows),
                progress=progress(part) if progress else None,
            )
            entries[source.name] = _entry(packed, source.pooling, source.features, rows)
            reports.append(packed)
            if on_table is not None:
                on_table(packed)
        features = {f: t for f, t in table_set.features().items() if t in entries}
        _publish(
            directory,
            Manifest(tables={**kept.tables, **entries}, features={**kept.features, **features}),
        )
    return reports


def _kept_for_merge(directory: Path, table_set: TableSet) -> Manifest:
    """The part of ``directory``'s set a merging pack keeps: every table it does not repack,
    with the features that map to them (an empty set when there is no manifest yet)."""
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
    return Manifest(tables, {f: t for f, t in features.items() if f not in explicit})


@dataclass(frozen=True)
class ShardReport:
    """One shard of a sharded pack: its directory and the tables written there."""

    index: int
    directory: Path
    tables: list[tw.PackedTable]


def pack_shards(
    directory: str | os.PathLike[str],
    table_set: TableSet,
    shards: int,
    *,
    address_template: str | None = None,
    progress: Callable[[TableSource], Callable[[int], None] | None] | None = None,
    **pack_args: Any,
) -> list[ShardReport]:
    """Split every table into ``shards`` row ranges and pack one table set per shard.

    Writes ``directory/shard-<k>-of-<N>/`` (each a complete table set, see
    :func:`pack_table_set` with ``shard=(k, N)``), then ``directory/shard_map.json``
    (:func:`shard_map`) atomically, last.

    Parameters
    ----------
    address_template : the shards' gRPC addresses, ``{shard}`` standing for k (e.g.
        ``ibpembed-{shard}.ibpembed:50051`` for a StatefulSet's pods); None leaves the
        addresses out of the shard map, for clients to supply.
    progress : as for :func:`pack_table_set`.
    pack_args : ``method``, ``sample_rows``, ``seed``, ``align``, ``chunk_bits``, ``code_bits``,
        ``merge`` (keep the other tables of every shard, and their entries in the shard map).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    previous = None
    if pack_args.get("merge"):
        previous = _previous_shard_map(directory, shards)
        # Every shard's conflicts before any shard is published: a merge that failed on a later
        # shard would leave the earlier ones serving the new tables.
        for k in range(shards):
            _kept_for_merge(directory / shard_directory(k, shards), table_set)
    reports = []
    for k in range(shards):
        target = directory / shard_directory(k, shards)
        packed = pack_table_set(
            target, table_set, shard=(k, shards), progress=progress, **pack_args
        )
        reports.append(ShardReport(k, target, packed))
    body = shard_map(table_set, shards, address_template)
    if previous is not None:  # the kept tables' ranges and features, then the packed ones
        kept = {n: t for n, t in previous["tables"].items() if n not in body["tables"]}
        body["tables"] = dict(sorted({**kept, **body["tables"]}.items()))
        kept_features = {f: t for f, t in previous["features"].items() if t in kept}
        body["features"] = {**kept_features, **body["features"]}
        if address_template is None:  # the addresses the set was deployed with
            body["shards"] = previous["shards"]
    atomic.write_bytes_atomic(
        directory / SHARD_MAP, json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"
    )
    return reports


def _previous_shard_map(directory: Path, shards: int) -> dict[str, Any] | None:
    """``directory``'s shard map, for a merging pack (None when there is none yet)."""
    path = directory / SHARD_MAP
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_bytes())
        count = len(body["shards"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TableSetError(f"{path}: cannot merge into this shard map: {exc}") from None
    if count != shards:
        raise TableSetError(
            f"{path}: the set has {count} shards; a merge must keep them (--shards {count})"
        )
    return body


def shard_map(
    table_set: TableSet, shards: int, address_template: str | None = None
) -> dict[str, Any]:
    """The ``shard_map.json`` body of a sharded pack (format in ``docs/format.md``)::

        {"format": "ibpembed.shard_map", "version": 1,
         "shards": [{"index": 0, "directory": "shard-0-of-3", "address": "host:port" | null}],
         "tables": {"<table>": {"num_rows": N, "dim": D, "dtype": "float32", "quant": null,
                                "ranges": [{"shard": 0, "row_start": 0, "row_end": 334}, ...]}},
         "features": {"<feature>": "<table>"}}

    Shards whose range of a table is empty are not listed among that table's ranges.
    """
    tables = {}
    for source in table_set.tables:
        num_rows = source.weight.shape[0]
        ranges = [
            {"shard": k, "row_start": r.start, "row_end": r.end}
            for k, r in enumerate(split_rows(num_rows, shards))
            if r.start < r.end
        ]
        tables[source.name] = {
            "num_rows": num_rows,
            "dim": source.weight.shape[1],
            "dtype": tf.dtype_name(source.weight.dtype),
            "quant": source.quant,
            "ranges": ranges,
        }
    return {
        "format": SHARD_MAP_FORMAT,
        "version": SHARD_MAP_VERSION,
        "shards": [
            {
                "index": k,
                "directory": shard_directory(k, shards),
                "address": None if address_template is None else address_template.format(shard=k),
            }
            for k in range(shards)
        ],
        "tables": tables,
        "features": dict(table_set.features()),
    }


def save_table_set(
    directory: str | os.PathLike[str],
    tables: Mapping[str, CompressedTable],
    features: Mapping[str, str],
    pooling: Mapping[str, str | None] | None = None,
    row_ranges: Mapping[str, RowRange] | None = None,
    meta: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[tw.PackedTable]:
    """Write already compressed tables (e.g. a store snapshot with row updates) as a table set.

    ``row_ranges`` gives the global rows of tables that are shards (default: whole tables).
    ``meta`` gives more fields for a table's meta section (the ``origin`` and ``layout`` of the
    file it was loaded from, as read): the fields the writers set themselves (name, quant,
    source checksum, features, pooling) replace theirs, and a row range in it is dropped (a
    shard's comes from ``row_ranges``).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pooling = pooling or {}
    row_ranges = row_ranges or {}
    meta = meta or {}
    by_table: dict[str, list[str]] = {name: [] for name in tables}
    for feature, table in features.items():
        by_table[table].append(feature)
    reports = []
    entries: dict[str, ManifestEntry] = {}
    with _pack_lock(directory):
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
        _publish(directory, Manifest(tables=entries, features=dict(features)))
    return reports
