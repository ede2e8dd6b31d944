# SPDX-License-Identifier: Apache-2.0
"""Every Prometheus metric of the server, in one place.

:class:`ServerMetrics` is the server's observer (``LookupServer(observer=...)``): the engine
reports the kernel calls of each request (:meth:`~ServerMetrics.kernels_done`, worker threads),
and the service interceptor each finished RPC (:meth:`~ServerMetrics.rpc_done`) and the start and
answer of every lookup request, each request inside a ``LookupStream`` included
(:meth:`~ServerMetrics.lookup_started`, :meth:`~ServerMetrics.lookup_done`; event loop). Table
sizes, versions and the build are read from the store when Prometheus scrapes, so they cost
nothing per request.

Names end in their unit (``_seconds``, ``_bytes``, ``_total``, ``_ratio``). Labels take bounded
values only: the RPC method, the status code name, the pooling mode and the table name (tables
come from the server's own table set, never from a request). Ids, feature names sent by clients
and request ids never become labels.

=====================================================  =========  ==================================
metric                                                 type       labels
=====================================================  =========  ==================================
``ibpembed_build_info``                                gauge      version, device, cpu_path,
                                                                  pattern_lookup, torch
``ibpembed_requests_total``                            counter    method, code
``ibpembed_lookup_duration_seconds``                   histogram  method, pooling
``ibpembed_inflight_requests``                         gauge      —
``ibpembed_kernel_duration_seconds``                   histogram  pooling
``ibpembed_rows_looked_up_total``                      counter    table, pooling
``ibpembed_decoded_bytes_total``                       counter    table
``ibpembed_table_raw_bytes``                           gauge      table
``ibpembed_table_stored_bytes``                        gauge      table
``ibpembed_table_hot_row_bytes``                       gauge      table
``ibpembed_table_saved_bytes``                         gauge      table
``ibpembed_table_compression_ratio``                   gauge      table
``ibpembed_table_version``                             gauge      table
``ibpembed_table_reloads_total``                       counter    table
``ibpembed_table_set_reloads_total``                   counter    result
``ibpembed_table_set_reload_failing``                  gauge      —
``ibpembed_table_set_versions_held``                   gauge      —
``ibpembed_table_set_older_versions_bytes``            gauge      —
``ibpembed_queue_wait_seconds``                        histogram  —
``ibpembed_wire_duration_seconds``                     histogram  phase
``ibpembed_hot_row_hits_total``                        counter    table
``ibpembed_hot_row_misses_total``                      counter    table
``ibpembed_hot_row_hit_ratio``                         gauge      table
``ibpembed_hot_row_would_be_hit_ratio``                gauge      table
``ibpembed_hot_tier_on``                               gauge      table, reason
``ibpembed_hot_row_admissions_total``                  counter    table
``ibpembed_hot_row_evictions_total``                   counter    table
``ibpembed_table_hot_row_budget_bytes``                gauge      table
``ibpembed_hot_tier_policy_bytes``                     gauge      table
``ibpembed_loading``                                   gauge      —
``ibpembed_loading_progress_ratio``                    gauge      —
``ibpembed_output_bytes_total``                        counter    transport
=====================================================  =========  ==================================

The HTTP port serves ``/metrics`` (the exposition), ``/healthz`` (200 while the process runs:
liveness, also while the tables load) and ``/readyz`` (200 while lookups are served, 503 while
loading or draining: readiness); any other path is 404, so a probe pointed at a wrong path fails
instead of passing.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import socket
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
import prometheus_client
import torch
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

import ibpembed
from ibpembed.codec import pattern_lookup
from ibpembed.engine import KernelCall
from ibpembed.engine.hbm_tier import HbmTier
from ibpembed.engine.tier import HotTier
from ibpembed.server.interceptors import STREAM_METHOD
from ibpembed.server.ports import bind_error_text
from ibpembed.server.reload import RELOAD_RESULTS, ReloadResult
from ibpembed.tables.store import TableStore
from ibpembed_client.v1 import lookup_pb2 as pb

NAMESPACE = "ibpembed"
# Sub-millisecond resolution at the bottom (a cached B=1 lookup is ~100 us on CPU; the
# client library's default buckets start at 5 ms), up to 10 s for huge batches and stalls.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    500e-3,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Decoding a request and encoding its response take tens of microseconds at small batches (B=1 x 26
# features: ~30 and ~45 us): two buckets below LATENCY_BUCKETS_S's first.
WIRE_BUCKETS_S: tuple[float, ...] = (5e-6, 10e-6, *LATENCY_BUCKETS_S)
# Protocol enum -> the engine's pooling names; values the server rejects share one label.
_POOLING_NAMES = {
    pb.POOLING_UNSPECIFIED: "sum",
    pb.POOLING_SUM: "sum",
    pb.POOLING_MEAN: "mean",
    pb.POOLING_NONE: "none",
}
_INVALID_POOLING = "invalid"
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _pooling(request: object) -> str:
    """The pooling label of a request; undecodable messages (no ``pooling``) count as invalid."""
    pooling = getattr(request, "pooling", None)
    if pooling is None:
        return _INVALID_POOLING
    return _POOLING_NAMES.get(pooling, _INVALID_POOLING)


def _short(method: str) -> str:
    """``/ibpembed.v1.EmbeddingLookup/Lookup`` -> ``Lookup``."""
    return method.rsplit("/", 1)[-1]


class _Counters:
    """A labelled counter kept as plain numbers under one lock, exposed at scrape.

    NOTE(metrics): the client library's metric objects cost 1-3 us per update (a lock per
    value, ``labels()`` building a key each time); a 26-feature request updates several
    metrics per table, so the hot paths use these accumulators and a collector instead.
    """

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def family(self) -> CounterMetricFamily:
        with self._lock:
            values = sorted(self._values.items())
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, total in values:
            family.add_metric(list(labels), total)
        return family


def _histogram(
    name: str,
    documentation: str,
    labels: Sequence[str],
    bounds: Sequence[float],
    series: Sequence[tuple[tuple[str, ...], Sequence[float]]],
) -> HistogramMetricFamily:
    """A histogram family from per-bucket counts: ``[count per bound..., above, sum]``."""
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    edges = [floatToGoString(b) for b in bounds] + ["+Inf"]
    for label_values, values in series:
        cumulative = itertools.accumulate(values[: len(edges)])
        family.add_metric(
            list(label_values),
            list(zip(edges, cumulative, strict=True)),
            sum_value=values[len(edges)],
        )
    return family


class _Histograms:
    """A labelled histogram kept as per-bucket counts under one lock, exposed at scrape."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], bounds: Sequence[float]
    ) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self.bounds = tuple(bounds)
        self._lock = threading.Lock()
        # labels -> [count in (bound[i-1], bound[i]] for each bound, count above the last, sum]
        self._series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        # First bound >= value: Prometheus buckets are "less than or equal".
        bucket = bisect.bisect_left(self.bounds, value)
        with self._lock:
            series = self._series.get(labels)
            if series is None:
                series = self._series[labels] = [0.0] * (len(self.bounds) + 2)
            series[bucket] += 1
            series[-1] += value

    def family(self) -> HistogramMetricFamily:
        with self._lock:
            series = sorted((labels, list(values)) for labels, values in self._series.items())
        return _histogram(self.name, self.documentation, self.labels, self.bounds, series)


