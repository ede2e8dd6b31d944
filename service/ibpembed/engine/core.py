# SPDX-License-Identifier: Apache-2.0
"""LookupEngine: admission, the hand-off to worker threads, and one snapshot per request; the
planning, kernels and hot tier live in the package's other modules."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from ibpembed.engine.cuda import resolve_device
from ibpembed.engine.execution import Executor, rounded
from ibpembed.engine.hbm_tier import HbmTier
from ibpembed.engine.planning import describe_table, output_limit, plan_request
from ibpembed.engine.requests import (
    FeatureResult,
    LookupObserver,
    LookupOptions,
    LookupResult,
    PackedRequest,
    Pooling,
    Request,
    TableDescription,
)
from ibpembed.engine.tier import HotTier
from ibpembed.engine_defaults import DEDUPE_MIN_IDS, DEFAULT_FORM, INLINE_MAX_IDS
from ibpembed.errors import DeadlineExceeded, FailedPrecondition, NotFound, Overloaded
from ibpembed.tables import mapping_guard
from ibpembed.tables.store import TableSnapshot, TableStore
from ibpembed.tables.tier_budget import TierBudget

T = TypeVar("T")
log = logging.getLogger(__name__)


class AdmissionSlot:
    """One admitted request's share of the engine's capacity (``max_inflight``).

    Held by every party that still has the request's memory: the worker running its kernels,
    and a caller that took it with :meth:`LookupEngine.admit` to keep the result past the
    return. The capacity comes back when the last holder lets go. (The server's streams do not
    hold one while a response waits to be written: ``server/backlog.py`` bounds those.)
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
        distinct row once. Tables whose decoded tier served at least FUSED_MIN_HOT_COVERAGE
        of the lookups that chose them take the fused kernel (see ``hot_tier``).
    dedupe_min_ids : see ``dedupe_max_unique_fraction``. Measured on CPU (D=128 fp32, one
        thread, per table of the demo set at B=512): the fused kernel is faster up to 13.8k ids
        (distinct fraction 0.36), the decode-once path 1.6x faster at 51k ids (0.26).
    max_output_bytes : largest result a request may produce (the server passes its max message
        size); a bigger request fails with :class:`InvalidArgument` before any memory is
        allocated for it. None = no limit.
    observer : optional metrics hook.
    hot_tier : the decoded hot tier's budget (``--hot-tier``; a
        :class:`~ibpembed.tables.tier_budget.TierBudget` or its spelling: ``"off"``, ``"all"``,
        ``"5%"`` of raw bytes, ``"savings"``, ``"512MiB"``): each table's most looked-up rows,
        chosen online from the traffic (:mod:`ibpembed.engine.tier`), are kept decoded for CPU
        lookups. ValueError for a malformed budget. Ignored on CUDA, where the kernels decode
        every row on the GPU. A table given its tier rows by hand (``with_hot_rows``) keeps
        them while this is off.
    hot_tier_refresh_s : seconds between publications of changed tiers (host and HBM).
    hbm_tier : on CUDA, the HBM tier's budget of GPU memory (``--hbm-tier``, the same spellings
        as ``hot_tier``): each table's most looked-up rows, chosen by the same policy, copied
        into GPU memory and read there by the kernels instead of over PCIe
        (:mod:`ibpembed.engine.hbm_tier`). Ignored on the CPU.
    hbm_tier_form : ``"decoded"`` or ``"compressed"`` tier rows (``--hbm-tier-form``).
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
        hot_tier: TierBudget | str = "off",
        hot_tier_refresh_s: float = 30.0,
        hbm_tier: TierBudget | str = "off",
        hbm_tier_form: str = DEFAULT_FORM,
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
        self.max_output_bytes = max_output_bytes
        self.observer = observer
        if inline_max_ids < 0:
            raise ValueError(f"inline_max_ids must be >= 0, got {inline_max_ids}")
        self.inline_max_ids = inline_max_ids if self.device.type == "cpu" else 0
        # Every setting is checked before a tier's thread starts: a bad one leaves none behind.
        budget = TierBudget.parse(hot_tier)
        hbm_budget = TierBudget.parse(hbm_tier, setting="hbm tier")
        self.tier: HotTier | None = None
        if budget.enabled and self.device.type == "cpu":
            self.tier = HotTier(store, budget=budget, refresh_s=hot_tier_refresh_s)
        self.hbm: HbmTier | None = None
        if hbm_budget.enabled and self.device.type == "cuda":
            self.hbm = HbmTier(
                store,
                budget=hbm_budget,
                form=hbm_tier_form,
                device=self.device,
                refresh_s=hot_tier_refresh_s,
            )
        self._executor = Executor(
            self.device,
            dedupe_max_unique_fraction=dedupe_max_unique_fraction,
            dedupe_min_ids=dedupe_min_ids,
            observer=observer,
            recorder=self.tier if self.tier is not None else self.hbm,
            hbm=self.hbm,
        )
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="ibpembed-lookup")
        self._lock = threading.Lock()
        self._inflight = 0
        for policy in (self.tier, self.hbm):
            if policy is not None:
                policy.start()

    # -- admission -------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        """Requests admitted and not yet finished: kernels still running, or a slot its caller
        still holds, count."""
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
        options: LookupOptions | Pooling,
        *,
        then: Callable[[LookupResult], T] | None = None,
        slot: AdmissionSlot | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> LookupResult | T:
        """Look up a request off the event loop, or on it for requests of at most
        ``inline_max_ids`` ids (their kernels are shorter than the hand-off to a worker).

        Parameters
        ----------
        features : the request's features (each name at most once).
        options : how to look it up (:class:`LookupOptions`; a pooling name alone means the
            defaults with that pooling).
        then : applied to the result on the worker thread, and its value returned instead (the
            server encodes responses there: copying a 27 MB response into a message would
            otherwise stall the event loop and every other RPC with it).
        slot : the request's admission, taken by the caller with :meth:`admit` when it keeps
            the result's memory past the return (it releases its own hold); None = admit here,
            released when the kernels finish.
        on_done : called once the work has ended wherever it ran (also when it failed, was
            refused, or outlived a cancelled caller): when nothing touches what ``then`` uses.

        Raises
        ------
        Overloaded : ``max_inflight`` requests are already admitted (without ``slot``).
        NotFound : a feature has no table.
        InvalidArgument : malformed ids / lengths / weights, or an id out of range.
        DeadlineExceeded : the deadline passed before a worker thread picked the request up.
        VersionNotHeld : ``options.table_version`` is not one the store keeps.
        """
        if self.runs_inline(features):
            try:
                own = self.admit() if slot is None else None
                try:
                    result = self.run(features, options)
                    return result if then is None else then(result)
                finally:
                    if own is not None:
                        own.release()
            finally:
                if on_done is not None:
                    on_done()
        try:
            future = self.submit(features, options, then=then, slot=slot)
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
        options: LookupOptions | Pooling,
        *,
        then: Callable[[LookupResult], T] | None = None,
        slot: AdmissionSlot | None = None,
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
            result = self.run(features, options)
            return result if then is None else then(result)

        try:
            future = self._pool.submit(work)
        except BaseException:
            slot.release()
            raise
        future.add_done_callback(slot.release)
        return future

    def run(self, features: Request, options: LookupOptions | Pooling) -> LookupResult:
        """Look up a request on the calling thread (no admission control): the in-process path.

        ``options``: see :class:`LookupOptions` (a pooling name alone means the defaults with
        that pooling)."""
        options = LookupOptions.of(options)
        if options.deadline is not None and time.monotonic() >= options.deadline:
            raise DeadlineExceeded("deadline passed while the request waited for a worker")
        options.check()
        with self.store.acquire(options.table_version) as snap:
            try:
                result = self._run(snap, features, options)
            except Exception as err:
                self._refuse_damaged_files(snap, features, err)
                raise
            self._refuse_damaged_files(snap, features, None)
            return result

    def _refuse_damaged_files(
        self, snap: TableSnapshot, features: Request, err: Exception | None
    ) -> None:
        """Refuse a request that read a table whose file was shortened in place under it: a read
        past the new end faulted (its rows may be zeros, :mod:`ibpembed.tables.mapping_guard`),
        or, for a request the kernels found corrupt rows in (``err``: a ValueError), the file's
        stamp says it changed (zeros read up to the end of its last page raise no fault); that
        check withdraws the table at once instead of at the next poll. One counter read while
        no file ever faulted and the request succeeded."""
        corrupt = isinstance(err, ValueError)
        if not corrupt and mapping_guard.faults() == 0:
            return
        names = (
            features.names if isinstance(features, PackedRequest) else [q.name for q in features]
        )
        tables = {snap.features[f] for f in names if f in snap.features}
        for name in sorted(tables):
            if mapping_guard.faulted(snap.tables[name]):
                raise FailedPrecondition(
                    f"table {name!r}: its file was shortened in place while it was served, so "
                    "its rows cannot be read; publish it whole again (a new file renamed over "
                    "it) and reload"
                ) from err
        if not corrupt:
            return
        withdrawn = self.store.check_files()
        for table, why in withdrawn.items():  # newly withdrawn: logged once, as the poll does
            log.error("table %s withdrawn, its lookups refused: %s", table, why)
        gone = sorted(tables & withdrawn.keys())
        if gone:
            raise FailedPrecondition(
                f"table {gone[0]!r} is withdrawn: {withdrawn[gone[0]]}"
            ) from err

    def _run(self, snap: TableSnapshot, features: Request, options: LookupOptions) -> LookupResult:
        """:meth:`run` on a snapshot."""
        pooling, output_dtype = options.pooling, options.output_dtype
        if isinstance(features, PackedRequest):
            limit = output_limit(options, self.max_output_bytes)
            values = self._executor.run_in_one_call(snap, features, pooling, limit)
            if values is not None:
                if output_dtype != torch.float32:
                    values = rounded(values, output_dtype)
                return LookupResult(
                    version=snap.version,
                    features=[
                        FeatureResult(n, v) for n, v in zip(features.names, values, strict=True)
                    ],
                )
            features = features.queries()  # the general path, which names any bad field
        plan = plan_request(snap, features, options, self.max_output_bytes)
        out = self._executor.run_plan(snap, plan, pooling, len(features))
        if output_dtype != torch.float32:
            out = rounded(out, output_dtype)
        return LookupResult(
            version=snap.version,
            features=[FeatureResult(q.name, v) for q, v in zip(features, out, strict=True)],
        )

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
                describe_table(
                    n,
                    snap.tables[n],
                    snap.row_range(n),
                    snap.version,
                    tuple(sorted(features.get(n, ()))),
                )
                for n in names
            ]

    def close(self) -> None:
        """Wait for running kernels, then stop the worker threads (and the hot tier's thread)."""
        self._pool.shutdown(wait=True)
        if self.tier is not None:
            self.tier.close()
        if self.hbm is not None:
            self.hbm.close()
