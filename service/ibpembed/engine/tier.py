# SPDX-License-Identifier: Apache-2.0
"""Which rows the CPU keeps decoded: the hot tier's admission policy.

Recommendation traffic is skewed (Zipf-like): a small set of rows serves most lookups, and
decoding them again and again is what makes compressed CPU lookups slower than raw ones. So
each table keeps a tier of decoded rows (``CompressedTable.with_hot_rows``), read like raw rows,
within the budget of ``--hot-tier`` (:mod:`ibpembed.tables.tier_budget`). Lookups return the same
rows either way: the policy only moves time and memory.

:class:`HotTier` follows the traffic online, as TinyLFU does:

- **Recording** (the request path): each request's checked ids are copied into a bounded
  per-table buffer; nothing else. Under more traffic than a buffer holds between steps, the
  latest ids stand for the rest (a sample).
- **Steps** (a background thread, every ``step_s``): each table's buffered ids are counted
  against the tier that is published (hits, misses, the hit ratio of the interval), then into
  a count-min sketch with periodic halving (:mod:`ibpembed.engine.sketch`), and the tier's
  target set is re-decided: a row seen lately enters when its estimated frequency beats the
  coldest resident's (residents win ties, so equal rows do not churn), which leaves.
- **Publication** (every ``refresh_s``, first after FIRST_REFRESH_S; at once for ``all``): a
  table whose target set changed gets a new version of its tier, built aside from the store's
  current version (``TableStore.set_hot_rows``: the directory words where rows enter or leave
  rewritten, :mod:`ibpembed.tables.tier_versions`) and published with one snapshot swap.
  Lookups never wait for it; a lookup holding an older snapshot reads that snapshot's tier.

- **The gate** (:class:`HitRatioGate`, the host tier's; the HBM tier has none): a partial tier
  pays only where it serves enough lookups, since every lookup of a table with a tier pays a
  pre-pass that resolves its ids to tier rows. Each step also counts the *would-be* hits, the
  step's ids found in the target set chosen before them (out of sample: what a tier published
  then would have served). Over the last ``steps`` steps with lookups (and at least
  ``min_ids`` ids) a table whose would-be hit ratio falls below ``close_below`` gets no tier
  published (so its lookups skip the pre-pass); the policy keeps ranking its rows, and a ratio
  back at ``open_at`` publishes its tier again. A change is published at that step, not at the
  next refresh, and logged once.

Consistency: a tier is built from the table version it is published into, a row update carries
the updated rows' new bits into the next version's tier (``TableStore.update_rows``), a reload
publishes its tables without a tier (the reloader asks for a new one at once), and pinned older
versions keep the tier they were published with. So no lookup reads a stale tier row.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ibpembed.codec import CompressedTable
from ibpembed.engine.sketch import DEPTH, FrequencySketch
from ibpembed.tables.store import TableStore
from ibpembed.tables.tier_budget import TableSize, TierBudget, TierPlan, capacity_rows

log = logging.getLogger(__name__)

# A share of raw bytes for offline ranking (torchrec's cache_hot_rows, the benchmarks).
DEFAULT_BUDGET = 0.01
# Ids buffered per table between steps at most (8 bytes each): a second of a busy table's traffic.
DEFAULT_WINDOW_IDS = 1 << 18
# A smaller tier buffers this many ids per tier row, at least MIN_WINDOW_IDS. NOTE(tier): the
# buffer is a sample under heavy traffic (the latest ids stand for the rest); the sketch's
# ranking depends on the increments per halving window, not on how fast they arrive, so a
# smaller sample only stretches that window over more steps. Sized by the table instead (8 ids
# a row), a 1M-row D = 16 fp32 table's 2 MiB buffer cost three times its 1 % tier.
WINDOW_IDS_PER_TIER_ROW = 4
MIN_WINDOW_IDS = 1024
# Seconds between steps of the admission policy (and updates of the hit ratio).
STEP_S = 1.0
# Seconds from start to the first publication: a fresh server should not serve its first
# ``refresh_s`` without a tier.
FIRST_REFRESH_S = 5.0
# Sketch counters per tier row, and sketch increments between halvings per tier row.
# NOTE(tier): TinyLFU's window of ten times the cache is too short to rank a tier's last rows:
# under Zipf traffic a row at the tier's edge is seen about once per window, below the sketch's
# noise. The policy fed 1,024-2,048 batches (B = 512, ~10k ids each) of Zipf ids over 4M rows,
# hit ratio on the next 8 (10x -> 30x -> 100x; exact top-k of the same history): Zipf 1.05 1 %
# tier 74.5 -> 76.9 -> 77.6 % (78.1), 10 % 86.7 -> 88.6 -> 88.8 % (88.9); Zipf 0.8 5 % 47.9 ->
# 49.9 % (51.5); Zipf 1.2 5 % 94.4 -> 95.3 % (95.5). The price is a slower turnover when the hot
# set moves: after a switch to a fresh hot set, 30x matches 10x's steady hit ratio after ~1.3M
# ids (10x: ~0.6M), 100x after ~2.6M. 30x keeps most of the gain at half 100x's lag.
SKETCH_WIDTH_PER_ROW = 4
SKETCH_SAMPLE_PER_ROW = 30


@dataclass(frozen=True)
class HitRatioGate:
    """When a table's tier is worth publishing, from its would-be hit ratio (the module
    docstring, *The gate*).

    Attributes
    ----------
    close_below : a ratio below this over the window withdraws the table's tier.
    open_at : a ratio at or above this over the window publishes it again (>= close_below; the
        band between them keeps a table whose ratio hovers there from rebuilding its tier at
        every refresh).
    steps : steps with lookups in the window.
    min_ids : ids the window must hold before it decides (under lighter traffic the ratio is
        noise, and the tier's cost no matter): until then the tier keeps its state.
    """

    close_below: float
    open_at: float
    steps: int = 3
    min_ids: int = 1000

    def __post_init__(self) -> None:
        if not 0 <= self.close_below <= self.open_at <= 1:
            raise ValueError(
                "a gate needs 0 <= close_below <= open_at <= 1, got "
                f"{self.close_below}, {self.open_at}"
            )
        if not _is_int(self.steps) or not _is_int(self.min_ids):
            raise TypeError(f"a gate's steps and min_ids must be integers, got {self}")
        if self.steps < 1 or self.min_ids < 0:
            raise ValueError(f"a gate needs steps >= 1, min_ids >= 0, got {self}")


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


# The host tier's gate. NOTE(tier): where a tier starts to pay, from the hot-tier benchmark
# (BENCHMARKS.md, *Hot tier*: 2 GiB DLRM-profile tables, one thread), interpolating each tier's
# speed against no tier linearly in the hit ratio between its uniform and its Zipf 0.8 column.
# The break-even moves with the host's state: fp32 rows broke even at 16 % hits for a 1 % tier
# (0.93x at 1.0 %, 1.08x at 32.8 %) and 14-15 % for 5 % and 10 % tiers, bf16 rows at 21-28 %;
# other runs put the uniform columns at 0.96-1.01x and the break-even at 4-9 %. Smaller tables
# break even sooner: on a 256 MiB fp32 one the policy's 1 % tier ran 0.93-0.96x no tier at 0.9 %
# hits (uniform), 1.00-1.02x at 11.8 % (Zipf 0.6), 1.05-1.08x at 20.6 % (Zipf 0.7). So the gate
# closes below 15 % (a uniform tier of up to ~14 % of the rows, the 1 % default and ``savings``
# included, which cost up to 16 % in the slower runs) and opens at 30 %, where the tier paid in
# every case measured; between the two a tier keeps its state.
HOT_TIER_GATE = HitRatioGate(close_below=0.15, open_at=0.30)


def hot_row_ids(table: CompressedTable, recent_ids: torch.Tensor, budget: float) -> torch.Tensor:
    """The rows worth decoding offline (see :func:`rank_hot_rows`), sorted."""
    return rank_hot_rows(table, recent_ids, budget)[0]


def rank_hot_rows(
    table: CompressedTable, recent_ids: torch.Tensor, budget: float
) -> tuple[torch.Tensor, float]:
    """The exact top of a traffic sample: the most frequent compressed rows of ``recent_ids``
    (raw rows need no decoding) that fit in ``budget`` x the table's raw bytes, and the share of
    ``recent_ids`` they cover. Sorted; empty when nothing qualifies or the budget does not cover
    the tier's fixed cost. For teams that know their traffic offline (and the benchmarks' ideal
    against which :class:`HotTier` is measured)."""
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(f"budget must be a share of the raw bytes (0.05 for 5 %), got {budget!r}")
    if not (math.isfinite(budget) and budget >= 0):
        raise ValueError(f"budget must be a finite share >= 0 of the raw bytes, got {budget}")
    capacity = capacity_rows(table.num_rows, table.row_bytes, int(budget * table.raw_bytes))
    return top_hot_rows(table, recent_ids, capacity)


def top_hot_rows(
    table: CompressedTable, recent_ids: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, float]:
    """:func:`rank_hot_rows` for a tier of at most ``capacity`` rows."""
    in_range = recent_ids[(recent_ids >= 0) & (recent_ids < table.num_rows)]
    ids, counts = torch.unique(in_range, return_counts=True)
    keep = table.is_compressed(ids)
    ids, counts = ids[keep], counts[keep]
    if ids.numel() > capacity:
        top = torch.topk(counts, capacity, sorted=False).indices
        ids, counts = ids[top], counts[top]
    coverage = int(counts.sum()) / recent_ids.numel() if recent_ids.numel() else 0.0
    return ids.sort().values, coverage


class _IdRing:
    """The last ``capacity`` ids recorded for one table, in one buffer allocated (and touched)
    up front: a server's memory reaches its steady state with the first lookups instead of
    growing, and no request's arrays are kept alive. numpy, not torch: recording runs once per
    table of every request, and a torch op's dispatch costs more than the copy itself."""

    def __init__(self, capacity: int) -> None:
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.next = 0  # where the next id goes
        self.unseen = 0  # ids added since the last take (at most capacity)

    def add(self, ids: np.ndarray) -> None:
        capacity, start, n = self.ids.size, self.next, ids.size
        self.unseen = min(capacity, self.unseen + n)
        if n < capacity - start:  # the common case (one copy): a request's ids fit before the end
            self.ids[start : start + n] = ids
            self.next = start + n
            return
        ids = ids[-capacity:]
        n = ids.size
        head = min(n, capacity - start)
        self.ids[start : start + head] = ids[:head]
        self.ids[: n - head] = ids[head:]
        self.next = (start + n) % capacity

    def resized(self, capacity: int) -> _IdRing:
        """A buffer of ``capacity`` ids holding the latest of this one's unseen ids."""
        ring = _IdRing(capacity)
        ring.add(self.take())
        return ring

    def take(self) -> np.ndarray:
        """A copy of the ids added since the last call (the latest ``capacity`` of them)."""
        n, self.unseen = self.unseen, 0
        start = self.next - n
        if start >= 0:
            return self.ids[start : self.next].copy()
        return np.concatenate([self.ids[start:], self.ids[: self.next]])