class _Families(Collector):
    """Exposes accumulators through the registry."""

    def __init__(self, *accumulators: _Counters | _Histograms) -> None:
        self.accumulators = accumulators

    def collect(self) -> Iterator[Metric]:
        for accumulator in self.accumulators:
            yield accumulator.family()


class _KernelTally(Collector):
    """Kernel calls per (table, pooling): latency buckets, ids and decoded bytes.

    Exposed as ``ibpembed_kernel_duration_seconds{pooling}``,
    ``ibpembed_rows_looked_up_total{table, pooling}`` and ``ibpembed_decoded_bytes_total{table}``.
    A request updates these once per table it reads (26 times for a DCNv2-profile request), so
    each worker thread keeps its own tally and takes no lock; scrapes add the tallies up.

    NOTE(metrics): a scrape copies another thread's tally while that thread may be updating it.
    Under the GIL each copy (``list(dict.items())``, ``list(values)``) is atomic, so a scrape sees
    every value at most one update behind, and counters never go backwards.
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._local = threading.local()
        self._lock = threading.Lock()  # guards _tallies (threads joining), not the updates
        # Per thread: (table, pooling) -> [latency bucket counts..., latency sum, ids, bytes].
        self._tallies: list[dict[tuple[str, str], list[float]]] = []

    def add(self, pooling: str, calls: Sequence[KernelCall], row_bytes: dict[str, int]) -> None:
        """One request's kernel calls; a call decodes ``unique`` rows of ``row_bytes[table]``."""
        try:
            tally = self._local.tally
        except AttributeError:
            tally = self._local.tally = {}
            with self._lock:
                self._tallies.append(tally)
        bounds = self.bounds
        for table, ids, unique, seconds in calls:
            series = tally.get((table, pooling))
            if series is None:
                series = tally[table, pooling] = [0.0] * (len(bounds) + 4)
            series[bisect.bisect_left(bounds, seconds)] += 1
            series[-3] += seconds
            series[-2] += ids
            series[-1] += unique * row_bytes.get(table, 0)

    def _merged(self) -> list[tuple[tuple[str, str], list[float]]]:
        with self._lock:
            tallies = list(self._tallies)
        merged: dict[tuple[str, str], list[float]] = {}
        for tally in tallies:
            for key, values in list(tally.items()):
                total = merged.setdefault(key, [0.0] * len(values))
                for i, v in enumerate(list(values)):
                    total[i] += v
        return sorted(merged.items())

    def collect(self) -> Iterator[Metric]:
        series = self._merged()
        latency: dict[tuple[str], list[float]] = {}
        rows = CounterMetricFamily(
            f"{NAMESPACE}_rows_looked_up",
            "Ids looked up (repeats included).",
            labels=["table", "pooling"],
        )
        decoded: collections.defaultdict[str, float] = collections.defaultdict(float)
        for (table, pooling), values in series:
            summed = latency.setdefault((pooling,), [0.0] * (len(values) - 2))
            for i, v in enumerate(values[:-2]):
                summed[i] += v
            rows.add_metric([table, pooling], values[-2])
            decoded[table] += values[-1]
        yield _histogram(
            f"{NAMESPACE}_kernel_duration_seconds",
            "One table's share of a lookup on a worker thread (decode, pool, copy out).",
            ["pooling"],
            self.bounds,
            sorted(latency.items()),
        )
        yield rows
        bytes_family = CounterMetricFamily(
            f"{NAMESPACE}_decoded_bytes",
            "Bytes of rows read from the compressed store: each distinct row once when the"
            " engine deduplicates a table's ids, else every id (rows the kernel serves from"
            " the decoded tier or from its per-call cache of decoded rows included).",
            labels=["table"],
        )
        for table, total in sorted(decoded.items()):
            bytes_family.add_metric([table], total)
        yield bytes_family


