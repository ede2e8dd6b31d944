# SPDX-License-Identifier: Apache-2.0
"""Row-sharded lookups: route each id to the server holding its row, fan out, merge.

A table set packed with ``ibpembed pack --shards N`` splits every table into N contiguous row
ranges, one server per range. A :class:`ShardMap` says which server holds which rows (table ->
row ranges -> address); it comes from the servers themselves (:meth:`ShardMap.discover`, their
ListTables answers) or from the ``shard_map.json`` the pack wrote (:meth:`ShardMap.load`).

>>> shard_map = ShardMap.discover(["shard-0:50051", "shard-1:50051", "shard-2:50051"])
>>> with ShardedLookupClient(shard_map) as client:
...     pooled = client.lookup({"cat_0": [[1, 2], [3]]}, pooling="mean")["cat_0"]  # [2, D]

Ids are global row numbers on the wire too: each server accepts the ids of its own range and
subtracts the range start itself. For one request the client

1. splits every feature's ids by range (``searchsorted`` over the range starts), keeping request
   order inside each part, and sends each server one request holding its parts of every feature;
   for SUM/MEAN a part carries only the samples with at least one id on that server, with their
   weights;
2. sends the requests concurrently (on a thread pool shared by the calling threads for
   :class:`ShardedLookupClient`, one task per server for :class:`AsyncShardedLookupClient`);
3. merges: NONE rows are put back at their request positions (bit-exact); SUM partial sums are
   added in shard order (fixed, so a result never depends on which server answered first); MEAN
   asks every server for SUM and divides the total by the sample's full number of ids, as one
   server would (weights scale rows, they do not change the divisor).

A SUM/MEAN merge adds fp32 partial sums, so it equals a single server's result within fp32
rounding (``ibpembed.reference.pooled_tolerance``), not bit for bit. Any failed shard fails the
whole request with that shard's status, its message naming the shard, its address and the rows
it holds (``UNAVAILABLE: shard 1 at host:port (cat_0 rows [333, 666)) ...``); a ``features[j]``
in the shard's message is renumbered to the feature's position in the caller's request.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from ibpembed_client._client import LookupClient
from ibpembed_client._common import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DTYPES,
    FeatureInput,
    KeepAliveOptions,
    LookupResult,
    LookupServiceError,
    Pooling,
    RetryPolicy,
    TableInfo,
    TlsOptions,
    build_request,
)
from ibpembed_client.aio import AsyncLookupClient
from ibpembed_client.v1 import lookup_pb2 as pb

SHARD_MAP_FORMAT = "ibpembed.shard_map"
SHARD_MAP_VERSION = 1
# fbgemm row-wise int8 rows start with an fp16 scale and an fp16 bias; pooling drops them.
_INT8_ROWWISE_HEADER_BYTES = 4
_NUMPY_DTYPES: dict[str, np.dtype] = dict(DTYPES.values())
# Row dtypes the servers pool (SUM/MEAN) without a quantisation scheme.
_POOLABLE_DTYPES = ("float32", "float16", "bfloat16")
_POOLINGS = (pb.POOLING_UNSPECIFIED, pb.POOLING_SUM, pb.POOLING_MEAN, pb.POOLING_NONE)
# How a server names a field of a request's feature: ``features[2].ids: ...``.
_FEATURE_FIELD = re.compile(r"^features\[(\d+)\]")
# Fan-out threads per shard for ShardedLookupClient: several callers' parts run at once.
DEFAULT_WORKERS_PER_SHARD = 4


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
        for feature, table in self.features.items():
            if table not in self.tables:
                raise ValueError(f"feature '{feature}' maps to unknown table '{table}'")
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
        for k, tables in enumerate(infos):
            for info in tables:
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


# -- splitting and merging -------------------------------------------------------------------


@dataclass
class _Part:
    """One feature's ids that one shard holds."""

    shard: int
    positions: np.ndarray  # [n] indexes into the feature's ids, in request order
    samples: np.ndarray | None  # [b] samples with ids on this shard (SUM/MEAN), else None


@dataclass
class _FeaturePlan:
    """How one feature of a request is split and put back together."""

    name: str
    table: ShardedTable
    lengths: np.ndarray  # [B] int32, the whole request's
    nnz: int
    parts: list[_Part]


@dataclass
class SplitPlan:
    """A request split by shard: ``requests[shard]`` to send, and how to merge the answers.

    Made by :func:`split_request`, consumed by :func:`merge_results`.
    """

    request_id: str
    pooling: int
    features: list[_FeaturePlan]
    requests: dict[int, pb.LookupRequest]
    # Per shard, the caller's index of each feature of ``requests[shard]``, in that request's
    # order: a shard request leaves out features without ids there, so numbering differs.
    feature_index: dict[int, list[int]]


