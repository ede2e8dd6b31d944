# SPDX-License-Identifier: Apache-2.0
"""Table sets: a directory of ``.ibpt`` files and the ``manifest.json`` that names them.

The read side: parse and check a manifest, load the tables it names. Writing a set (packing,
publishing) is :mod:`ibpembed.tables.pack`; packing row shards :mod:`ibpembed.tables.shards`.

Manifest (JSON)::

    {"format": "ibpembed.table_set", "version": 1,
     "tables": {"<table>": {"file": "<table>.<xxh3>.ibpt", "header_xxh3": "<16 hex>",
                            "num_rows": N, "dim": D, "dtype": "float32", "quant": null,
                            "pooling": "sum", "feature_names": ["f1", ...]}, ...},
     "features": {"<feature>": "<table>", ...}, "table_set_version": 7}

Published versions. Every pack numbers the set it publishes ``table_set_version``: one more than
the manifest it replaces (1 for a new directory; a sharded pack gives every shard the same
number). Servers report the number as the version that served each lookup, and frontends pin
requests to it (``LookupRequest.table_version``). Manifests written before versions were
numbered have no such field: a server numbers their sets itself, counting its reloads from 1.

Row shards (manifest version 2). ``ibpembed pack --shards N`` splits every table into N
contiguous row ranges and writes one table set per shard (``shard-<k>-of-<N>/``); each entry of
a shard's manifest then also records ``"row_start"`` and ``"total_rows"``: the file holds global
rows ``[row_start, row_start + num_rows)`` of a table of ``total_rows`` rows. Version 2 is written
only when some entry is such a range, so whole-table sets stay version 1 (and byte for byte what
they were); a version-1 reader refuses a shard instead of serving its rows under the wrong ids.
Next to the shard directories, ``shard_map.json`` (:data:`SHARD_MAP`) lists every table's ranges
and the shards' addresses, for clients (``ibpembed_client.shard_map``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ibpembed.codec import CompressedTable
from ibpembed.tables import format as tf

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


# Versions travel as uint64 in the protocol; 0 there means "newest".
MAX_TABLE_SET_VERSION = (1 << 64) - 1


@dataclass(frozen=True)
class Manifest:
    tables: Mapping[str, ManifestEntry]
    features: Mapping[str, str]  # feature -> table
    table_set_version: int = 0  # the published version; 0 = not numbered (an older pack)

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
        if self.table_set_version:
            body["table_set_version"] = self.table_set_version
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
        raise TableSetError(f"{path}: no manifest; {_not_a_set(Path(directory))}") from None
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
    table_set_version = body.get("table_set_version", 0)
    if "table_set_version" in body and not (
        _is_count(table_set_version, 1) and table_set_version <= MAX_TABLE_SET_VERSION
    ):
        raise TableSetError(
            f"{path}: malformed manifest: field 'table_set_version' must be an integer in "
            f"[1, 2^64), got {table_set_version!r}"
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
    return Manifest(tables=tables, features=features, table_set_version=table_set_version)


def _not_a_set(directory: Path) -> str:
    """Why a directory without a manifest is not a table set: the root of a sharded pack holds
    one per shard, which is what to name."""
    try:
        count = shard_count(directory)
    except TableSetError:
        count = None
    if count is None:
        return "is this a packed table set?"
    return (
        f"{directory} holds {count} row shards ({SHARD_MAP}), each a table set: name one, "
        f"e.g. {directory / shard_directory(0, count)}"
    )


def shard_count(directory: str | os.PathLike[str]) -> int | None:
    """How many shards the ``shard_map.json`` in ``directory`` lists; None when there is none.

    Raises
    ------
    TableSetError
        for a shard map that cannot be read.
    """
    path = Path(directory) / SHARD_MAP
    if not path.exists():
        return None
    try:
        return len(json.loads(path.read_bytes())["shards"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TableSetError(f"{path}: cannot read the shard map: {exc}") from None


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
    manifest_path: str | os.PathLike[str], name: str, entry: ManifestEntry, loaded: tf.FileLayout
) -> None:
    """Check that ``loaded`` (a loaded table file, or its layout alone) is the file ``entry``
    describes: its header checksum and name, and the rows, width, dtype, quantisation and row
    range its header and metadata record.

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
        "dtype": tf.dtype_name(header.dtype),
        "quant": header.quant,
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
    shared: bool = False,
    reuse: Callable[[str, ManifestEntry], CompressedTable | None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Manifest, dict[str, CompressedTable], dict[str, Mapping[str, Any]]]:
    """``load_table_set``, and the meta section of every table it read from its file (tables
    ``reuse`` returned are not read, so have none). ``prefetch``, ``shared`` (the mapping
    mode): see ``format.read_table``.
    ``progress(done, total)``: called before the first table and after each (in tables)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    tables: dict[str, CompressedTable] = {}
    metas: dict[str, Mapping[str, Any]] = {}
    total = len(manifest.tables)
    if progress is not None:
        progress(0, total)
    for done, (name, entry) in enumerate(manifest.tables.items(), 1):
        previous = reuse(name, entry) if reuse is not None else None
        if previous is not None:
            tables[name] = previous
            if progress is not None:
                progress(done, total)
            continue
        path = directory / entry.file
        if not path.is_file():
            raise TableSetError(f"{directory / MANIFEST}: table '{name}': file {path} is missing")
        loaded = tf.read_table(path, verify=verify, prefetch=prefetch, shared=shared)
        check_entry(directory / MANIFEST, name, entry, loaded)
        tables[name] = loaded.table
        metas[name] = loaded.meta
        if progress is not None:
            progress(done, total)
    return manifest, tables, metas
