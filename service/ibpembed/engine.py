# SPDX-License-Identifier: Apache-2.0
"""LookupEngine: the transport-neutral core of the lookup service.

A request is a set of features, each a jagged batch of ids (one key of a KeyedJaggedTensor)::

    feature f, batch B:  lengths[B] (ids per sample), ids[nnz] (samples back to back),
                         weights[nnz] optional (per-id weights)
    pooling "none":      out[f] = table[ids]                       [nnz, D]  table dtype, bit-exact
    pooling "sum":       out[f][b] = sum_j w[j] * table[ids[j]]    [B, D]    fp32, j in sample b
    pooling "mean":      out[f][b] = out_sum[f][b] / lengths[b]     (zeros for empty samples)

Ids are global row numbers. A server holding a row shard of a table (a table set packed with
``ibpembed pack --shards``) holds global rows ``[row_start, row_end)`` of it: it accepts ids in
that range only (others are INVALID_ARGUMENT naming the range) and subtracts ``row_start``
before the kernels, so clients route ids without renumbering them.

The engine validates the request, groups features by table (each table's features form one
batch, whatever their number), and runs the kernels: on the CPU, pooled lookups of every table
of the request in one call of the fused kernel (``CompressedTableSet``; a table with very many
ids deduplicates them first instead), otherwise one call per table. Calls run in a thread pool
so the asyncio event loop never waits on them (torch ops run their C++ without holding the GIL,
so the pool's threads decode in parallel). It holds a bounded number of requests: past
``max_inflight`` new ones fail at once with :class:`~ibpembed.errors.Overloaded` instead
of queueing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

import numpy as np
import torch

from ibpembed.codec import CompressedTable
from ibpembed.errors import DeadlineExceeded, InvalidArgument, NotFound, Overloaded
from ibpembed.hot_rows import HotRowTracker
from ibpembed.layout import INT8_ROWWISE_HEADER_BYTES
from ibpembed.tables.manifest import RowRange
from ibpembed.tables.store import TableSnapshot, TableStore

Pooling = Literal["sum", "mean", "none"]
POOLINGS: tuple[Pooling, ...] = ("sum", "mean", "none")
T = TypeVar("T")
# Pooled lookups of a table with fewer ids go straight to the fused kernel, whose per-call cache
# decodes most repeated ids once (csrc codec.h's RepeatCache): sorting the ids to find every
# repeat only pays when there are far more distinct rows than that cache holds (see
# LookupEngine's dedupe_min_ids).
DEDUPE_MIN_IDS = 32768
# Hot-row coverage from which pooled lookups skip the decode-once path (see _pool_table).
FUSED_MIN_HOT_COVERAGE = 0.5
# The oldest GPU the CUDA kernels run on (setup.py builds sm_80, sm_90 and compute_90 PTX).
MIN_CUDA_CAPABILITY = (8, 0)
# Requests with at most this many ids run on the calling (event-loop) thread instead of a
# worker: handing a request to a worker thread and back costs more than their kernels
# (docs/serving.md, *The thread hand-off*, measured with benchmarks.service --handoff).
INLINE_MAX_IDS = 256
# Element types a pooled result may be rounded to (fp32 accumulation, one rounding, RNE).
OUTPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
# Results of at most this many values in all are rounded in one call (see _rounded).
ROUND_TOGETHER_MAX_VALUES = 65536


# One kernel call of a request: (table, nnz ids, unique distinct rows decoded, seconds).
KernelCall = tuple[str, int, int, float]


class LookupObserver(Protocol):
    """Optional hook for metrics, called from the engine's worker threads."""

    def kernels_done(self, pooling: Pooling, calls: Sequence[KernelCall]) -> None:
        """The kernel calls of one request, one per table it read, before it returns.

        NOTE(engine): once per request, not per call: a hook runs as Python on a worker thread
        while the event loop waits for the GIL, and 26 small per-table calls measured 3-4 us
        each in a loaded server (0.6 us alone) and +9 % server CPU per B=1 request.
        """

    def queue_waited(self, seconds: float) -> None:
        """A request admitted by :meth:`LookupEngine.submit` waited ``seconds`` for a worker
        thread (the queue-time half of a request's latency; the kernels are the other)."""


class AdmissionSlot:
    """One admitted request's share of the engine's capacity (``max_inflight``).

    Held by every party that still has the request's memory: the worker running its kernels,
    and a LookupStream until the response is written (HTTP/2 flow control can keep a computed
    response waiting for as long as its client does not read). The capacity comes back when
    the last holder lets go.
    """

    __slots__ = ("_engine", "_holders")

    def __init__(self, engine: LookupEngine) -> None:
        self._engine = engine
        self._holders = 1

    def hold(self) -> None:
        """One more holder; each calls :meth:`release` once."""
        with self._engine._lock:
            if self._holders == 0:
                raise RuntimeError("admission slot already released")
            self._holders += 1

    def release(self, _: object = None) -> None:
        """Let go (the argument lets a future's done-callback call it)."""
        with self._engine._lock:
            if self._holders == 0:
                raise RuntimeError("admission slot released more often than held")
            self._holders -= 1
            if self._holders == 0:
                self._engine._inflight -= 1