@dataclass(frozen=True)
class TierStats:
    """One table's tier as the policy sees it (for /metrics).

    Attributes
    ----------
    rows : rows the policy wants in the tier (published at the next refresh).
    capacity : rows the budget buys (``num_rows`` when it buys them all).
    hits, misses : recorded ids found / not found in the published tier, since start.
    admissions, evictions : rows that entered / left the target set, since start.
    hit_ratio : hits per recorded id over the last step that saw lookups.
    on : whether the policy publishes the table's tier (its gate is open).
    reason : why: ``measuring`` (on: the window has not decided yet), ``skewed`` (on: the
        would-be hit ratio reached the gate's ``open_at``, or stays above its ``close_below``),
        ``flat`` (off: it fell below ``close_below``), ``ungated`` (on: a policy without a gate).
    would_be_hit_ratio : share of the gate's window's ids that the target set chosen before them
        held (0 until the window decides).
    policy_bytes : host memory of the policy's own state for the table (its buffer of recorded
        ids, its sketch, its target set), on top of the tier's rows.
    """

    rows: int
    capacity: int
    hits: int
    misses: int
    admissions: int
    evictions: int
    hit_ratio: float
    on: bool
    reason: str
    would_be_hit_ratio: float
    policy_bytes: int = 0


def _ring_ids(rows: int, window_ids: int) -> int:
    """Ids the buffer of a table whose tier takes ``rows`` rows holds between steps."""
    return min(window_ids, max(MIN_WINDOW_IDS, WINDOW_IDS_PER_TIER_ROW * rows))


