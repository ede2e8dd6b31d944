# SPDX-License-Identifier: Apache-2.0
"""Running a planned request's kernels: the fused one-call path for pooled CPU requests, the
per-table batch of pooled tables, and the decode-once path for tables with many repeated ids.
On a GPU the same calls run on device tensors (:mod:`ibpembed.engine.cuda` brings the results
back)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from ibpembed.codec import CompressedTable
from ibpembed.engine.cuda import CudaStreams, to_host
from ibpembed.engine.hbm_tier import HbmTier, gather
from ibpembed.engine.planning import RequestPlan, TableWork
from ibpembed.engine.requests import KernelCall, LookupObserver, PackedRequest, Pooling
from ibpembed.tables.store import TableSnapshot

# Hot-row coverage from which pooled lookups skip the decode-once path (see Executor.dedupes).
FUSED_MIN_HOT_COVERAGE = 0.5
# Results of at most this many values in all are rounded in one call (see rounded).
ROUND_TOGETHER_MAX_VALUES = 65536


class IdRecorder(Protocol):
    """Sees the ids of every request (the tier's admission policy)."""

    def record(self, lookups: Iterable[tuple[str, np.ndarray, int]]) -> None:
        """(table, int64 rows of it, the table's ``num_rows``) per table a request read."""


class Executor:
    """Runs kernels for an engine on ``device`` (see ``LookupEngine`` for the dedupe
    settings); ``recorder`` sees every request's checked ids, ``observer`` its kernel calls."""

    def __init__(
        self,
        device: torch.device,
        *,
        dedupe_max_unique_fraction: float,
        dedupe_min_ids: int,
        observer: LookupObserver | None,
        recorder: IdRecorder | None,
        hbm: HbmTier | None = None,
    ) -> None:
        self.device = device
        self.hbm = hbm  # the HBM tier on a GPU: the tables' hottest rows in GPU memory
        self.dedupe_max_unique_fraction = dedupe_max_unique_fraction
        self.dedupe_min_ids = dedupe_min_ids
        self.observer = observer
        self.recorder = recorder
        self.streams = CudaStreams(device)

    def run_in_one_call(
        self, snap: TableSnapshot, request: PackedRequest, pooling: Pooling, limit: int | None
    ) -> list[torch.Tensor] | None:
        """A pooled CPU request's results from one call of the fused kernel, which checks every
        feature's ids against its table as it pools them; None when the request needs the
        general path: NONE, a GPU, a feature it cannot map here (unknown, repeated, not
        poolable, a row shard), ids the decode-once path may take, a result over
        ``limit`` (fp32-sized: conservative for fp16 and bf16), or anything malformed (the
        general path names the field).

        NOTE(engine): one row of ``table_bags`` per feature, not per table, so no request-wide
        grouping, concatenation or splitting: at B=1 x 26 those cost more than the kernels.
        """
        if pooling == "none" or self.device.type != "cpu":
            return None
        if self.dedupe_max_unique_fraction > 0 and request.ids.size >= self.dedupe_min_ids:
            return None
        features = snap.pooling_features
        try:
            entries = [features[name] for name in request.names]
        except KeyError:
            return None
        count = len(entries)
        if len(set(request.names)) != count:
            return None
        meta = np.array([(e.position, e.dim) for e in entries], dtype=np.int64).reshape(count, 2)
        samples = request.sample_counts
        if samples.shape != (count,) or request.id_counts.shape != (count,):
            return None
        if limit is not None and int(samples @ meta[:, 1]) * 4 > limit:
            return None
        offsets = np.zeros(request.lengths.size + 1, dtype=np.int64)
        np.cumsum(request.lengths, dtype=np.int64, out=offsets[1:])
        sample_ends = np.cumsum(samples)
        if count and (sample_ends[-1] != request.lengths.size or offsets[-1] != request.ids.size):
            return None  # the counts do not split the arrays
        if not np.array_equal(offsets[sample_ends], np.cumsum(request.id_counts)):
            return None  # a feature's lengths do not sum to its ids
        table_bags = np.empty((count, 3), dtype=np.int64)
        table_bags[:, 0] = meta[:, 0]
        table_bags[:, 1] = sample_ends - samples
        table_bags[:, 2] = samples
        table_set, _ = snap.pooling_set
        try:
            values, seconds = table_set.lookup(
                torch.from_numpy(table_bags),
                torch.from_numpy(request.ids),
                torch.from_numpy(offsets),
                None,
                pooling,
            )
        except (IndexError, ValueError):  # an id out of range or a negative length
            return None
        if self.recorder is not None:  # after the kernel: it has checked every id
            id_ends = np.cumsum(request.id_counts).tolist()
            self.recorder.record(
                (e.table, request.ids[end - n : end], e.rows)
                for e, n, end in zip(entries, request.id_counts.tolist(), id_ends, strict=True)
            )
        if self.observer is not None:
            nnz = request.id_counts.tolist()
            self.observer.kernels_done(
                pooling,
                [(e.table, n, n, t) for e, n, t in zip(entries, nnz, seconds, strict=True)],
            )
        return values

    def run_plan(
        self, snap: TableSnapshot, plan: RequestPlan, pooling: Pooling, count: int
    ) -> list[torch.Tensor]:
        """The results of a planned request of ``count`` features, in request order."""
        if self.recorder is not None:
            self.recorder.record(
                (item.table_name, plan.ids[slice(*item.id_span)], item.table.num_rows)
                for item in plan.work
            )
        out: list[torch.Tensor | None] = [None] * count
        calls: list[KernelCall] = []
        rest = plan.work
        with self.streams.request():
            batch = _Batch(*self.streams.upload([plan.ids, plan.offsets, plan.weights]))
            if pooling != "none":
                batched: list[TableWork] = []
                rest = []
                for item in plan.work:
                    (rest if self.dedupes(item) else batched).append(item)
                if batched:
                    self._run_tables(snap, batch, batched, pooling, calls, out)
            for item in rest:
                results = self._run_table(snap, plan, batch, item, pooling, calls)
                for pos, values in zip(item.positions, results, strict=True):
                    out[pos] = values
        if self.observer is not None:
            self.observer.kernels_done(pooling, calls)
        return out  # type: ignore[return-value]

    def dedupes(self, item: TableWork) -> bool:
        """Whether a pooled lookup of this table tries the decode-once path (sort the ids,
        decode each distinct row once, pool with ``embedding_bag``; taken when the distinct ids
        are few enough, else the fused kernel in a call of the table's own) instead of the fused
        kernel with the request's other tables.

        Quantised rows need the codec's dequantising kernel; float rows may take the
        decode-once path when a table has many ids (Zipf traffic). Hot-row copies that serve
        most lookups spare the fused kernel most of its decoding, and its one pass then beats
        sorting the ids (benchmarks.engine_paths, BENCHMARKS.md).
        """
        table = item.table
        nnz = item.id_span[1] - item.id_span[0]
        covered = table.hot is not None and table.hot.coverage >= FUSED_MIN_HOT_COVERAGE
        return (
            table.quant is None
            and self.dedupe_max_unique_fraction > 0
            and nnz >= self.dedupe_min_ids
            and not covered
        )

    def _run_tables(
        self,
        snap: TableSnapshot,
        batch: _Batch,
        items: list[TableWork],
        pooling: Pooling,
        calls: list[KernelCall],
        out: list[torch.Tensor | None],
    ) -> None:
        """Pooled lookups of several tables with one call of the fused kernel (on a GPU one
        launch per chunk width; see :class:`~ibpembed.codec.CompressedTableSet`), every
        feature's result put in ``out``."""
        table_set, position = snap.pooling_set
        lookup_set = table_set if self.hbm is None else self.hbm.table_set(snap)
        # (set position, first bag, bag count) per table
        table_bags = np.array(
            [(position[item.table_name], *item.sample_span) for item in items], dtype=np.int64
        ).reshape(-1, 3)
        table_bags[:, 2] -= table_bags[:, 1]
        values, seconds = lookup_set.lookup(
            torch.from_numpy(table_bags),  # on the host, also for a GPU set
            batch.ids,
            batch.offsets,
            batch.weights,
            pooling,  # type: ignore[arg-type]
        )
        if self.device.type != "cpu":
            values = to_host(values)
        for item, table_values, took in zip(items, values, seconds, strict=True):
            nnz = item.id_span[1] - item.id_span[0]
            calls.append((item.table_name, nnz, nnz, took))
            parts = _split(table_values, [q.lengths.size for q in item.queries])
            for pos, part in zip(item.positions, parts, strict=True):
                out[pos] = part

    def _run_table(
        self,
        snap: TableSnapshot,
        plan: RequestPlan,
        batch: _Batch,
        item: TableWork,
        pooling: Pooling,
        calls: list[KernelCall],
    ) -> list[torch.Tensor]:
        """One kernel call for every feature of the request that reads this table (appended to
        ``calls``)."""
        start = time.perf_counter()
        table = item.table
        qs = item.queries
        span = slice(*item.id_span)
        ids = batch.ids[span]
        nnz = ids.numel()
        unique_count = nnz
        if pooling == "none" and self.device.type == "cpu":
            unique, inverse = torch.unique(ids, return_inverse=True)
            unique_count = unique.numel()
            values = table.gather(unique).index_select(0, inverse)
            sizes = [q.ids.size for q in qs]
        elif pooling == "none":
            # The GPU gather sorts the ids itself and decodes each run of equal ids once: a
            # torch.unique here (a sync) and its second sort would only add to it.
            # ``tier`` stays referenced until the values are on the host: the kernel reads its
            # arrays after this call returns, and a tier replaced by a publication meanwhile
            # would otherwise go back to the allocator, for the next tier's build to overwrite.
            tier = None if self.hbm is None else self.hbm.tier_of(snap, item.table_name)
            values = gather(table, ids, tier)
            sizes = [q.ids.size for q in qs]
        else:
            first, end = item.sample_span
            offsets = batch.offsets[first : end + 1]
            if plan.offsets[first]:  # the table's bags counted from its first id
                offsets = offsets - int(plan.offsets[first])
            weights = None
            if batch.weights is not None and any(q.weights is not None for q in qs):
                weights = batch.weights[span]
            values, unique_count = self._pool_table(
                table,
                ids,
                plan.lengths[first:end],
                offsets,
                weights,
                pooling,
                dedupe=self.dedupes(item),
            )
            sizes = [q.lengths.size for q in qs]
        if self.device.type != "cpu":
            values = values.cpu()
        calls.append((item.table_name, nnz, unique_count, time.perf_counter() - start))
        return _split(values, sizes)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        # NOTE(engine): per-table costs add up over a request's 26 tables: a no-op .to() on
        # the CPU still costs ~1 us of dispatch, so CPU engines skip it.
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _pool_table(
        self,
        table: CompressedTable,
        ids: torch.Tensor,
        lengths: np.ndarray,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        pooling: Pooling,
        *,
        dedupe: bool,
    ) -> tuple[torch.Tensor, int]:
        """Pooled [B, D] fp32 and the number of rows decoded; ``dedupe``: try the decode-once
        path (:meth:`dedupes`), taken when the distinct ids are few enough."""
        nnz = ids.numel()
        if dedupe:
            unique, inverse = torch.unique(ids, return_inverse=True)
            if unique.numel() <= self.dedupe_max_unique_fraction * nnz:
                rows = table.gather(unique).float()
                pooled = torch.nn.functional.embedding_bag(
                    inverse, rows, offsets[:-1], mode="sum", per_sample_weights=weights
                )
                if pooling == "mean":  # as the kernels scale: a rounded reciprocal, then a multiply
                    counts = self._tensor(lengths).clamp(min=1).float()
                    pooled *= counts.reciprocal().unsqueeze(1)
                return pooled, unique.numel()
        return table.lookup(ids, offsets, weights, pooling), nnz  # type: ignore[arg-type]


class _Batch:
    """A request's ids, offsets and weights where its kernels read them (uploaded together)."""

    def __init__(
        self, ids: torch.Tensor | None, offsets: torch.Tensor | None, weights: torch.Tensor | None
    ) -> None:
        assert ids is not None and offsets is not None
        self.ids = ids
        self.offsets = offsets
        self.weights = weights


def rounded(values: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Pooled results converted to ``dtype`` (each value rounded once, to nearest even).

    NOTE(engine): a small request's results convert in one call on their concatenation: 26
    conversions of [1, 128] cost ~130 us, one of the 26 rows ~45 us (development measurement).
    Larger results convert one by one, which spares the concatenation's extra copy.
    """
    if (
        len(values) > 1
        and sum(v.numel() for v in values) <= ROUND_TOGETHER_MAX_VALUES
        and len({v.shape[1:] for v in values}) == 1
    ):
        return list(torch.cat(values).to(dtype).split([v.shape[0] for v in values]))
    return [v.to(dtype) for v in values]


def _split(values: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The rows of each feature that read a table (most tables serve one feature)."""
    return [values] if len(sizes) == 1 else list(torch.split(values, sizes))