@dataclass(frozen=True)
class FeatureQuery:
    """One feature of a request.

    Parameters
    ----------
    name : feature name (mapped to a table by the store).
    ids : [nnz] int64 row ids.
    lengths : [B] int32 ids per sample, non-negative, summing to nnz.
    weights : optional [nnz] float32 per-id weights (SUM / MEAN only).
    """

    name: str
    ids: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None = None


@dataclass(frozen=True)
class PackedRequest:
    """A request's features as one array of each kind, features back to back in request order:
    what a transport decodes without per-feature numpy work (:meth:`LookupEngine.run` takes it
    like a list of :class:`FeatureQuery`).

    Parameters
    ----------
    names : feature names, in request order.
    ids : [nnz] int64, writable (shards shift them in place).
    lengths : [samples] int32.
    id_counts, sample_counts : [F] int64: each feature's ids and samples.
    """

    names: list[str]
    ids: np.ndarray
    lengths: np.ndarray
    id_counts: np.ndarray
    sample_counts: np.ndarray

    def queries(self) -> list[FeatureQuery]:
        """The same request feature by feature."""
        id_ends = np.cumsum(self.id_counts).tolist()
        sample_ends = np.cumsum(self.sample_counts).tolist()
        out, id_start, sample_start = [], 0, 0
        for name, id_end, sample_end in zip(self.names, id_ends, sample_ends, strict=True):
            out.append(
                FeatureQuery(name, self.ids[id_start:id_end], self.lengths[sample_start:sample_end])
            )
            id_start, sample_start = id_end, sample_end
        return out


Request = Sequence[FeatureQuery] | PackedRequest


@dataclass(frozen=True)
class FeatureResult:
    """One feature's output: [nnz, D] rows in the table dtype (NONE) or [B, D] fp32 (pooled)."""

    name: str
    values: torch.Tensor


@dataclass(frozen=True)
class LookupResult:
    """Results in request order, all served from table-set ``version``."""

    version: int
    features: list[FeatureResult]


@dataclass(frozen=True)
class TableDescription:
    """What DescribeTable reports for one table of one table-set version."""

    name: str
    num_rows: int
    dim: int
    dtype: torch.dtype
    quant: str | None
    raw_bytes: int
    stored_bytes: int
    chunk_bits: int
    version: int
    features: tuple[str, ...]
    row_start: int = 0
    row_end: int = 0


@dataclass
class _TableWork:
    """Features of one request that read one table, concatenated into one CSR batch."""

    table_name: str
    table: CompressedTable
    rows: RowRange  # global rows the table holds; ids are shifted by rows.start
    positions: list[int] = field(default_factory=list)  # indexes into the request's features
    queries: list[FeatureQuery] = field(default_factory=list)
    # This table's ids and samples: [start, end) of the request plan's arrays.
    id_span: tuple[int, int] = (0, 0)
    sample_span: tuple[int, int] = (0, 0)


@dataclass
class _RequestPlan:
    """A request's features grouped by table, every id, length and weight of it concatenated
    once, table after table (each table's CSR batch is a slice).

    NOTE(engine): one concatenation and one vectorised check per request instead of per table:
    at B=1 a 26-table request spent ~0.6 of its ~0.9 ms of CPU in per-table numpy and torch
    calls around kernels doing ~10 us of work each.
    """

    work: list[_TableWork]
    # int64, writable (the request's own bytes are read-only); global ids until _plan shifts a
    # shard's into the rows of its file.
    ids: np.ndarray
    offsets: np.ndarray  # int64 [samples + 1]: bag boundaries over ``ids``
    lengths: np.ndarray  # int32 [samples]
    weights: np.ndarray | None  # float32 [ids]; ones for features sent without weights


def cuda_kernels_present() -> bool:
    """A GPU the CUDA kernels run on, and a build that has them."""
    return (
        torch.cuda.is_available()
        and torch._C._dispatch_has_kernel_for_dispatch_key("ibpembed::ibp_gather", "CUDA")
        # The kernels use sm_80 instructions (cp.async, __reduce_add_sync).
        and torch.cuda.get_device_capability() >= MIN_CUDA_CAPABILITY
    )