def _invalid(field_name: str, problem: str, request_id: str) -> LookupServiceError:
    return LookupServiceError(
        grpc.StatusCode.INVALID_ARGUMENT, f"{field_name}: {problem}", request_id
    )


def _array(data: bytes, dtype: str, field_name: str, request_id: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(data) % itemsize:
        raise _invalid(
            field_name, f"{len(data)} bytes is not a whole number of {dtype} values", request_id
        )
    return np.frombuffer(data, dtype=dtype)


def split_request(shard_map: ShardMap, request: pb.LookupRequest) -> SplitPlan:
    """Split ``request`` into one request per shard holding any of its ids.

    Checks what routing relies on (known features, lengths summing to the ids, ids inside the
    table) and raises the status a server would (NOT_FOUND, INVALID_ARGUMENT) as a
    :class:`LookupServiceError`; everything else the shards check.
    """
    request_id = request.request_id or uuid.uuid4().hex
    if request.pooling not in _POOLINGS:
        raise _invalid("pooling", f"unknown value {request.pooling}", request_id)
    none = request.pooling == pb.POOLING_NONE
    shard_pooling = pb.POOLING_NONE if none else pb.POOLING_SUM
    requests: dict[int, pb.LookupRequest] = {}
    feature_index: dict[int, list[int]] = {}
    plans = []
    seen: set[str] = set()

    def shard_request(shard: int) -> pb.LookupRequest:
        if shard not in requests:
            # One id for every part, so the shards' logs of one request can be joined.
            requests[shard] = pb.LookupRequest(request_id=request_id, pooling=shard_pooling)
            feature_index[shard] = []
        return requests[shard]

    for i, feature in enumerate(request.features):
        where = f"features[{i}]"
        if feature.name in seen:
            raise _invalid(f"{where}.name", f"feature {feature.name!r} repeated", request_id)
        seen.add(feature.name)
        table_name = shard_map.features.get(feature.name)
        if table_name is None:
            raise LookupServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"unknown feature {feature.name!r} (not in the shard map)",
                request_id,
            )
        table = shard_map.tables[table_name]
        if not none and table.quant is None and table.dtype not in _POOLABLE_DTYPES:
            # Checked here as the server does: a feature with no ids reaches no shard.
            raise _invalid(
                "pooling",
                f"table {table.name!r} holds torch.{table.dtype} rows, which only pool as NONE",
                request_id,
            )
        ids = _array(feature.ids, "<i8", f"{where}.ids", request_id)
        lengths = _array(feature.lengths, "<i4", f"{where}.lengths", request_id)
        weights = _array(feature.weights, "<f4", f"{where}.weights", request_id)
        if lengths.size and int(lengths.min()) < 0:
            raise _invalid(f"{where}.lengths", "counts must be non-negative", request_id)
        if int(lengths.sum(dtype=np.int64)) != ids.size:
            raise _invalid(
                f"{where}.lengths",
                f"sum to {int(lengths.sum())} but there are {ids.size} ids",
                request_id,
            )
        if feature.weights and (none or weights.size != ids.size):
            problem = "weights need pooling SUM or MEAN" if none else "need one weight per id"
            raise _invalid(f"{where}.weights", problem, request_id)
        plan = _FeaturePlan(feature.name, table, lengths, ids.size, [])
        plans.append(plan)
        if not ids.size:
            continue
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= table.num_rows:
            raise _invalid(
                f"{where}.ids",
                f"feature {feature.name!r}: id {lo if lo < 0 else hi} out of range for table "
                f"{table.name!r} with {table.num_rows} rows",
                request_id,
            )
        index = table.range_index(ids)
        if not none:
            # Ids per (range, sample) in one pass: row r of ``counts`` is range r's lengths.
            sample_of = np.repeat(np.arange(lengths.size), lengths)
            counts = np.bincount(
                index * lengths.size + sample_of, minlength=len(table.ranges) * lengths.size
            ).reshape(len(table.ranges), lengths.size)
        for r, shard_range in enumerate(table.ranges):
            # Ascending positions: each part keeps request order, so its samples stay
            # contiguous and in order, which is what a jagged (lengths) batch needs.
            positions = np.flatnonzero(index == r)
            if not positions.size:
                continue
            if none:
                samples, part_lengths = None, np.array([positions.size], dtype="<i4")
            else:
                samples = np.flatnonzero(counts[r])
                part_lengths = counts[r, samples].astype("<i4")
            plan.parts.append(_Part(shard_range.shard, positions, samples))
            shard_request(shard_range.shard).features.add(
                name=feature.name,
                ids=ids[positions].tobytes(),
                lengths=part_lengths.tobytes(),
                weights=weights[positions].tobytes() if feature.weights else b"",
            )
            feature_index[shard_range.shard].append(i)
    return SplitPlan(request_id, request.pooling, plans, requests, feature_index)


