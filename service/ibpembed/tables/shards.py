# SPDX-License-Identifier: Apache-2.0
"""Packing a table set split by row range across servers (``ibpembed pack --shards N``).

Every table is split into N contiguous row ranges (:func:`ibpembed.tables.manifest.split_rows`)
and each shard's rows packed as a table set of its own under ``shard-<k>-of-<N>/``
(:func:`ibpembed.tables.pack.pack_table_set`); ``shard_map.json`` next to them lists every
table's ranges and the shards' addresses, for clients (``ibpembed_client.shard_map``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ibpembed.tables import atomic
from ibpembed.tables import format as tf
from ibpembed.tables import writer as tw
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import (
    MANIFEST,
    SHARD_MAP,
    SHARD_MAP_FORMAT,
    SHARD_MAP_VERSION,
    TableSetError,
    shard_directory,
    split_rows,
)
from ibpembed.tables.pack import kept_for_merge, pack_table_set, published_version


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
    pack_args : as for :func:`pack_table_set`: ``fit`` or its fields (``sample_rows``...),
        ``merge`` (keep the other tables of every shard, and their entries in the shard map).
    """
    # The addresses (and so the whole map) first: a template that does not expand must stop
    # the pack before any shard is published, or the set is left with shards and no map.
    body = shard_map(table_set, shards, address_template)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    previous = None
    if pack_args.get("merge"):
        previous = _previous_shard_map(directory, shards)
        if previous is None and (directory / MANIFEST).exists():
            # The tables to keep are in one whole-table set: shards would leave them out.
            raise TableSetError(
                f"{directory / MANIFEST}: the set is not split into shards; a merge must keep "
                "it whole (no --shards)"
            )
        # Every shard's conflicts before any shard is published: a merge that failed on a later
        # shard would leave the earlier ones serving the new tables.
        for k in range(shards):
            kept_for_merge(directory / shard_directory(k, shards), table_set)
    # One number for every shard, so a client can pin a request to it on all of them.
    version = pack_args.pop("table_set_version", None) or 1 + max(
        published_version(directory / shard_directory(k, shards)) for k in range(shards)
    )
    reports = []
    for k in range(shards):
        target = directory / shard_directory(k, shards)
        packed = pack_table_set(
            target,
            table_set,
            shard=(k, shards),
            progress=progress,
            table_set_version=version,
            **pack_args,
        )
        reports.append(ShardReport(k, target, packed))
    body["table_set_version"] = version
    if previous is not None:  # the kept tables' ranges and every feature not remapped
        kept = {n: t for n, t in previous["tables"].items() if n not in body["tables"]}
        body["tables"] = dict(sorted({**kept, **body["tables"]}.items()))
        kept_features = {f: t for f, t in previous["features"].items() if t in body["tables"]}
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


def shard_addresses(template: str, shards: int) -> list[str]:
    """``template`` expanded for each of ``shards`` shards, ``{shard}`` standing for k.

    Raises ValueError for a template that does not expand (another field, ``{}``, a brace left
    open) or that names one address for several shards: each shard has servers of its own.
    """
    try:
        addresses = [template.format(shard=k) for k in range(shards)]
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise ValueError(
            f"address template {template!r} does not expand ({{shard}} is its only field): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if len(set(addresses)) < shards:
        raise ValueError(
            f"address template {template!r} gives two shards the same address; "
            "put {shard} where the shard number goes"
        )
    return addresses


def shard_map(
    table_set: TableSet, shards: int, address_template: str | None = None
) -> dict[str, Any]:
    """The ``shard_map.json`` body of a sharded pack (format in ``docs/format.md``)::

        {"format": "ibpembed.shard_map", "version": 1,
         "shards": [{"index": 0, "directory": "shard-0-of-3", "address": "host:port" | null}],
         "tables": {"<table>": {"num_rows": N, "dim": D, "dtype": "float32", "quant": null,
                                "ranges": [{"shard": 0, "row_start": 0, "row_end": 334}, ...]}},
         "features": {"<feature>": "<table>"}}

    Shards whose range of a table is empty are not listed among that table's ranges. A bad
    ``address_template`` is a ValueError (:func:`shard_addresses`).
    """
    addresses = (
        [None] * shards if address_template is None else shard_addresses(address_template, shards)
    )
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
            {"index": k, "directory": shard_directory(k, shards), "address": address}
            for k, address in enumerate(addresses)
        ],
        "tables": tables,
        "features": dict(table_set.features()),
    }