def resolve_device(device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when a GPU and the CUDA kernels are present).

    A server decides with :func:`ibpembed.selftest.choose_device`, which also runs the CUDA
    kernels once on its tables before trusting them."""
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    has_cuda_kernels = cuda_kernels_present()
    if device == "cuda" and not has_cuda_kernels:
        raise ValueError(
            "--device cuda needs an ibpembed build with CUDA kernels and a GPU of compute "
            f"capability >= {MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} "
            f"(cuda available: {torch.cuda.is_available()})"
        )
    return torch.device("cuda" if device != "cpu" and has_cuda_kernels else "cpu")


class LookupEngine:
    """Runs lookups against a :class:`TableStore`.

    Parameters
    ----------
    store : the tables; every request reads one consistent snapshot of it.
    max_workers : threads running kernels (requests in flight beyond this wait for a thread).
    max_inflight : requests admitted at once (running or waiting for a thread); one more is
        rejected with :class:`Overloaded`. Must be >= 1.
    device : ``"cpu"``, ``"cuda"`` or ``"auto"`` (see :func:`resolve_device`; ``"auto"`` with a
        CPU store is the CPU). The store must place its tables for the same device
        (``TableStore(device=...)``), so that every tensor a kernel reads is where it runs.
    dedupe_max_unique_fraction : a table's pooled lookups with at least ``dedupe_min_ids`` ids
        sort them, decode each distinct row once and pool the decoded rows when distinct ids /
        ids is at most this (Zipf traffic: 0.1-0.5); otherwise the fused decode+pool kernel
        runs over every id, decoding repeats once as far as its per-call cache of decoded rows
        (512 KiB per thread) reaches. 0 = always fused. NONE lookups always decode each
        distinct row once. Tables whose hot-row copies served at least FUSED_MIN_HOT_COVERAGE
        of the lookups that chose them take the fused kernel (see ``hot_row_budget``).
    dedupe_min_ids : see ``dedupe_max_unique_fraction``. Measured on CPU (D=128 fp32, one
        thread, per table of the demo set at B=512): the fused kernel is faster up to 13.8k ids
        (distinct fraction 0.36), the decode-once path 1.6x faster at 51k ids (0.26).
    max_output_bytes : largest result a request may produce (the server passes its max message
        size); a bigger request fails with :class:`InvalidArgument` before any memory is
        allocated for it. None = no limit.
    observer : optional metrics hook.
    hot_row_budget : host memory each table may spend on decoded copies of its most frequently
        looked-up rows, as a fraction of its raw bytes (see :mod:`ibpembed.hot_rows`); CPU
        lookups read those copies instead of decoding. 0 = off. Ignored on CUDA, where the
        kernels decode every row on the GPU.
    hot_row_refresh_s : seconds between re-rankings of the hot rows.
    inline_max_ids : :meth:`lookup` runs CPU requests with at most this many ids on the calling
        thread (no hand-off to a worker; the event loop waits for their kernels). 0 = never.
    """

    def __init__(
        self,
        store: TableStore,
        *,
        max_workers: int = 4,
        max_inflight: int = 64,
        device: str = "cpu",
        dedupe_max_unique_fraction: float = 0.5,
        dedupe_min_ids: int = DEDUPE_MIN_IDS,
        max_output_bytes: int | None = None,
        observer: LookupObserver | None = None,
        hot_row_budget: float = 0.0,
        hot_row_refresh_s: float = 30.0,
        inline_max_ids: int = INLINE_MAX_IDS,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if not 0.0 <= dedupe_max_unique_fraction <= 1.0:
            raise ValueError("dedupe_max_unique_fraction must be in [0, 1]")
        if dedupe_min_ids < 1:
            raise ValueError(f"dedupe_min_ids must be >= 1, got {dedupe_min_ids}")
        self.store = store
        self.max_inflight = max_inflight
        # "auto" follows the store: a store built for the CPU is served on the CPU.
        auto_cpu = device == "auto" and store.device.type == "cpu"
        self.device = torch.device("cpu") if auto_cpu else resolve_device(device)
        if self.device.type != store.device.type:
            raise ValueError(
                f"the engine runs on {self.device.type} but the store places its tables for "
                f"{store.device.type}: build the store with device={self.device.type!r}"
            )
        self.dedupe_max_unique_fraction = dedupe_max_unique_fraction
        self.dedupe_min_ids = dedupe_min_ids
        self.max_output_bytes = max_output_bytes
        self.observer = observer
        if inline_max_ids < 0:
            raise ValueError(f"inline_max_ids must be >= 0, got {inline_max_ids}")
        self.inline_max_ids = inline_max_ids if self.device.type == "cpu" else 0
        # The last snapshot's features for _run_in_one_call (a snapshot never changes).
        self._one_call_cache: tuple[TableSnapshot, dict[str, tuple[int, int, str, int]]] | None
        self._one_call_cache = None
        self.hot_rows: HotRowTracker | None = None
        if hot_row_budget < 0:
            raise ValueError(f"hot_row_budget must be >= 0, got {hot_row_budget}")
        if hot_row_budget > 0 and self.device.type == "cpu":
            self.hot_rows = HotRowTracker(store, budget=hot_row_budget, refresh_s=hot_row_refresh_s)
            self.hot_rows.start()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="ibpembed-lookup")
        self._streams = threading.local()
        self._lock = threading.Lock()
        self._inflight = 0

    # -- admission -------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        """Requests admitted and not yet finished: kernels still running, or a stream's
        response not yet written, count."""
        return self._inflight

    def admit(self) -> AdmissionSlot:
        """Take one of ``max_inflight`` slots, held by the caller until it calls
        ``release()``; :class:`Overloaded` when none is free."""
        with self._lock:
            if self._inflight >= self.max_inflight:
                raise Overloaded(
                    f"server at capacity ({self.max_inflight} requests in flight); retry later"
                )
            self._inflight += 1
        return AdmissionSlot(self)

    # -- lookups ---------------------------------------------------------------------------
    async def lookup(
        self,
        features: Request,
        pooling: Pooling,
        *,
        deadline: float | None = None,
        then: Callable[[LookupResult], T] | None = None,
        slot: AdmissionSlot | None = None,
        table_version: int = 0,
        output_dtype: torch.dtype = torch.float32,
        on_done: Callable[[], None] | None = None,
        output_window: int | None = None,
    ) -> LookupResult | T:
        """Look up a request off the event loop, or on it for requests of at most
        ``inline_max_ids`` ids (their kernels are shorter than the hand-off to a worker).

        Parameters
        ----------
        features : the request's features (each name at most once).
        pooling : ``"sum"``, ``"mean"`` or ``"none"``.
        deadline : ``time.monotonic()`` past which the work is not started.
        then : applied to the result on the worker thread, and its value returned instead (the
            server encodes responses there: copying a 27 MB response into a message would
            otherwise stall the event loop and every other RPC with it).
        slot : the request's admission, taken by the caller with :meth:`admit` when it keeps
            the result's memory past the return (it releases its own hold); None = admit here,
            released when the kernels finish.
        table_version : the table-set version to read (one the store keeps); 0 = the newest.
        output_dtype : element type of pooled results (see :meth:`run`).
        on_done : called once the work has ended wherever it ran (also when it failed, was
            refused, or outlived a cancelled caller): when nothing touches what ``then`` uses.
        output_window : see :meth:`run`.

        Raises
        ------
        Overloaded : ``max_inflight`` requests are already admitted (without ``slot``).
        NotFound : a feature has no table.
        InvalidArgument : malformed ids / lengths / weights, or an id out of range.
        DeadlineExceeded : the deadline passed before a worker thread picked the request up.
        VersionNotHeld : ``table_version`` is not one the store keeps.
        """
        if self.runs_inline(features):
            try:
                own = self.admit() if slot is None else None
                try:
                    result = self.run(
                        features,
                        pooling,
                        deadline=deadline,
                        table_version=table_version,
                        output_dtype=output_dtype,
                        output_window=output_window,
                    )
                    return result if then is None else then(result)
                finally:
                    if own is not None:
                        own.release()
            finally:
                if on_done is not None:
                    on_done()
        try:
            future = self.submit(
                features,
                pooling,
                deadline=deadline,
                then=then,
                slot=slot,
                table_version=table_version,
                output_dtype=output_dtype,
                output_window=output_window,
            )
        except BaseException:
            if on_done is not None:
                on_done()
            raise
        if on_done is not None:
            future.add_done_callback(lambda _: on_done())
        # If the caller is cancelled (client gone, deadline) the thread still finishes its
        # kernel; the work's hold on the admission slot is released by the future's callback,
        # not here, so the bound on in-flight work holds.
        return await asyncio.wrap_future(future)

    def submit(
        self,
        features: Request,
        pooling: Pooling,
        *,
        deadline: float | None = None,
        then: Callable[[LookupResult], T] | None = None,
        slot: AdmissionSlot | None = None,
        table_version: int = 0,
        output_dtype: torch.dtype = torch.float32,
        output_window: int | None = None,
    ) -> Future[LookupResult | T]:
        """Admit a request (unless ``slot`` is given) and queue it on the worker threads (see
        :meth:`lookup`)."""
        if slot is None:
            slot = self.admit()  # the work's alone
        else:
            slot.hold()

        queued = time.perf_counter()

        def work() -> LookupResult | T:
            if self.observer is not None:
                self.observer.queue_waited(time.perf_counter() - queued)
            result = self.run(
                features,
                pooling,
                deadline=deadline,
                table_version=table_version,
                output_dtype=output_dtype,
                output_window=output_window,
            )
            return result if then is None else then(result)

        try:
            future = self._pool.submit(work)
        except BaseException:
            slot.release()
            raise
        future.add_done_callback(slot.release)
        return future

    def run(
        self,
        features: Request,
        pooling: Pooling,
        *,
        deadline: float | None = None,
        table_version: int = 0,
        output_dtype: torch.dtype = torch.float32,
        output_window: int | None = None,
    ) -> LookupResult:
        """Look up a request on the calling thread (no admission control): the in-process path.

        ``output_window``: the bytes of the shared-memory window the result goes to, which then
        bounds its size instead of ``max_output_bytes`` (it never enters a message).

        ``output_dtype`` float16 or bfloat16 rounds each pooled result once, to nearest even,
        from its fp32 accumulation (a relative error of at most 2**-11 resp. 2**-8 of each
        value, plus fp16's overflow to inf past 65504); NONE rows are never converted.
        """
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded("deadline passed while the request waited for a worker")
        if pooling not in POOLINGS:
            raise InvalidArgument("pooling", f"must be one of {POOLINGS}, got {pooling!r}")
        if output_dtype not in OUTPUT_DTYPES:
            raise InvalidArgument("output_dtype", f"must be one of {OUTPUT_DTYPES}")
        if output_dtype != torch.float32 and pooling == "none":
            raise InvalidArgument(
                "output_dtype", "NONE returns rows bit-exact in the table's dtype: leave it unset"
            )
        with self.store.acquire(table_version) as snap:
            if isinstance(features, PackedRequest):
                limit = self._output_limit(output_window)
                values = self._run_in_one_call(snap, features, pooling, limit)
                if values is not None:
                    if output_dtype != torch.float32:
                        values = _rounded(values, output_dtype)
                    return LookupResult(
                        version=snap.version,
                        features=[
                            FeatureResult(n, v) for n, v in zip(features.names, values, strict=True)
                        ],
                    )
                features = features.queries()  # the general path, which names any bad field
            plan = self._plan(snap, features, pooling, output_dtype, output_window)
            if self.hot_rows is not None:
                self.hot_rows.record(
                    (item.table_name, plan.ids[slice(*item.id_span)], item.table.num_rows)
                    for item in plan.work
                )
            out: list[torch.Tensor | None] = [None] * len(features)
            calls: list[KernelCall] = []
            rest = plan.work
            with self._cuda_request():
                if pooling != "none":
                    batched: list[_TableWork] = []
                    rest = []
                    for item in plan.work:
                        (rest if self._dedupes(item) else batched).append(item)
                    if batched:
                        self._run_tables(snap, plan, batched, pooling, calls, out)
                for item in rest:
                    results = self._run_table(plan, item, pooling, calls)
                    for pos, values in zip(item.positions, results, strict=True):
                        out[pos] = values
            if self.observer is not None:
                self.observer.kernels_done(pooling, calls)
            if output_dtype != torch.float32:
                out = _rounded(out, output_dtype)  # type: ignore[arg-type]
            return LookupResult(
                version=snap.version,
                features=[FeatureResult(q.name, v) for q, v in zip(features, out, strict=True)],  # type: ignore[arg-type]
            )

    def _plan(
        self,
        snap: TableSnapshot,
        features: Sequence[FeatureQuery],
        pooling: Pooling,
        output_dtype: torch.dtype = torch.float32,
        output_window: int | None = None,
    ) -> _RequestPlan:
        """The request checked and grouped by table. Errors, first found first: a repeated or
        unknown feature, a feature's dtypes and shapes (in request order), then lengths and ids
        (the first bad feature in request order), then a result over ``max_output_bytes`` (or
        its ``output_window``)."""
        by_table: dict[str, _TableWork] = {}
        seen: set[str] = set()
        output_bytes = 0
        for i, query in enumerate(features):
            if query.name in seen:
                raise InvalidArgument(f"features[{i}].name", f"feature {query.name!r} repeated")
            seen.add(query.name)
            try:
                table_name, _ = snap.table_for_feature(query.name)
            except KeyError:
                raise NotFound(f"unknown feature {query.name!r}") from None
            # The table as this engine's kernels read it: on a GPU, the snapshot's device copies.
            table = snap.kernel_table(table_name)
            _check_layout(query, i, pooling, table_name, table)
            output_bytes += _output_bytes(query, pooling, table)
            item = by_table.get(table_name)
            if item is None:
                rows = snap.row_range(table_name)
                item = by_table[table_name] = _TableWork(table_name, table, rows)
            item.positions.append(i)
            item.queries.append(query)
        work = list(by_table.values())
        plan = _concatenate(work)
        _check_values(plan)
        if pooling != "none":  # sized as fp32 above
            output_bytes = output_bytes * output_dtype.itemsize // 4
        limit = self._output_limit(output_window)
        if limit is not None and output_bytes > limit:
            if output_window is not None:
                raise InvalidArgument(
                    "output_region.byte_size",
                    f"the result would be {output_bytes} bytes, over the {output_window} bytes"
                    " of its output window",
                )
            raise InvalidArgument(
                "features",
                f"the result would be {output_bytes} bytes, over this server's limit of "
                f"{self.max_output_bytes}: split the batch (LookupStream pipelines the parts)",
            )
        for item in work:
            if item.rows.start:  # global ids -> rows of this shard's file
                plan.ids[slice(*item.id_span)] -= item.rows.start
        return plan

    def _dedupes(self, item: _TableWork) -> bool:
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
        plan: _RequestPlan,
        items: list[_TableWork],
        pooling: Pooling,
        calls: list[KernelCall],
        out: list[torch.Tensor | None],
    ) -> None:
        """Pooled lookups of several tables with one call of the fused kernel (on a GPU one
        launch per chunk width; see :class:`~ibpembed.codec.CompressedTableSet`), every
        feature's result put in ``out``."""
        table_set, position = snap.pooling_set
        # (set position, first bag, bag count) per table
        table_bags = np.array(
            [(position[item.table_name], *item.sample_span) for item in items], dtype=np.int64
        ).reshape(-1, 3)
        table_bags[:, 2] -= table_bags[:, 1]
        values, seconds = table_set.lookup(
            torch.from_numpy(table_bags),  # on the host, also for a GPU set
            self._tensor(plan.ids),
            self._tensor(plan.offsets),
            None if plan.weights is None else self._tensor(plan.weights),
            pooling,  # type: ignore[arg-type]
        )
        if self.device.type != "cpu":
            values = _to_host(values)
        for item, table_values, took in zip(items, values, seconds, strict=True):
            nnz = item.id_span[1] - item.id_span[0]
            calls.append((item.table_name, nnz, nnz, took))
            parts = _split(table_values, [q.lengths.size for q in item.queries])
            for pos, part in zip(item.positions, parts, strict=True):
                out[pos] = part

    def _run_table(
        self, plan: _RequestPlan, item: _TableWork, pooling: Pooling, calls: list[KernelCall]
    ) -> list[torch.Tensor]:
        """One kernel call for every feature of the request that reads this table (appended to
        ``calls``)."""
        start = time.perf_counter()
        table = item.table
        qs = item.queries
        ids = self._tensor(plan.ids[slice(*item.id_span)])
        nnz = ids.numel()
        unique_count = nnz
        if pooling == "none":
            unique, inverse = torch.unique(ids, return_inverse=True)
            unique_count = unique.numel()
            values = table.gather(unique).index_select(0, inverse)
            sizes = [q.ids.size for q in qs]
        else:
            first, end = item.sample_span
            offsets_np = plan.offsets[first : end + 1]
            if offsets_np[0]:  # the table's bags counted from its first id
                offsets_np = offsets_np - offsets_np[0]
            weights = None
            if plan.weights is not None and any(q.weights is not None for q in qs):
                weights = self._tensor(plan.weights[slice(*item.id_span)])
            values, unique_count = self._pool_table(
                table,
                ids,
                plan.lengths[first:end],
                self._tensor(offsets_np),
                weights,
                pooling,
                dedupe=self._dedupes(item),
            )
            sizes = [q.lengths.size for q in qs]
        if self.device.type != "cpu":
            values = values.cpu()
        calls.append((item.table_name, nnz, unique_count, time.perf_counter() - start))
        return _split(values, sizes)

    @contextlib.contextmanager
    def _cuda_request(self) -> Iterator[None]:
        """On a GPU, one request's kernels: on this thread's own CUDA stream (made on first
        use), so requests on different workers overlap instead of queueing on the default
        stream; with the ops' errors deferred to one check at the end (after the results were
        copied back, which synchronised the stream anyway) instead of a sync in every op. A
        no-op on the CPU."""
        if self.device.type != "cuda":
            yield
            return
        from ibpembed import _C

        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            _C.set_defer_cuda_errors(True)
            try:
                yield
            except BaseException:
                # This request is failing anyway: drain what its kernels reported, so that the
                # stream's next request is not blamed for it.
                with contextlib.suppress(RuntimeError, ValueError, IndexError):
                    _C.check_cuda_errors()
                raise
            finally:
                _C.set_defer_cuda_errors(False)
            _C.check_cuda_errors()

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
        path (:meth:`_dedupes`), taken when the distinct ids are few enough."""
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

    def _output_limit(self, output_window: int | None) -> int | None:
        """Largest result (bytes) a request may produce."""
        return self.max_output_bytes if output_window is None else output_window

    def _run_in_one_call(
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
        features = self._one_call_features(snap)
        try:
            entries = [features[name] for name in request.names]
        except KeyError:
            return None
        count = len(entries)
        if len(set(request.names)) != count:
            return None
        meta = np.array([e[:2] for e in entries], dtype=np.int64).reshape(count, 2)
        samples = request.sample_counts
        if limit is not None and int(samples @ meta[:, 1]) * 4 > limit:
            return None
        offsets = np.zeros(request.lengths.size + 1, dtype=np.int64)
        np.cumsum(request.lengths, dtype=np.int64, out=offsets[1:])
        sample_ends = np.cumsum(samples)
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
                pooling,  # type: ignore[arg-type]
            )
        except (IndexError, ValueError):  # an id out of range or a negative length
            return None
        if self.hot_rows is not None:  # after the kernel: it has checked every id
            id_ends = np.cumsum(request.id_counts).tolist()
            self.hot_rows.record(
                (e[2], request.ids[end - n : end], e[3])
                for e, n, end in zip(entries, request.id_counts.tolist(), id_ends, strict=True)
            )
        if self.observer is not None:
            nnz = request.id_counts.tolist()
            self.observer.kernels_done(
                pooling,
                [(e[2], n, n, t) for e, n, t in zip(entries, nnz, seconds, strict=True)],
            )
        return values

    def _one_call_features(self, snap: TableSnapshot) -> dict[str, tuple[int, int, str, int]]:
        """Features of ``snap`` that :meth:`_run_in_one_call` serves: (position in the
        snapshot's pooling set, pooled dim, table, rows). Built once per snapshot."""
        cached = self._one_call_cache
        if cached is not None and cached[0] is snap:
            return cached[1]
        _, position = snap.pooling_set
        features = {}
        for feature, name in snap.features.items():
            table = snap.tables[name]
            if name not in position or name in snap.shards:
                continue
            dim = (
                table.dim - INT8_ROWWISE_HEADER_BYTES
                if table.quant == "int8_rowwise"
                else table.dim
            )
            features[feature] = (position[name], dim, name, table.num_rows)
        self._one_call_cache = (snap, features)
        return features

    def runs_inline(self, features: Request) -> bool:
        """Whether :meth:`lookup` runs this request on the calling thread."""
        if not self.inline_max_ids:
            return False
        if isinstance(features, PackedRequest):
            return features.ids.size <= self.inline_max_ids
        ids = 0
        for query in features:
            ids += query.ids.size
            if ids > self.inline_max_ids:
                return False
        return True

    # -- introspection -----------------------------------------------------------------------
    def describe(self, name: str | None = None) -> list[TableDescription]:
        """Every table (``name=None``) or one table; :class:`NotFound` for an unknown name."""
        with self.store.acquire() as snap:
            if name is not None and name not in snap.tables:
                raise NotFound(f"unknown table {name!r}")
            features: dict[str, list[str]] = {}
            for feature, table_name in snap.features.items():
                features.setdefault(table_name, []).append(feature)
            names = [name] if name is not None else sorted(snap.tables)
            return [
                _describe(
                    n,
                    snap.tables[n],
                    snap.row_range(n),
                    snap.version,
                    tuple(sorted(features.get(n, ()))),
                )
                for n in names
            ]

    def close(self) -> None:
        """Wait for running kernels, then stop the worker threads (and the hot-row refresh)."""
        self._pool.shutdown(wait=True)
        if self.hot_rows is not None:
            self.hot_rows.close()


def _to_host(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """GPU results copied to the host with one copy for all of them (each a separate copy and
    sync would cost more than a small request's kernel)."""
    if not values:
        return values
    flat = torch.cat([v.reshape(-1) for v in values]).cpu()
    parts = torch.split(flat, [v.numel() for v in values])
    return [p.view(v.shape) for p, v in zip(parts, values, strict=True)]


def _describe(
    name: str, table: CompressedTable, rows: RowRange, version: int, features: tuple[str, ...]
) -> TableDescription:
    """``num_rows`` is the whole table's; ``row_start``/``row_end`` and the byte counts are
    what this server holds."""
    return TableDescription(
        name=name,
        num_rows=rows.total,
        dim=table.dim,
        dtype=table.dtype,
        quant=table.quant,
        raw_bytes=table.raw_bytes,
        stored_bytes=table.stored_bytes,
        chunk_bits=table.chunk_bits,
        version=version,
        features=features,
        row_start=rows.start,
        row_end=rows.end,
    )


def _rounded(values: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
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


def _output_bytes(query: FeatureQuery, pooling: Pooling, table: CompressedTable) -> int:
    """Bytes of one feature's result: [nnz, row] for NONE, [B, pooled dim] fp32 otherwise."""
    if pooling == "none":
        return query.ids.size * table.row_bytes
    dim = table.dim - INT8_ROWWISE_HEADER_BYTES if table.quant == "int8_rowwise" else table.dim
    return query.lengths.size * dim * 4


def _check_layout(
    query: FeatureQuery, index: int, pooling: Pooling, table_name: str, table: CompressedTable
) -> None:
    """One feature's dtypes and shapes, checked with messages naming the field (its values are
    checked with the whole request's, :func:`_check_values`)."""
    where = f"features[{index}]"
    ids, lengths, weights = query.ids, query.lengths, query.weights
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise InvalidArgument(f"{where}.ids", f"must be 1-D int64, got {ids.dtype} {ids.shape}")
    if lengths.dtype != np.int32 or lengths.ndim != 1:
        raise InvalidArgument(
            f"{where}.lengths", f"must be 1-D int32, got {lengths.dtype} {lengths.shape}"
        )
    if weights is not None:
        if pooling == "none":
            raise InvalidArgument(f"{where}.weights", "weights need pooling SUM or MEAN")
        if weights.dtype != np.float32 or weights.shape != ids.shape:
            raise InvalidArgument(
                f"{where}.weights",
                f"must be [{ids.size}] float32 (one per id), got {weights.dtype} {weights.shape}",
            )
    if pooling != "none" and not table.poolable:
        raise InvalidArgument(
            "pooling", f"table {table_name!r} holds {table.dtype} rows, which only pool as NONE"
        )


def _concatenate(work: list[_TableWork]) -> _RequestPlan:
    """Every feature's ids, lengths and weights in one array each, table after table; sets each
    item's spans. The ids are a copy: kernels take writable memory, shards shift them."""
    queries = [q for item in work for q in item.queries]
    id_end = sample_end = 0
    for item in work:
        id_start, sample_start = id_end, sample_end
        for q in item.queries:
            id_end += q.ids.size
            sample_end += q.lengths.size
        item.id_span, item.sample_span = (id_start, id_end), (sample_start, sample_end)
    ids = np.concatenate([q.ids for q in queries]) if queries else np.empty(0, np.int64)
    lengths = np.concatenate([q.lengths for q in queries]) if queries else np.empty(0, np.int32)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, dtype=np.int64, out=offsets[1:])
    weights = None
    if any(q.weights is not None for q in queries):
        weights = np.concatenate(
            [
                q.weights if q.weights is not None else np.ones(q.ids.size, np.float32)
                for q in queries
            ]
        )
    return _RequestPlan(work, ids, offsets, lengths, weights)


def _check_values(plan: _RequestPlan) -> None:
    """Lengths and id ranges of every feature, vectorised over the request; the error names the
    first bad feature in request order (lengths before ids)."""
    entries = [
        (pos, q, item)
        for item in plan.work
        for pos, q in zip(item.positions, item.queries, strict=True)
    ]
    if not entries:
        return
    id_sizes = np.array([q.ids.size for _, q, _ in entries], dtype=np.int64)
    sample_sizes = np.array([q.lengths.size for _, q, _ in entries], dtype=np.int64)
    bad_lengths = np.zeros(len(entries), dtype=bool)
    if plan.lengths.size and int(plan.lengths.min()) < 0:
        bad_lengths = np.array([q.lengths.size > 0 and q.lengths.min() < 0 for _, q, _ in entries])
    # Sums from the offsets: each feature's samples are contiguous in them.
    sample_ends = np.cumsum(sample_sizes)
    sums = plan.offsets[sample_ends] - plan.offsets[sample_ends - sample_sizes]
    bad_lengths |= sums != id_sizes
    bad_ids = np.zeros(len(entries), dtype=bool)
    present = id_sizes > 0
    if present.any():
        starts = (np.cumsum(id_sizes) - id_sizes)[present]
        lo, hi = np.minimum.reduceat(plan.ids, starts), np.maximum.reduceat(plan.ids, starts)
        first = np.array([item.rows.start for _, _, item in entries], dtype=np.int64)[present]
        end = np.array([item.rows.end for _, _, item in entries], dtype=np.int64)[present]
        bad_ids[present] = (lo < first) | (hi >= end)
    failing = np.flatnonzero(bad_lengths | bad_ids)
    if failing.size == 0:
        return
    k = min(failing, key=lambda i: entries[i][0])  # the first in request order
    index, query, item = entries[k]
    where = f"features[{index}]"
    if bad_lengths[k]:
        if query.lengths.size and query.lengths.min() < 0:
            raise InvalidArgument(f"{where}.lengths", "counts must be non-negative")
        raise InvalidArgument(
            f"{where}.lengths",
            f"sum to {int(sums[k])} but feature {query.name!r} has {query.ids.size} ids",
        )
    rows = item.rows
    lo_k, hi_k = int(query.ids.min()), int(query.ids.max())
    bad = lo_k if lo_k < rows.start else hi_k
    held = (
        f"with {rows.total} rows"
        if rows.is_whole
        else f"(this server holds the shard of rows [{rows.start}, {rows.end}) of {rows.total})"
    )
    raise InvalidArgument(
        f"{where}.ids",
        f"feature {query.name!r}: id {bad} out of range for table {item.table_name!r} {held}",
    )