def merge_results(plan: SplitPlan, results: Mapping[int, LookupResult]) -> LookupResult:
    """Put the shards' answers (``results[shard]``) back together in request order.

    ``table_version`` is the smallest version among the shards that answered (0 when no shard
    was asked): versions count each server's own reloads, so they are not comparable across
    servers beyond that.
    """
    merged = LookupResult(
        plan.request_id, min((r.table_version for r in results.values()), default=0)
    )
    none = plan.pooling == pb.POOLING_NONE
    for feature in plan.features:
        table = feature.table
        if none:
            dtype = _NUMPY_DTYPES[table.dtype]
            out = np.empty((feature.nnz, table.dim), dtype=dtype)
            for part in feature.parts:
                out[part.positions] = results[part.shard][feature.name]
            merged.dtypes[feature.name] = table.dtype
        else:
            bags = feature.lengths.size
            out = None
            for part in sorted(feature.parts, key=lambda p: p.shard):
                partial = results[part.shard][feature.name]
                assert part.samples is not None  # pooled parts always list their samples
                # Big batches usually have ids of every sample on every shard: whole-array
                # copies and adds then replace the zero fill and the scatter.
                whole = part.samples.size == bags
                if out is None and whole:
                    out = partial.copy()
                    continue
                if out is None:
                    out = np.zeros((bags, table.pooled_dim), dtype=np.float32)
                if whole:
                    out += partial
                else:
                    out[part.samples] += partial
            if out is None:
                out = np.zeros((bags, table.pooled_dim), dtype=np.float32)
            if plan.pooling == pb.POOLING_MEAN:  # as the kernels: rounded reciprocal, multiply
                out *= (np.float32(1) / np.maximum(feature.lengths, 1).astype(np.float32))[:, None]
            merged.dtypes[feature.name] = "float32"
        merged.values[feature.name] = out
    return merged


def _shard_error(
    shard_map: ShardMap, plan: SplitPlan, shard: int, err: LookupServiceError
) -> LookupServiceError:
    tables = dict.fromkeys(shard_map.features[f.name] for f in plan.requests[shard].features)
    where = shard_map.describe_shard(shard, tables)
    callers = plan.feature_index[shard]

    def renumber(match: re.Match[str]) -> str:
        j = int(match[1])
        return f"features[{callers[j]}]" if j < len(callers) else match[0]

    details = _FEATURE_FIELD.sub(renumber, err.details)
    return LookupServiceError(err.code, f"{where}: {details}", err.request_id, err.attempts)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


# -- clients ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ClientArgs:
    timeout: float | None
    retry: RetryPolicy | None
    keepalive: KeepAliveOptions | None
    tls: TlsOptions | None
    token: str | None
    max_message_bytes: int

    def kwargs(self) -> dict[str, Any]:
        return {
            "timeout": self.timeout,
            "retry": self.retry,
            "keepalive": self.keepalive,
            "tls": self.tls,
            "token": self.token,
            "max_message_bytes": self.max_message_bytes,
        }