def policy_state_bytes(num_rows: int, rows: int, window_ids: int = DEFAULT_WINDOW_IDS) -> int:
    """Host bytes the policy holds at most for a table of ``num_rows`` rows whose tier takes
    ``rows``: its id buffer, its sketch (only to rank a partial tier) and two target sets (the
    one published and the next). What :class:`HotTier` pays from the budget
    (:data:`ibpembed.tables.tier_budget.StateBytes`)."""
    if rows == 0:  # no state: the policy records no ids for a table its budget buys no row of
        return 0
    ring = 8 * _ring_ids(rows, window_ids)
    ranked = rows < num_rows
    sketch = DEPTH * FrequencySketch.width_for(SKETCH_WIDTH_PER_ROW * rows) if ranked else 0
    return ring + sketch + 2 * 8 * rows


class _TableTier:
    """The admission state of one table (of one shape: a reload that resizes it starts anew)."""

    def __init__(
        self, num_rows: int, capacity: int, window_ids: int, gate: HitRatioGate | None
    ) -> None:
        self.num_rows = num_rows
        self.pending = _IdRing(_ring_ids(capacity, window_ids))  # guarded by HotTier._lock
        # The rest: the policy's thread (HotTier._work) only.
        self.capacity = 0  # as of the last admission
        self.sketch: FrequencySketch | None = None
        self.residents = np.empty(0, np.int64)  # sorted: the target set
        self.published: np.ndarray | None = None  # the residents last published
        self.cached = 0  # rows the last publication put in the tier
        self.coverage = 0.0  # share of the last step's ids the residents hold
        self.hits = self.misses = self.admissions = self.evictions = 0
        self.hit_ratio = 0.0
        self.gate = gate
        # (would-be hits, ids) of the last gate.steps steps that measured
        self.window: deque[tuple[int, int]] = deque(maxlen=gate.steps if gate else 1)
        self.would_be_hit_ratio = 0.0
        self.on = True  # whether the tier is to be published
        self.reason = "measuring" if gate else "ungated"
        self.published_on = True  # ``on`` as last published
        self.moved = False  # the gate opened or closed since the last publication's attempt

    @property
    def nbytes(self) -> int:
        """Host bytes of this state: the id buffer, the sketch and the target sets."""
        published = self.published
        sketch = self.sketch.nbytes if self.sketch is not None else 0
        # A published set that is the target set itself is counted once.
        extra = 0 if published is None or published is self.residents else published.nbytes
        sets = self.residents.nbytes + extra
        return self.pending.ids.nbytes + sketch + sets

    def measure(self, ids: np.ndarray) -> bool:
        """Count ``ids`` against the target set chosen before them (call before :meth:`admit`)
        and re-decide the gate; True when it opened or closed."""
        gate = self.gate
        if gate is None or ids.size == 0 or self.residents.size == 0:
            return False  # no gate, no lookups, or no target set yet to measure against
        self.window.append((int(_member(ids, self.residents).sum()), ids.size))
        seen = sum(n for _, n in self.window)
        if len(self.window) < gate.steps or seen < gate.min_ids:
            return False
        ratio = sum(h for h, _ in self.window) / seen
        self.would_be_hit_ratio = ratio
        on = ratio >= (gate.close_below if self.on else gate.open_at)
        self.reason = "skewed" if on else "flat"
        changed, self.on = on != self.on, on
        self.moved |= changed
        return changed

    def count(self, ids: np.ndarray, tier_rows: np.ndarray | None) -> None:
        """Hits and misses of the published tier (its sorted rows, or None)."""
        held = 0
        if tier_rows is not None and ids.size:
            held = int(_member(ids, tier_rows).sum())
        self.hits += held
        self.misses += ids.size - held
        if ids.size:
            self.hit_ratio = held / ids.size

    def admit(self, ids: np.ndarray) -> None:
        """Update the sketch with ``ids`` and re-decide the target set within ``capacity``."""
        capacity, residents = self.capacity, self.residents
        if capacity >= self.num_rows:  # every row: nothing to rank
            self.coverage = 1.0
            if residents.size == self.num_rows:
                return
            chosen = np.arange(self.num_rows, dtype=np.int64)
        elif capacity == 0:
            chosen = residents[:0]
        else:
            chosen = self._rank(ids, capacity)
        kept = int(_member(chosen, residents).sum()) if residents.size else 0
        self.admissions += chosen.size - kept
        self.evictions += residents.size - kept
        if kept != chosen.size or kept != residents.size:  # else unchanged: nothing to publish
            self.residents = chosen
        if ids.size:
            self.coverage = float(_member(ids, chosen).mean())

    def _rank(self, ids: np.ndarray, capacity: int) -> np.ndarray:
        # The sketch follows the tier (SKETCH_WIDTH_PER_ROW counters and SKETCH_SAMPLE_PER_ROW
        # increments per halving a tier row): a capacity that grows must not rank its new rows
        # with a sketch sized for fewer, and one that shrinks must not keep more memory than the
        # budget pays for. Capacities move only with a reload or a byte budget's split.
        sample = SKETCH_SAMPLE_PER_ROW * capacity
        width = FrequencySketch.width_for(SKETCH_WIDTH_PER_ROW * capacity)
        if self.sketch is None or self.sketch.width != width:
            self.sketch = FrequencySketch(width, sample)
        self.sketch.sample = sample
        residents = self.residents
        seen, counts = np.unique(ids, return_counts=True)
        self.sketch.add(seen, counts)
        candidates = seen[~_member(seen, residents)] if residents.size else seen
        pool = np.concatenate([residents, candidates])
        if pool.size <= capacity:
            return np.sort(pool)
        # Residents win ties: an estimate of e ranks as 2e + 1 for a resident, 2e for a newcomer.
        key = np.concatenate(
            [
                self.sketch.estimate(residents).astype(np.int64) * 2 + 1,
                self.sketch.estimate(candidates).astype(np.int64) * 2,
            ]
        )
        top = np.argpartition(key, pool.size - capacity)[pool.size - capacity :]
        return np.sort(pool[top])


