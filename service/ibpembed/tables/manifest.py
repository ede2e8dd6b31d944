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
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ibpembed import codec
from ibpembed.codec import CompressedTable
from ibpembed.tables import format as tf
from ibpembed.tables.importers import TableSet, TableSource

MANIFEST = "manifest.json"
FORMAT_NAME = "ibpembed.table_set"
MANIFEST_VERSION = 1
LOCK_FILE = ".pack.lock"


class TableSetError(ValueError):
    """A table set that cannot be loaded: names the directory (or manifest) and the table."""


@dataclass(frozen=True)
class ManifestEntry:
    """One table of a set, as the manifest records it."""

    file: str
    header_xxh3: str
    num_rows: int
    dim: int
    dtype: str
    quant: str | None
    pooling: str | None
    feature_names: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    tables: Mapping[str, ManifestEntry]
    features: Mapping[str, str]  # feature -> table

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "version": MANIFEST_VERSION,
            "tables": {
                name: {**asdict(e), "feature_names": list(e.feature_names)}
                for name, e in self.tables.items()
            },
            "features": dict(self.features),
        }
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Parse and check a table set's manifest (not the table files).

    Raises
    ------
    TableSetError
        for a missing or malformed manifest, an unknown version, or a feature naming a table the
        manifest does not list.
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
    if body.get("version") != MANIFEST_VERSION:
        raise TableSetError(
            f"{path}: unknown manifest version {body.get('version')!r} "
            f"(this reader knows version {MANIFEST_VERSION})"
        )
    try:
        tables = {
            name: ManifestEntry(**{**entry, "feature_names": tuple(entry["feature_names"])})
            for name, entry in body["tables"].items()
        }
        features = {str(f): str(t) for f, t in body["features"].items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise TableSetError(f"{path}: malformed manifest: {exc!r}") from None
    for feature, table in features.items():
        if table not in tables:
            raise TableSetError(
                f"{path}: feature '{feature}' maps to table '{table}', which the "
                "manifest does not list"
            )
    return Manifest(tables=tables, features=features)


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
        for a bad manifest or a table file missing or not matching the manifest.
    format.TableFileError
        for a corrupt table file (naming the file and section).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    tables: dict[str, CompressedTable] = {}
    for name, entry in manifest.tables.items():
        previous = reuse(name, entry) if reuse is not None else None
        if previous is not None:
            tables[name] = previous
            continue
        path = directory / entry.file
        if not path.is_file():
            raise TableSetError(f"{directory / MANIFEST}: table '{name}': file {path} is missing")
        loaded = tf.read_table(path, verify=verify)
        if f"{loaded.header.header_xxh3:016x}" != entry.header_xxh3 or loaded.name != name:
            raise TableSetError(
                f"{path}: does not match the manifest entry for table '{name}' (header checksum "
                f"or name differs: the file was replaced after the manifest was written)"
            )
        tables[name] = loaded.table
    return manifest, tables


@contextlib.contextmanager
def _pack_lock(directory: Path) -> Iterator[None]:
    """One writer per directory: a second concurrent pack fails instead of interleaving."""
    with open(directory / LOCK_FILE, "a+b") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TableSetError(f"{directory}: another pack is writing this table set") from None
        yield


def _publish(directory: Path, manifest: Manifest) -> None:
    """Replace the manifest, then remove files no manifest refers to any more."""
    tf.write_bytes_atomic(directory / MANIFEST, manifest.to_json())
    live = {e.file for e in manifest.tables.values()}
    for path in directory.iterdir():
        stale_table = path.suffix == tf.SUFFIX and path.name not in live
        stale_temp = path.name.startswith(".") and tf.TEMP_MARKER in path.name
        if stale_table or stale_temp:
            path.unlink(missing_ok=True)


def _entry(packed: tf.PackedTable, pooling: str | None, features: tuple[str, ...]) -> ManifestEntry:
    return ManifestEntry(
        file=packed.path.name,
        header_xxh3=f"{packed.header_xxh3:016x}",
        num_rows=packed.num_rows,
        dim=packed.dim,
        dtype=packed.dtype,
        quant=packed.quant,
        pooling=pooling,
        feature_names=features,
    )


def _source_meta(source: TableSource) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "feature_names": list(source.features),
        "pooling": source.pooling,
        "origin": source.origin,
    }
    if source.layout is not None:
        meta["layout"] = source.layout
    return meta


def pack_table_set(
    directory: str | os.PathLike[str],
    table_set: TableSet,
    *,
    method: codec.Method = "ibpembed",
    sample_rows: int | None = codec.DEFAULT_SAMPLE_ROWS,
    seed: int = 0,
    align: int = codec.DEFAULT_ALIGN,
    chunk_bits: int | None = None,
    progress: Callable[[TableSource], Callable[[int], None] | None] | None = None,
    on_table: Callable[[tf.PackedTable], None] | None = None,
) -> list[tf.PackedTable]:
    """Pack every table of a set into ``directory`` and publish its manifest.

    Tables are packed one after another, each in bounded memory (``format.pack_table``). The
    previous manifest and its files stay valid until the new manifest replaces it.

    Parameters
    ----------
    progress : given a table, returns a per-step callback (rows done) or None.
    on_table : called with each table's report as soon as it is written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    reports = []
    entries: dict[str, ManifestEntry] = {}
    with _pack_lock(directory):
        for source in table_set.tables:
            packed = tf.pack_table(
                directory,
                source.weight,
                name=source.name,
                content_named=True,
                quant=source.quant,
                method=method,
                sample_rows=sample_rows,
                seed=seed,
                align=align,
                chunk_bits=chunk_bits,
                meta=_source_meta(source),
                progress=progress(source) if progress else None,
            )
            entries[source.name] = _entry(packed, source.pooling, source.features)
            reports.append(packed)
            if on_table is not None:
                on_table(packed)
        _publish(directory, Manifest(tables=entries, features=table_set.features()))
    return reports


def save_table_set(
    directory: str | os.PathLike[str],
    tables: Mapping[str, CompressedTable],
    features: Mapping[str, str],
    pooling: Mapping[str, str | None] | None = None,
) -> list[tf.PackedTable]:
    """Write already compressed tables (e.g. a store snapshot with row updates) as a table set."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pooling = pooling or {}
    by_table: dict[str, list[str]] = {name: [] for name in tables}
    for feature, table in features.items():
        by_table[table].append(feature)
    reports = []
    entries: dict[str, ManifestEntry] = {}
    with _pack_lock(directory):
        for name, table in tables.items():
            meta = {"feature_names": by_table[name], "pooling": pooling.get(name)}
            packed = tf.write_table(directory, table, name=name, meta=meta, content_named=True)
            entries[name] = _entry(packed, pooling.get(name), tuple(by_table[name]))
            reports.append(packed)
        _publish(directory, Manifest(tables=entries, features=dict(features)))
    return reports
