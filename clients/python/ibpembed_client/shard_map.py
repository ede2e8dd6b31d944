# SPDX-License-Identifier: Apache-2.0
"""The shard map of a row-sharded table set: which server holds which rows of each table.

A table set packed with ``ibpembed pack --shards N`` splits every table into N contiguous row
ranges, one server (or one group of replicas behind one address) per range. A :class:`ShardMap`
says which server holds which rows (table -> row ranges -> address); it comes from the servers
themselves (:meth:`ShardMap.discover`, their ListTables answers) or from the ``shard_map.json``
the pack wrote (:meth:`ShardMap.load`). The clients in :mod:`ibpembed_client.shards` route by it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ibpembed_client._client import LookupClient
from ibpembed_client._errors import LookupServiceError
from ibpembed_client._result import TableInfo

SHARD_MAP_FORMAT = "ibpembed.shard_map"
SHARD_MAP_VERSION = 1
# fbgemm row-wise int8 rows start with an fp16 scale and an fp16 bias; pooling drops them.
_INT8_ROWWISE_HEADER_BYTES = 4


@dataclass(frozen=True)
class ShardRange:
    """Global rows ``[row_start, row_end)`` of a table, held by server ``shard``."""

    shard: int
    row_start: int
    row_end: int


@dataclass(frozen=True)
class ShardedTable:
    """One logical table and the servers holding its rows.

    Parameters
    ----------
    name, num_rows, dim, dtype, quant : the whole table (``dtype`` named as in
        :class:`~ibpembed_client.TableInfo`; ``quant`` ``"int8_rowwise"`` or None).
    ranges : ranges tiling ``[0, num_rows)``, in any order (kept sorted by row).

    Raises
    ------
    ValueError
        when the ranges leave a gap or overlap (naming the rows and shards), or one shard holds
        two ranges.
    """

    name: str
    num_rows: int
    dim: int
    dtype: str
    quant: str | None
    ranges: tuple[ShardRange, ...]
    # Start row of every range but the first: searchsorted over it gives an id's range index.
    _bounds: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranges = tuple(sorted(self.ranges, key=lambda r: r.row_start))
        object.__setattr__(self, "ranges", ranges)
        # A server holds one row range of a table; a shard request naming the feature twice
        # would be rejected as "feature repeated".
        held: dict[int, ShardRange] = {}
        for r in ranges:
            if r.shard in held:
                other = held[r.shard]
                raise ValueError(
                    f"table '{self.name}': shard {r.shard} holds two ranges, rows "
                    f"[{other.row_start}, {other.row_end}) and [{r.row_start}, {r.row_end})"
                )
            held[r.shard] = r
        end = 0
        for r in ranges:
            if r.row_start > end:
                raise ValueError(
                    f"table '{self.name}': rows [{end}, {r.row_start}) are held by no shard"
                )
            if r.row_start < end:
                raise ValueError(
                    f"table '{self.name}': rows [{r.row_start}, {min(end, r.row_end)}) are held "
                    f"by more than one shard (shard {r.shard} and another)"
                )
            if r.row_end <= r.row_start:
                raise ValueError(f"table '{self.name}': shard {r.shard} holds an empty range")
            end = r.row_end
        if end != self.num_rows:
            raise ValueError(
                f"table '{self.name}': rows [{end}, {self.num_rows}) are held by no shard"
            )
        bounds = np.array([r.row_start for r in ranges[1:]], dtype=np.int64)
        object.__setattr__(self, "_bounds", bounds)

    @property
    def pooled_dim(self) -> int:
        """Width of a SUM/MEAN result row (row-wise int8 rows lose their scale and bias)."""
        if self.quant == "int8_rowwise":
            return self.dim - _INT8_ROWWISE_HEADER_BYTES
        return self.dim

    def range_index(self, ids: np.ndarray) -> np.ndarray:
        """Index into ``ranges`` of each id (ids must lie in ``[0, num_rows)``)."""
        return np.searchsorted(self._bounds, ids, side="right")


@dataclass(frozen=True)
class ShardMap:
    """Which server holds which rows: table -> row ranges -> address.

    Parameters
    ----------
    addresses : ``host:port`` of each shard; ``ShardRange.shard`` indexes it.
    tables : table name -> :class:`ShardedTable`.
    features : feature name -> table name.

    Raises
    ------
    ValueError
        for a feature naming an unknown table or a range naming an unknown shard.
    """

    addresses: tuple[str, ...]
    tables: Mapping[str, ShardedTable]
    features: Mapping[str, str]

    def __post_init__(self) -> None:
        for feature, table_name in self.features.items():
            if table_name not in self.tables:
                raise ValueError(f"feature '{feature}' maps to unknown table '{table_name}'")
        for table in self.tables.values():
            for r in table.ranges:
                if not 0 <= r.shard < len(self.addresses):
                    raise ValueError(
                        f"table '{table.name}': range [{r.row_start}, {r.row_end}) names shard "
                        f"{r.shard}, but there are {len(self.addresses)} addresses"
                    )

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str], addresses: Sequence[str] | None = None) -> ShardMap:
        """Read the ``shard_map.json`` written by ``ibpembed pack --shards N``.

        Parameters
        ----------
        path : the file, or the pack's output directory holding it.
        addresses : every shard's address, in shard order; replaces those in the file
            (which has none unless the pack was given ``--shard-address``).

        Raises
        ------
        ValueError
            for a file that is not a shard map, an unknown version, a shard without an
            address, or ranges that do not tile a table.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "shard_map.json"
        try:
            body = json.loads(path.read_bytes())
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(body, dict) or body.get("format") != SHARD_MAP_FORMAT:
            raise ValueError(f"{path}: not an ibpembed shard map")
        if body.get("version") != SHARD_MAP_VERSION:
            raise ValueError(
                f"{path}: unknown shard map version {body.get('version')!r} "
                f"(this client knows version {SHARD_MAP_VERSION})"
            )
        try:
            shards = sorted(body["shards"], key=lambda s: s["index"])
            if addresses is None:
                addresses = [s["address"] for s in shards]
            if len(addresses) != len(shards):
                raise ValueError(f"{len(addresses)} addresses for {len(shards)} shards")
            missing = [s["index"] for s, a in zip(shards, addresses, strict=True) if not a]
            if missing:
                raise ValueError(f"shards {missing} have no address: pass addresses=")
            tables = {
                name: ShardedTable(
                    name=name,
                    num_rows=t["num_rows"],
                    dim=t["dim"],
                    dtype=t["dtype"],
                    quant=t["quant"],
                    ranges=tuple(
                        ShardRange(r["shard"], r["row_start"], r["row_end"]) for r in t["ranges"]
                    ),
                )
                for name, t in body["tables"].items()
            }
            return cls(tuple(addresses), tables, dict(body["features"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: malformed shard map: {exc!r}") from None
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    @classmethod
    def from_table_infos(
        cls, addresses: Sequence[str], infos: Sequence[Iterable[TableInfo]]
    ) -> ShardMap:
        """Build the map from what each server reports (``infos[k]``: server k's tables).

        A server that reports no row range (``row_end`` 0, as servers before row sharding
        did) holds the whole table.

        Raises
        ------
        ValueError
            when servers disagree on a table's shape, dtype or features, or their ranges leave
            a gap or overlap.
        """
        first: dict[str, tuple[int, TableInfo]] = {}
        ranges: dict[str, list[ShardRange]] = {}
        features: dict[str, str] = {}
        for k, shard_tables in enumerate(infos):
            for info in shard_tables:
                seen = first.setdefault(info.name, (k, info))
                shape = (info.num_rows, info.dim, info.dtype, info.quant)
                other = (seen[1].num_rows, seen[1].dim, seen[1].dtype, seen[1].quant)
                if shape != other:
                    raise ValueError(
                        f"table '{info.name}': shard {seen[0]} ({addresses[seen[0]]}) reports "
                        f"rows, dim, dtype, quant {other}, shard {k} ({addresses[k]}) {shape}"
                    )
                end = info.row_end if info.row_end else info.num_rows
                ranges.setdefault(info.name, []).append(ShardRange(k, info.row_start, end))
                for feature in info.features:
                    if features.setdefault(feature, info.name) != info.name:
                        raise ValueError(
                            f"feature '{feature}' reads table '{features[feature]}' on one "
                            f"shard and '{info.name}' on shard {k} ({addresses[k]})"
                        )
        tables = {
            name: ShardedTable(
                name=name,
                num_rows=info.num_rows,
                dim=info.dim,
                dtype=info.dtype,
                quant=info.quant or None,
                ranges=tuple(ranges[name]),
            )
            for name, (_, info) in first.items()
        }
        return cls(tuple(addresses), tables, features)

    @classmethod
    def discover(
        cls, addresses: Sequence[str], *, timeout: float | None = 10.0, **client_args: Any
    ) -> ShardMap:
        """Ask every server for its tables and row ranges (ListTables), then build the map.

        Parameters
        ----------
        addresses : ``host:port`` of each shard.
        timeout : per server, in seconds.
        client_args : :class:`~ibpembed_client.LookupClient` options (``tls``, ``token``, ...).

        Raises
        ------
        LookupServiceError
            when a server cannot be reached (naming it).
        ValueError
            as for :meth:`from_table_infos`.
        """
        infos = []
        for k, address in enumerate(addresses):
            with LookupClient(address, **client_args) as client:
                try:
                    infos.append(client.list_tables(timeout=timeout))
                except LookupServiceError as err:
                    raise LookupServiceError(
                        err.code, f"shard {k} at {address}: {err.details}", "", err.attempts
                    ) from None
        return cls.from_table_infos(addresses, infos)

    def describe_shard(self, shard: int, tables: Iterable[str] | None = None) -> str:
        """``shard 1 at host:port (t rows [a, b), ...)``, for error messages."""
        names = self.tables if tables is None else tables
        held = [
            f"{name} rows [{r.row_start}, {r.row_end})"
            for name in names
            for r in self.tables[name].ranges
            if r.shard == shard
        ]
        return f"shard {shard} at {self.addresses[shard]} ({', '.join(held)})"