def _member(ids: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Bool: whether each of ``ids`` is in ``sorted_set`` (sorted, distinct)."""
    if sorted_set.size == 0:
        return np.zeros(ids.size, dtype=bool)
    at = np.searchsorted(sorted_set, ids).clip(max=sorted_set.size - 1)
    return sorted_set[at] == ids


class AdmissionPolicy(ABC):
    """Per-table online admission into a tier of hot rows (see the module docstring): what the
    host's decoded tier (:class:`HotTier`) and the GPU's HBM tier
    (:class:`ibpembed.engine.hbm_tier.HbmTier`) share. A tier says what its budget buys
    (:meth:`capacity`), which rows it serves with now (:meth:`held`), whether a table lost its
    tier (:meth:`lost`) and how a target set is published (:meth:`install`).

    Parameters
    ----------
    store : the tables; tiers are published for its current version.
    budget : the tier's budget (:class:`~ibpembed.tables.tier_budget.TierBudget` or its
        spelling); must not be ``off``.
    refresh_s : seconds between publications of changed tiers.
    step_s : seconds between steps of the admission policy.
    window_ids : ids buffered per table between steps at most (8 bytes each, allocated at the
        table's first lookup); smaller tables buffer 8 per row, at least MIN_WINDOW_IDS.
    thread_name : the background thread's name.
    gate : when a table's tier is published (:class:`HitRatioGate`); None: always.
    """

    def __init__(
        self,
        store: TableStore,
        *,
        budget: TierBudget | str,
        refresh_s: float = 30.0,
        step_s: float = STEP_S,
        window_ids: int = DEFAULT_WINDOW_IDS,
        thread_name: str = "ibpembed-hot-tier",
        gate: HitRatioGate | None = None,
    ) -> None:
        self.budget = TierBudget.parse(budget)
        if not self.budget.enabled:
            raise ValueError("a hot tier needs a budget other than off")
        # Finite: the policy thread waits min(step_s, time to the next refresh).
        if not (0 < refresh_s < math.inf and 0 < step_s < math.inf):
            raise ValueError(
                f"refresh_s and step_s must be finite and > 0, got {refresh_s}, {step_s}"
            )
        if not _is_int(window_ids):
            raise TypeError(f"window_ids must be an integer, got {window_ids!r}")
        if window_ids < 1:
            raise ValueError(f"window_ids must be >= 1, got {window_ids}")
        self.store = store
        self.refresh_s = refresh_s
        self.step_s = step_s
        self.window_ids = int(window_ids)
        self.thread_name = thread_name
        self.gate = gate
        self._lock = threading.Lock()  # guards _tables and the buffers; one buffer copy per hold
        self._work = threading.Lock()  # one step or publication at a time
        # A state for each table whose budget buys rows, made by the steps (the first here).
        self._tables: dict[str, _TableTier] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        with self.store.acquire() as snapshot:
            current = dict(snapshot.tables)
        capacities = self._capacities(current)
        with self._lock:
            self._size_states(current, capacities)

    # -- what a tier decides -------------------------------------------------------------------
    @abstractmethod
    def capacity(self, table: CompressedTable, share: float) -> int:
        """Rows the budget buys ``table``; ``share``: its part of the set's raw bytes."""

    @abstractmethod
    def held(self, name: str, table: CompressedTable) -> np.ndarray | None:
        """The sorted rows of the tier ``table`` serves with now, or None."""

    @abstractmethod
    def lost(self, name: str, table: CompressedTable) -> bool:
        """Whether ``table`` came without the tier published for it (replaced since)."""

    @abstractmethod
    def install(self, name: str, table: CompressedTable, rows: np.ndarray, coverage: float) -> int:
        """Publish a tier of ``rows`` (sorted) for ``table``; returns the rows it holds."""

    @abstractmethod
    def plan(self) -> dict[str, TierPlan]:
        """What the budget buys each table of the current version (rows, bytes)."""

    def record(self, lookups: Iterable[tuple[str, np.ndarray, int]]) -> None:
        """Buffer one request's ids: (table, int64 rows of it, the table's ``num_rows``) per
        table it read; repeats count. One call per request: the lock is taken once. Tables
        whose budget buys no row, and tables a reload added or resized until the next step
        sizes their state, record nothing."""
        with self._lock:
            for name, ids, num_rows in lookups:
                state = self._tables.get(name)
                if state is not None and state.num_rows == num_rows:
                    state.pending.add(ids)

    def _capacities(self, current: dict[str, CompressedTable]) -> dict[str, int]:
        """Each current table's capacity. Not under ``_lock``: pricing hundreds of tables
        takes milliseconds, and every lookup's :meth:`record` waits for that lock."""
        total_raw = sum(t.raw_bytes for t in current.values()) or 1
        return {
            name: self.capacity(table, table.raw_bytes / total_raw)
            for name, table in current.items()
        }

    def _size_states(self, current: dict[str, CompressedTable], capacities: dict[str, int]) -> None:
        """Under ``_lock``: a state (and its buffer) for each table that has rows to rank or a
        tier to withdraw, sized for its capacity, and none for the others, so the policy holds
        what :func:`policy_state_bytes` prices."""
        for gone in set(self._tables) - set(current):  # dropped by a reload
            del self._tables[gone]
        for name, table in current.items():
            capacity, state = capacities[name], self._tables.get(name)
            if state is not None and state.num_rows != table.num_rows:
                state = None  # resized by a reload: the buffered ids name rows of the old table
            if capacity == 0 and (state is None or state.cached == 0):
                # Nothing to rank and no tier to withdraw: the policy holds nothing for it.
                self._tables.pop(name, None)
            elif state is None:
                self._tables[name] = _TableTier(
                    table.num_rows, capacity, self.window_ids, self.gate
                )
            elif state.pending.ids.size != _ring_ids(capacity, self.window_ids):
                state.pending = state.pending.resized(_ring_ids(capacity, self.window_ids))

    def step(self) -> None:
        """Count the buffered ids of every table against its published tier, into its sketch,
        and re-decide its target set (tables without lookups keep theirs)."""
        with self._work:
            with self.store.acquire() as snapshot:
                current = dict(snapshot.tables)
            capacities = self._capacities(current)
            with self._lock:
                self._size_states(current, capacities)
                states = dict(self._tables)
            work = []
            for name, state in states.items():
                # One table's buffer copied per hold of the lock lookups record under.
                with self._lock:
                    ids = state.pending.take()
                work.append((name, state, current[name], ids))
            for name, state, table, ids in work:
                capacity = capacities[name]
                state.count(ids, self.held(name, table))
                if state.measure(ids) and self.gate is not None:
                    log.info(
                        "%s: table %r's tier %s: %.1f%% of its last %d ids were in the %d rows "
                        "it would hold (off below %.0f%%, on from %.0f%%)",
                        self.thread_name,
                        name,
                        "on" if state.on else "off",
                        100 * state.would_be_hit_ratio,
                        sum(n for _, n in state.window),
                        state.residents.size,
                        100 * self.gate.close_below,
                        100 * self.gate.open_at,
                    )
                if ids.size or capacity != state.capacity or capacity >= table.num_rows:
                    state.capacity = capacity
                    state.admit(ids)

    def publish(
        self, tables: Collection[str] | None = None, *, only: Collection[str] | None = None
    ) -> dict[str, int]:
        """Publish a new tier for every table whose target set changed, or whose gate opened or
        closed, since its last publication (a closed gate publishes none: the table's lookups
        then skip the tier's pre-pass); ``tables``: for these whatever changed (a reload
        replaced them, and their tiers with them); ``only``: consider these tables alone.
        Returns the tier rows per table published."""
        cached: dict[str, int] = {}
        with self._work:
            with self._lock:
                states = dict(self._tables)
            with self.store.acquire() as snapshot:
                current = dict(snapshot.tables)
            for name, state in states.items():
                if only is not None and name not in only:
                    continue
                table = current.get(name)
                if table is None or table.num_rows != state.num_rows:
                    continue
                forced = tables is not None and name in tables
                lost = state.cached > 0 and self.lost(name, table)
                # A closed gate publishes no tier, whatever the target set does meanwhile.
                changed = state.on != state.published_on or (
                    state.on and state.published is not state.residents
                )
                state.moved = False  # a failure is retried at the next refresh, not every step
                if not changed and not forced and not lost:
                    continue
                rows = state.residents if state.on else state.residents[:0]
                try:
                    cached[name] = self.install(name, table, rows, state.coverage)
                    state.published, state.cached = state.residents, cached[name]
                    state.published_on = state.on
                except (KeyError, IndexError):  # replaced or reshaped since the snapshot
                    continue
                except Exception:  # e.g. out of memory for the tier: the others still publish
                    log.exception("hot tier of table %r failed to build; keeping its tier", name)
        return cached

    def refresh(self, tables: Collection[str] | None = None) -> dict[str, int]:
        """A step, then a publication (see :meth:`publish`)."""
        self.step()
        return self.publish(tables)

    def stats(self) -> dict[str, TierStats]:
        """Every table's tier as the policy sees it."""
        with self._lock:
            states = dict(self._tables)
        return {
            name: TierStats(
                int(s.residents.size),
                s.capacity,
                s.hits,
                s.misses,
                s.admissions,
                s.evictions,
                s.hit_ratio,
                s.on,
                s.reason,
                s.would_be_hit_ratio,
                s.nbytes,
            )
            for name, s in states.items()
        }

    def _gate_moved(self) -> set[str]:
        """The tables whose gate opened or closed since their last publication's attempt."""
        with self._lock:
            states = dict(self._tables)
        return {name for name, s in states.items() if s.moved}

    # -- the background thread -----------------------------------------------------------------
    def start(self) -> None:
        """Step every ``step_s`` and publish every ``refresh_s`` from a daemon thread (the first
        publication after FIRST_REFRESH_S, or at once for an ``all`` budget)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        first = 0.0 if self.budget.kind == "all" else min(FIRST_REFRESH_S, self.refresh_s)
        due = time.monotonic() + first
        wait = min(self.step_s, first)
        while not self._stop.wait(wait):
            try:
                self.step()
                # A gate that moved publishes its table at once: a closed one stops the
                # pre-pass's cost, an opened one starts the savings. The other tables keep the
                # refresh's schedule: a tier is rebuilt at most every refresh_s.
                refresh = time.monotonic() >= due
                moved = set() if refresh else self._gate_moved()
                if refresh or moved:
                    if refresh:
                        due = time.monotonic() + self.refresh_s
                    published = self.publish(only=None if refresh else moved)
                    if published:
                        log.debug("%s published: %s", self.thread_name, published)
            except Exception:  # a failed step keeps the published tiers; lookups go on
                log.exception("hot tier step failed; keeping the published tiers")
            wait = max(0.0, min(self.step_s, due - time.monotonic()))

    def close(self) -> None:
        """Stop the background thread (published tiers stay)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class HotTier(AdmissionPolicy):
    """Online admission into the host's decoded hot tier (``--hot-tier``): tiers are published
    into the store's tables (``TableStore.set_hot_rows``), behind ``gate`` (HOT_TIER_GATE by
    default). See :class:`AdmissionPolicy`."""

    def __init__(
        self,
        store: TableStore,
        *,
        budget: TierBudget | str,
        refresh_s: float = 30.0,
        step_s: float = STEP_S,
        window_ids: int = DEFAULT_WINDOW_IDS,
        gate: HitRatioGate | None = HOT_TIER_GATE,
    ) -> None:
        super().__init__(
            store,
            budget=budget,
            refresh_s=refresh_s,
            step_s=step_s,
            window_ids=window_ids,
            gate=gate,
        )

    def capacity(self, table: CompressedTable, share: float) -> int:
        return self.budget.table_rows(TableSize.of(table), share, self._state_bytes)

    def _state_bytes(self, num_rows: int, rows: int) -> int:
        return policy_state_bytes(num_rows, rows, self.window_ids)

    def held(self, name: str, table: CompressedTable) -> np.ndarray | None:
        return None if table.hot is None else table.hot.ids.numpy()

    def lost(self, name: str, table: CompressedTable) -> bool:
        # A table replaced in process (put_table) comes without the tier it had.
        return table.hot is None

    def install(self, name: str, table: CompressedTable, rows: np.ndarray, coverage: float) -> int:
        return self.store.set_hot_rows(name, torch.from_numpy(rows), coverage=coverage)

    def plan(self) -> dict[str, TierPlan]:
        with self.store.acquire() as snapshot:
            sizes = {name: TableSize.of(t) for name, t in snapshot.tables.items()}
        return self.budget.plan(sizes, self._state_bytes)