class _TableCollector(Collector):
    """Per-table gauges read from the store at scrape time, plus the replacement counts.

    A table counts as reloaded when the store publishes different rows under its name
    (``reload`` of a changed file, ``put_table``, ``update_rows``), told by its index tensor: a
    hot-row refresh republishes the same index and is no reload. Publications are noticed on the
    first lookup or scrape after them (:meth:`sync`), so two publications with no lookup and no
    scrape in between count once.
    """

    def __init__(self, store: TableStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._version = 0  # store version last synced
        # Weak references: holding old indexes here would keep their memory alive.
        self._seen: dict[str, weakref.ref[torch.Tensor]] = {}
        self._reloads: collections.Counter[str] = collections.Counter()
        self.row_bytes: dict[str, int] = {}

    def sync(self) -> None:
        """Catch up with the store's published version (cheap when nothing changed)."""
        if self.store.version == self._version:
            return
        with self._lock, self.store.acquire() as snap:
            if snap.version == self._version:
                return
            for name, table in snap.tables.items():
                seen = self._seen.get(name)
                if seen is not None and seen() is not table.block_base:
                    self._reloads[name] += 1
                self._seen[name] = weakref.ref(table.block_base)
            for gone in set(self._seen) - set(snap.tables):
                del self._seen[gone]
            self.row_bytes = {name: t.row_bytes for name, t in snap.tables.items()}
            self._version = snap.version

    def collect(self) -> Iterator[Metric]:
        self.sync()
        families = {
            "raw": GaugeMetricFamily(
                f"{NAMESPACE}_table_raw_bytes",
                "Bytes of the uncompressed table (rows x row bytes).",
                labels=["table"],
            ),
            "stored": GaugeMetricFamily(
                f"{NAMESPACE}_table_stored_bytes",
                "Bytes held to serve the table: payload buffer (with spare room for row updates),"
                " index, bitmask, masks and hot rows.",
                labels=["table"],
            ),
            "hot": GaugeMetricFamily(
                f"{NAMESPACE}_table_hot_row_bytes",
                "Bytes of the decoded hot tier kept for CPU lookups (part of stored bytes).",
                labels=["table"],
            ),
            "saved": GaugeMetricFamily(
                f"{NAMESPACE}_table_saved_bytes",
                "Raw bytes minus stored bytes (negative for tiny tables).",
                labels=["table"],
            ),
            "ratio": GaugeMetricFamily(
                f"{NAMESPACE}_table_compression_ratio",
                "Raw bytes / stored bytes.",
                labels=["table"],
            ),
            "version": GaugeMetricFamily(
                f"{NAMESPACE}_table_version",
                "Table-set version serving the table (DescribeTable's version).",
                labels=["table"],
            ),
        }
        reloads = CounterMetricFamily(
            f"{NAMESPACE}_table_reloads",
            "Times the table was replaced since start (reload, put_table, update_rows).",
            labels=["table"],
        )
        accounting = self.store.accounting()
        version = self.store.version
        for name, sizes in sorted(accounting.items()):
            families["raw"].add_metric([name], sizes.raw)
            families["stored"].add_metric([name], sizes.total)
            families["hot"].add_metric([name], sizes.hot)
            families["saved"].add_metric([name], sizes.raw - sizes.total)
            families["ratio"].add_metric([name], sizes.ratio)
            families["version"].add_metric([name], version)
            reloads.add_metric([name], self._reloads[name])
        yield from families.values()
        yield reloads


class _HotTierCollector(Collector):
    """The hot tier's policy, table by table: hits and misses of the published tier, the hit
    ratio of the last interval, the gate (on or off, why, and the would-be hit ratio it
    decides on), admissions and evictions, and the bytes the budget buys."""

    def __init__(self, tier: HotTier) -> None:
        self.tier = tier

    def collect(self) -> Iterator[Metric]:
        doc = (
            "Looked-up ids {} the table's published hot tier (--hot-tier), counted by the"
            " tier's policy every second over the ids it buffered (a sample under heavy load)."
        )
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "hits": CounterMetricFamily(
                f"{NAMESPACE}_hot_row_hits", doc.format("found in"), labels=["table"]
            ),
            "misses": CounterMetricFamily(
                f"{NAMESPACE}_hot_row_misses", doc.format("not found in"), labels=["table"]
            ),
            "ratio": GaugeMetricFamily(
                f"{NAMESPACE}_hot_row_hit_ratio",
                "Share of the looked-up ids of the policy's last interval with lookups that the"
                " published hot tier held.",
                labels=["table"],
            ),
            "would_be": GaugeMetricFamily(
                f"{NAMESPACE}_hot_row_would_be_hit_ratio",
                "Share of the looked-up ids of the hot tier gate's window (its last steps with"
                " lookups) that the rows the policy chose before them held: the hit ratio a"
                " published tier would have had; 0 until the window decides.",
                labels=["table"],
            ),
            "on": GaugeMetricFamily(
                f"{NAMESPACE}_hot_tier_on",
                "1 while the table's hot tier is published, 0 while its gate holds it back;"
                " reason: measuring (not decided yet), skewed (would-be hit ratio high enough),"
                " flat (too low: the tier's pre-pass would cost more than it saves).",
                labels=["table", "reason"],
            ),
            "admissions": CounterMetricFamily(
                f"{NAMESPACE}_hot_row_admissions",
                "Rows the hot tier's policy admitted (their estimated frequency beat the"
                " coldest resident's); published at the next refresh.",
                labels=["table"],
            ),
            "evictions": CounterMetricFamily(
                f"{NAMESPACE}_hot_row_evictions",
                "Rows the hot tier's policy evicted for more frequent ones.",
                labels=["table"],
            ),
            "policy": GaugeMetricFamily(
                f"{NAMESPACE}_hot_tier_policy_bytes",
                "Host bytes of the hot tier policy's own state for the table (its buffer of"
                " recorded ids, its frequency sketch, its target sets), paid from the budget.",
                labels=["table"],
            ),
            "budget": GaugeMetricFamily(
                f"{NAMESPACE}_table_hot_row_budget_bytes",
                "Bytes of decoded rows the --hot-tier budget buys the table (its tier's size"
                " once full), after the policy's state is paid from it.",
                labels=["table"],
            ),
        }
        for name, stats in sorted(self.tier.stats().items()):
            families["hits"].add_metric([name], stats.hits)
            families["misses"].add_metric([name], stats.misses)
            families["ratio"].add_metric([name], stats.hit_ratio)
            families["would_be"].add_metric([name], stats.would_be_hit_ratio)
            families["on"].add_metric([name, stats.reason], 1.0 if stats.on else 0.0)
            families["admissions"].add_metric([name], stats.admissions)
            families["evictions"].add_metric([name], stats.evictions)
            families["policy"].add_metric([name], stats.policy_bytes)
        for name, plan in sorted(self.tier.plan().items()):
            families["budget"].add_metric([name], plan.bytes)
        yield from families.values()


