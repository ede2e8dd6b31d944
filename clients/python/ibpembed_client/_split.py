# SPDX-License-Identifier: Apache-2.0
"""Splitting a request across row shards and merging the shards' answers (see
:mod:`ibpembed_client.shards` for the algorithm and its guarantees)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
import numpy as np

from ibpembed_client._errors import LookupServiceError
from ibpembed_client._request import new_request_id
from ibpembed_client._result import BFLOAT16, DTYPES, LookupResult
from ibpembed_client.shard_map import ShardedTable, ShardMap
from ibpembed_client.v1 import lookup_pb2 as pb

_NUMPY_DTYPES: dict[str, np.dtype] = dict(DTYPES.values())
# Row dtypes the servers pool (SUM/MEAN) without a quantisation scheme.
_POOLABLE_DTYPES = ("float32", "float16", "bfloat16")
_POOLINGS = (pb.POOLING_UNSPECIFIED, pb.POOLING_SUM, pb.POOLING_MEAN, pb.POOLING_NONE)
# Pooled output dtypes a server rounds its fp32 sums to, by name (the result's ``dtypes``).
_OUTPUT_DTYPES: dict[int, str] = {
    pb.DTYPE_UNSPECIFIED: "float32",
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_FLOAT16: "float16",
    pb.DTYPE_BFLOAT16: "bfloat16",
}
# How a server names a field of a request's feature: ``features[2].ids: ...``.
_FEATURE_FIELD = re.compile(r"^features\[(\d+)\]")


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
    # The pooled values' dtype (``DType``): the shards sum in fp32, the merged sums are rounded.
    output_dtype: int = pb.DTYPE_UNSPECIFIED


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
    table, the output dtype) and raises the status a server would (NOT_FOUND, INVALID_ARGUMENT)
    as a :class:`LookupServiceError`; everything else the shards check.

    Raises ValueError for a request naming an output or input region: a region is registered
    with one server, and the merged values are the client's to put somewhere.
    """
    for kind in ("output_region", "input_region"):
        if request.HasField(kind):
            raise ValueError(
                f"{kind}: the sharded clients do not use shared-memory regions (one is registered"
                " with one server, and a result is merged from several); send the ids in the"
                " request and copy the merged arrays where they are needed"
            )
    request_id = request.request_id or new_request_id()
    if request.pooling not in _POOLINGS:
        raise _invalid("pooling", f"unknown value {request.pooling}", request_id)
    none = request.pooling == pb.POOLING_NONE
    if request.output_dtype not in _OUTPUT_DTYPES:
        raise _invalid(
            "output_dtype",
            f"{request.output_dtype}: must be FLOAT32, FLOAT16 or BFLOAT16",
            request_id,
        )
    if none and request.output_dtype != pb.DTYPE_UNSPECIFIED:
        raise _invalid(
            "output_dtype",
            "pooling NONE returns rows bit-exact in the table's dtype: leave it unset",
            request_id,
        )
    shard_pooling = pb.POOLING_NONE if none else pb.POOLING_SUM
    requests: dict[int, pb.LookupRequest] = {}
    feature_index: dict[int, list[int]] = {}
    plans = []
    seen: set[str] = set()

    def shard_request(shard: int) -> pb.LookupRequest:
        if shard not in requests:
            # One id for every part, so the shards' logs of one request can be joined.
            requests[shard] = pb.LookupRequest(
                request_id=request_id,
                pooling=shard_pooling,
                table_version=request.table_version,
            )
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
    return SplitPlan(
        request_id, request.pooling, plans, requests, feature_index, request.output_dtype
    )


def merge_results(plan: SplitPlan, results: Mapping[int, LookupResult]) -> LookupResult:
    """Put the shards' answers (``results[shard]``) back together in request order.

    Every shard must have answered from one table-set version (the merged result's
    ``table_version``; 0 when no shard was asked): embeddings of two versions in one result
    would drift from the dense model silently, so answers that disagree raise
    FAILED_PRECONDITION instead (pin the request's ``table_version`` to avoid them).
    """
    versions = {shard: r.table_version for shard, r in results.items()}
    if len(set(versions.values())) > 1:
        raise LookupServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the shards answered from different table-set versions {versions}: pin the "
            "request's table_version (the sharded clients do)",
            plan.request_id,
        )
    merged = LookupResult(plan.request_id, next(iter(versions.values()), 0))
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
            pooled: np.ndarray | None = None
            for part in sorted(feature.parts, key=lambda p: p.shard):
                partial = results[part.shard][feature.name]
                assert part.samples is not None  # pooled parts always list their samples
                # Big batches usually have ids of every sample on every shard: whole-array
                # copies and adds then replace the zero fill and the scatter.
                whole = part.samples.size == bags
                if pooled is None and whole:
                    pooled = partial.copy()
                    continue
                if pooled is None:
                    pooled = np.zeros((bags, table.pooled_dim), dtype=np.float32)
                if whole:
                    pooled += partial
                else:
                    pooled[part.samples] += partial
            if pooled is None:
                pooled = np.zeros((bags, table.pooled_dim), dtype=np.float32)
            if plan.pooling == pb.POOLING_MEAN:  # as the kernels: rounded reciprocal, multiply
                lengths = np.maximum(feature.lengths, 1).astype(np.float32)
                pooled *= (np.float32(1) / lengths)[:, None]
            out = _round_pooled(pooled, plan.output_dtype)
            merged.dtypes[feature.name] = _OUTPUT_DTYPES[plan.output_dtype]
        merged.arrays[feature.name] = out
    return merged


def _round_pooled(values: np.ndarray, dtype: int) -> np.ndarray:
    """fp32 pooled values in the output dtype, rounded once to nearest even as a server rounds
    its own sums; bfloat16 as :class:`LookupClient` returns it (ml_dtypes' dtype where
    installed, else uint16 bit patterns)."""
    if dtype == pb.DTYPE_FLOAT16:
        return values.astype(np.float16)
    if dtype != pb.DTYPE_BFLOAT16:
        return values
    bits = values.view(np.uint32)
    # Round to nearest even on the top 16 bits; a NaN (which the carry could make infinite)
    # becomes the quiet NaN 0x7FC0.
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = 0x7FC0
    return rounded if BFLOAT16 is None else rounded.view(BFLOAT16)


def shard_error(
    shard_map: ShardMap, plan: SplitPlan, shard: int, err: LookupServiceError
) -> LookupServiceError:
    tables = dict.fromkeys(shard_map.features[f.name] for f in plan.requests[shard].features)
    where = shard_map.describe_shard(shard, tables)
    callers = plan.feature_index[shard]

    def renumber(match: re.Match[str]) -> str:
        j = int(match[1])
        return f"features[{callers[j]}]" if j < len(callers) else match[0]

    details = _FEATURE_FIELD.sub(renumber, err.details)
    error = LookupServiceError(err.code, f"{where}: {details}", err.request_id, err.attempts)
    error.versions_held, error.shard = err.versions_held, shard
    return error