class ShardedLookupClient:
    """Blocking client over row-sharded servers; same lookups as :class:`LookupClient`.

    >>> with ShardedLookupClient(ShardMap.load("tables/", addresses)) as client:
    ...     rows = client.lookup({"cat_0": [[7, 123_456]]}, pooling="none")["cat_0"]

    Thread-safe. One :class:`LookupClient` (one connection) per shard; a request's parts run
    concurrently on a thread pool shared by every calling thread (grpc releases the GIL while
    waiting).

    Parameters
    ----------
    shard_map : which server holds which rows.
    timeout, retry, keepalive, tls, token, max_message_bytes : as for :class:`LookupClient`,
        applied to every shard. The timeout is one deadline for the whole request: each shard
        call gets the time left when it starts, and a lookup still unanswered at the deadline
        fails with DEADLINE_EXCEEDED, time spent queued for a pool thread included.
    max_workers : threads sending shard calls (default ``DEFAULT_WORKERS_PER_SHARD`` per
        shard); with more calling threads than this allows, their parts queue.
    """

    def __init__(
        self,
        shard_map: ShardMap,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        keepalive: KeepAliveOptions | None = None,
        tls: TlsOptions | None = None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_workers: int | None = None,
    ) -> None:
        self.shard_map = shard_map
        self.timeout = timeout
        args = _ClientArgs(timeout, retry, keepalive, tls, token, max_message_bytes)
        self._clients = [LookupClient(a, **args.kwargs()) for a in shard_map.addresses]
        if max_workers is None:
            max_workers = max(1, DEFAULT_WORKERS_PER_SHARD * len(self._clients))
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="ibpembed-shard")

    @classmethod
    def discover(cls, addresses: Sequence[str], **client_args: Any) -> ShardedLookupClient:
        """A client over the map the servers report (:meth:`ShardMap.discover`)."""
        discover_args = {k: v for k, v in client_args.items() if k in ("tls", "token")}
        return cls(ShardMap.discover(addresses, **discover_args), **client_args)

    def close(self) -> None:
        """Close every shard's channel and the fan-out threads."""
        self._pool.shutdown(wait=True)
        for client in self._clients:
            client.close()

    def __enter__(self) -> ShardedLookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lookup(
        self,
        features: Mapping[str, FeatureInput],
        pooling: Pooling = "sum",
        *,
        timeout: float | None = None,
        request_id: str = "",
    ) -> LookupResult:
        """Look up one batch (see :meth:`LookupClient.lookup`); ids are global row numbers.

        Raises
        ------
        LookupServiceError : the first failed shard's status (in shard order), naming it;
            DEADLINE_EXCEEDED when the shards have not all answered within ``timeout``.
        """
        return self.lookup_request(build_request(features, pooling, request_id), timeout=timeout)

    def lookup_request(
        self, request: pb.LookupRequest, *, timeout: float | None = None
    ) -> LookupResult:
        """Send a prebuilt request, split across the shards (``timeout``: as for :meth:`lookup`)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        plan = split_request(self.shard_map, request)
        futures = {
            shard: self._pool.submit(self._send, shard, part, deadline)
            for shard, part in plan.requests.items()
        }
        # Wait for every part, even after a failure, so no call outlives this one; at the
        # deadline stop: a part still running ends then too (its grpc deadline is the same).
        _, late = wait(futures.values(), timeout=_remaining(deadline))
        for future in late:
            future.cancel()
        results: dict[int, LookupResult] = {}
        failure: BaseException | None = None
        for shard in sorted(futures):
            future = futures[shard]
            if future in late:
                error: BaseException | None = LookupServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no answer within the {timeout} s deadline",
                    plan.request_id,
                )
            else:
                error = future.exception()
            if error is None:
                results[shard] = future.result()
            elif failure is None:
                failure = error
                if isinstance(error, LookupServiceError):
                    failure = _shard_error(self.shard_map, plan, shard, error)
        if failure is not None:
            raise failure
        return merge_results(plan, results)

    def _send(self, shard: int, request: pb.LookupRequest, deadline: float | None) -> LookupResult:
        """One shard's part, with whatever time the request has left once a thread is free."""
        remaining = _remaining(deadline)
        if remaining == 0.0:
            raise LookupServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "deadline passed while the call waited for a free thread",
                request.request_id,
            )
        return self._clients[shard].lookup_request(request, timeout=remaining)


class AsyncShardedLookupClient:
    """asyncio client over row-sharded servers (see :class:`ShardedLookupClient`).

    Create it inside the event loop that uses it (grpc.aio channels belong to one loop).
    """

    def __init__(
        self,
        shard_map: ShardMap,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        keepalive: KeepAliveOptions | None = None,
        tls: TlsOptions | None = None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.shard_map = shard_map
        args = _ClientArgs(timeout, retry, keepalive, tls, token, max_message_bytes)
        self._clients = [AsyncLookupClient(a, **args.kwargs()) for a in shard_map.addresses]

    async def close(self) -> None:
        """Close every shard's channel."""
        for client in self._clients:
            await client.close()

    async def __aenter__(self) -> AsyncShardedLookupClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def lookup(
        self,
        features: Mapping[str, FeatureInput],
        pooling: Pooling = "sum",
        *,
        timeout: float | None = None,
        request_id: str = "",
    ) -> LookupResult:
        """Look up one batch (see :meth:`ShardedLookupClient.lookup`)."""
        request = build_request(features, pooling, request_id)
        return await self.lookup_request(request, timeout=timeout)

    async def lookup_request(
        self, request: pb.LookupRequest, *, timeout: float | None = None
    ) -> LookupResult:
        """Send a prebuilt request, split across the shards."""
        plan = split_request(self.shard_map, request)
        shards = sorted(plan.requests)
        answers = await asyncio.gather(
            *(self._clients[s].lookup_request(plan.requests[s], timeout=timeout) for s in shards),
            return_exceptions=True,
        )
        results: dict[int, LookupResult] = {}
        for shard, answer in zip(shards, answers, strict=True):
            if isinstance(answer, LookupServiceError):
                raise _shard_error(self.shard_map, plan, shard, answer)
            if isinstance(answer, BaseException):
                raise answer
            results[shard] = answer
        return merge_results(plan, results)