class _HbmTierCollector(Collector):
    """The HBM tier, table by table: the hits and misses its kernels counted on the GPU (read
    at each scrape with an asynchronous copy, so a scrape shows the previous scrape's copy and
    no request waits), the rows of its published tier and the bytes the budget buys."""

    def __init__(self, tier: HbmTier) -> None:
        self.tier = tier

    def collect(self) -> Iterator[Metric]:
        doc = (
            "Ids the kernels resolved {} the table's HBM tier (--hbm-tier), counted on the GPU"
            " (a run of equal ids in a sorted gather counts once); as of the previous scrape."
        )
        hits = CounterMetricFamily(
            f"{NAMESPACE}_hbm_tier_hits", doc.format("to rows in"), labels=["table"]
        )
        misses = CounterMetricFamily(
            f"{NAMESPACE}_hbm_tier_misses", doc.format("to host memory, not in"), labels=["table"]
        )
        rows = GaugeMetricFamily(
            f"{NAMESPACE}_hbm_tier_rows",
            "Rows of the table's published HBM tier.",
            labels=["table"],
        )
        budget = GaugeMetricFamily(
            f"{NAMESPACE}_table_hbm_tier_budget_bytes",
            "GPU bytes the --hbm-tier budget buys the table (residency map and slots, once full).",
            labels=["table"],
        )
        for name, (hit, miss) in sorted(self.tier.counts().items()):
            hits.add_metric([name], hit)
            misses.add_metric([name], miss)
        for name, tier in sorted(self.tier.tiers.current().items()):
            rows.add_metric([name], tier.arrays.num_slots)
        for name, plan in sorted(self.tier.plan().items()):
            budget.add_metric([name], plan.bytes)
        yield from (hits, misses, rows, budget)


class _VersionCollector(Collector):
    """The table-set versions the store keeps, and the memory only older ones hold."""

    def __init__(self, store: TableStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{NAMESPACE}_table_set_versions_held",
            "Table-set versions held and served on request (LookupRequest.table_version),"
            " the newest included (at most --keep-versions).",
            value=len(self.store.versions_held()),
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_table_set_older_versions_bytes",
            "Host bytes held only for kept versions older than the newest (their tables the"
            " newest does not share).",
            value=self.store.older_versions_bytes(),
        )


# (status, body) of the probe paths besides /metrics.
_Answer = tuple[str, bytes]
_NOT_FOUND: _Answer = (
    "404 Not Found",
    b"not found: this port serves /metrics, /healthz, /readyz\n",
)


def _probe_answer(path: str, ready: Callable[[], bool]) -> _Answer:
    if path == "/healthz":
        return "200 OK", b"ok\n"
    if path == "/readyz":
        return ("200 OK", b"ready\n") if ready() else ("503 Service Unavailable", b"not ready\n")
    return _NOT_FOUND


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few s: no access log
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def _family(address: str) -> socket.AddressFamily:
    infos = socket.getaddrinfo(address or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]


class ServerMetrics:
    """The server's metrics: observer of the engine, the RPCs and the table-set reloads.

    Parameters
    ----------
    store : the table store the server serves (per-table gauges are read from it at scrape);
        None while it loads (:meth:`attach` it then).
    device : where the kernels run (``"cpu"`` or ``"cuda"``; the setting until :meth:`attach`
        says what the self-test chose), for ``ibpembed_build_info``.
    registry : where the metrics live; a fresh registry by default, so several servers can run
        in one process (tests) without colliding in the client library's global one.
    """

    def __init__(
        self,
        store: TableStore | None = None,
        *,
        device: str,
        registry: CollectorRegistry | None = None,
    ) -> None:
        # The client library's ``*_created`` samples would double the series of every counter
        # and histogram for a start time that process_start_time_seconds already gives.
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry() if registry is None else registry
        reg = self.registry
        prometheus_client.ProcessCollector(registry=reg)
        self._info = prometheus_client.Info(
            f"{NAMESPACE}_build", "Server build: package version, device, CPU path.", registry=reg
        )
        self._set_device(device)
        self._requests = _Counters(
            f"{NAMESPACE}_requests",
            "Finished requests by status code: unary RPCs, and each request of a LookupStream"
            " (a stream failing as a whole counts once more, with its code).",
            ["method", "code"],
        )
        self._latency = _Histograms(
            f"{NAMESPACE}_lookup_duration_seconds",
            "Lookup request latency in the server: Lookup calls, and each LookupStream request"
            " from its arrival to its response.",
            ["method", "pooling"],
            LATENCY_BUCKETS_S,
        )
        self._kernel = _KernelTally(LATENCY_BUCKETS_S)
        reg.register(self._kernel)
        self._queue = _Histograms(
            f"{NAMESPACE}_queue_wait_seconds",
            "Time admitted lookup requests waited for a kernel thread (--workers) before their"
            " kernels started: the queue part of ibpembed_lookup_duration_seconds.",
            [],
            LATENCY_BUCKETS_S,
        )
        self._wire = _Histograms(
            f"{NAMESPACE}_wire_duration_seconds",
            "Time lookup requests spent in the servicer's message conversion: decode (checks,"
            " and the request or its input region into engine inputs) and encode (the result"
            " into response bytes, or into its output region). Parts of"
            " ibpembed_lookup_duration_seconds.",
            ["phase"],
            WIRE_BUCKETS_S,
        )
        reg.register(_Families(self._queue, self._wire))
        # Touched on the event loop only (lookup_started/done), so a plain int read at scrape
        # will do.
        self._inflight = 0
        prometheus_client.Gauge(
            f"{NAMESPACE}_inflight_requests",
            "Lookup requests received and not yet answered (LookupStream: per request).",
            registry=reg,
        ).set_function(lambda: self._inflight)
        self._tables: _TableCollector | None = None
        # 1 until attach; tables loaded / tables meanwhile. Load-thread and event-loop writes
        # of plain floats, read at scrape.
        self._loading = 1.0
        self._progress = 0.0
        prometheus_client.Gauge(
            f"{NAMESPACE}_loading",
            "1 while the server loads its table set and checks its device (health NOT_SERVING,"
            " /readyz 503).",
            registry=reg,
        ).set_function(lambda: self._loading)
        prometheus_client.Gauge(
            f"{NAMESPACE}_loading_progress_ratio",
            "Tables of the set loaded so far / tables in it (1 once loaded).",
            registry=reg,
        ).set_function(lambda: self._progress)
        self._reloads = _Counters(
            f"{NAMESPACE}_table_set_reloads",
            "Reloads of the table set from its directory (manifest change or SIGHUP): ok"
            " (published), unchanged (nothing to publish), error (previous version kept).",
            ["result"],
        )
        for result in RELOAD_RESULTS:  # every series exists from the start, for rate()
            self._reloads.inc((result,), 0.0)
        self._output = _Counters(
            f"{NAMESPACE}_output_bytes",
            "Lookup outputs by where they went: wire (gRPC response bytes: values and framing)"
            " or shm (value bytes written into a client's shared-memory region).",
            ["transport"],
        )
        for transport in ("wire", "shm"):
            self._output.inc((transport,), 0.0)
        reg.register(_Families(self._requests, self._latency, self._reloads, self._output))
        self._reload_failing = 0  # event loop only, like _inflight
        prometheus_client.Gauge(
            f"{NAMESPACE}_table_set_reload_failing",
            "1 while the last reload of the table set failed (the previous version serves).",
            registry=reg,
        ).set_function(lambda: self._reload_failing)
        self._http: WSGIServer | None = None
        if store is not None:
            self.attach(store, device=device)

    def _set_device(self, device: str) -> None:
        self._info.info(
            {
                "version": ibpembed.__version__,
                "device": device,
                "cpu_path": ibpembed.cpu_path(),
                "pattern_lookup": pattern_lookup(),
                "torch": torch.__version__,
            }
        )

    def loading_progress(self, done: int, total: int) -> None:
        """``done`` of ``total`` tables loaded (the load's thread)."""
        self._progress = done / total if total else 1.0

    def attach(self, store: TableStore, *, device: str) -> None:
        """The tables are loaded: their gauges from now on, and the device chosen for them."""
        self._loading, self._progress = 0.0, 1.0
        self._set_device(device)
        self._tables = _TableCollector(store)
        self.registry.register(self._tables)
        self.registry.register(_VersionCollector(store))

    # -- observer hooks ----------------------------------------------------------------------
    def kernels_done(self, pooling: str, calls: Sequence[KernelCall]) -> None:
        """The kernel calls of one request (engine worker thread), one per table it read."""
        assert self._tables is not None  # no lookup runs before the store is attached
        self._tables.sync()
        self._kernel.add(pooling, calls, self._tables.row_bytes)

    def queue_waited(self, seconds: float) -> None:
        """A request's wait for a kernel thread (engine worker thread)."""
        self._queue.observe((), seconds)

    def wire_timed(self, phase: str, seconds: float) -> None:
        """A request's decode (event loop) or encode (worker thread, or the event loop for a
        request run inline) in the servicer."""
        self._wire.observe((phase,), seconds)

    def watch_hot_tier(self, tier: HotTier) -> None:
        """Export the hot tier's policy (the engine's, once it runs)."""
        self.registry.register(_HotTierCollector(tier))

    def watch_hbm_tier(self, tier: HbmTier) -> None:
        """Export the HBM tier (the engine's, on a GPU)."""
        self.registry.register(_HbmTierCollector(tier))

    def output_written(self, transport: str, nbytes: int) -> None:
        """One request's output, in its response or its output region (worker thread or event
        loop)."""
        self._output.inc((transport,), float(nbytes))

    def reload_done(self, result: ReloadResult) -> None:
        """One reload attempt of the table set (event loop)."""
        self._reloads.inc((result,))
        self._reload_failing = int(result == "error")

    def rpc_done(self, method: str, code: grpc.StatusCode) -> None:
        """One finished ``ibpembed.v1`` RPC (event loop).

        A LookupStream that ends OK is not counted here: its requests were, one by one.
        """
        if method == STREAM_METHOD and code == grpc.StatusCode.OK:
            return
        self._requests.inc((_short(method), code.name))

    def lookup_started(self, method: str, request: Any) -> tuple[str, str]:
        """A Lookup call or LookupStream request reached the servicer (event loop)."""
        self._inflight += 1
        return _short(method), _pooling(request)

    def lookup_done(self, token: object, seconds: float, response: Any = None) -> None:
        """Its answer (event loop); a LookupStream request's is counted by its code here."""
        # The RPC observer hands back, unread, what lookup_started returned.
        labels = cast(tuple[str, str], token)
        self._inflight -= 1
        self._latency.observe(labels, seconds)
        if response is not None:
            # Answers are serialized bytes; a failed request's is an Error message.
            failed = not isinstance(response, bytes) and response.HasField("error")
            code = _CODE_NAMES.get(response.error.code, "UNKNOWN") if failed else "OK"
            self._requests.inc((labels[0], code))

    def lookups_abandoned(self, count: int) -> None:
        """Requests of a failed or cancelled LookupStream left unanswered (event loop)."""
        self._inflight -= count

    # -- exposition ----------------------------------------------------------------------------
    def start_http_server(
        self, host: str, port: int, *, ready: Callable[[], bool] = lambda: True
    ) -> int:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` (``ready()``) over HTTP on
        ``host:port`` (0 = a free port), to GET and to HEAD (the same headers, no body);
        returns the port.

        Raises
        ------
        OSError
            when the port cannot be bound.
        """
        exposition = prometheus_client.make_wsgi_app(self.registry)

        def get(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "/")
            if path == "/metrics":
                return exposition(environ, start_response)
            status, body = _probe_answer(path, ready)
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [body]

        def app(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
            if environ.get("REQUEST_METHOD") != "HEAD":
                return get(environ, start_response)
            # prometheus_client answers HEAD with 405, and wsgiref would send a body with it:
            # answer as GET does, with the body's length and without the body (`curl -I`,
            # uptime checks).
            answered: list[tuple[str, list[tuple[str, str]]]] = []
            body = b"".join(
                get({**environ, "REQUEST_METHOD": "GET"}, lambda *a: answered.append(a[:2]))
            )
            status, headers = answered[0]
            if not any(name.lower() == "content-length" for name, _ in headers):
                headers = [*headers, ("Content-Length", str(len(body)))]
            start_response(status, headers)
            return []

        # ``[::]`` is how the gRPC side spells "all IPv6 addresses"; sockets want it bare.
        address = host.strip("[]")
        server_class = type(
            "_Server", (_ThreadingWSGIServer,), {"address_family": _family(address)}
        )
        try:
            self._http = make_server(address, port, app, server_class, handler_class=_QuietHandler)
        except OSError as exc:
            # Say which port (the OS's words do not tell it from the gRPC one), worded as the
            # gRPC port's error is.
            raise OSError(
                f"cannot listen on {host}:{port} (metrics): {bind_error_text(exc)}"
            ) from exc
        threading.Thread(
            target=self._http.serve_forever, name="ibpembed-metrics-http", daemon=True
        ).start()
        return self._http.server_address[1]

    def stop_http_server(self) -> None:
        """Stop serving ``/metrics`` (no-op when not started)."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
