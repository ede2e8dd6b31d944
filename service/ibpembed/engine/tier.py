# SPDX-License-Identifier: Apache-2.0
"""Which rows the engine keeps decoded: the hot-row policy.

Recommendation traffic is skewed (Zipf-like): a small set of rows serves most lookups. Decoding
is what makes compressed CPU lookups slower than raw ones, and most of it goes to those same
rows, again and again. So the engine keeps decoded copies of them
(``CompressedTable.with_hot_rows``, read by the CPU kernels like raw rows). :class:`HotRowTracker`
keeps the ids of each table's most recent lookups (a bounded window) and, from a background
thread, periodically publishes copies of the most frequent of them within a byte budget
(``TableStore.set_hot_rows``). Lookups return the same rows either way: the policy only moves
time and memory.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Collection, Iterable

import numpy as np
import torch

from ibpembed.codec import CompressedTable
from ibpembed.tables.store import TableStore

log = logging.getLogger(__name__)

# Host memory a table's copies may take, as a fraction of its raw bytes (the server's default).
DEFAULT_BUDGET = 0.01
# Ids of recent lookups remembered per table (8 bytes each): enough to rank the hot set of a Zipf
# table, cheap to count (torch.unique on 256k ids: ~15 ms) for every table at every refresh.
DEFAULT_WINDOW_IDS = 1 << 18
# A smaller table gets a window of this many ids per row (at least MIN_WINDOW_IDS): its hot set is
# ranked as well from fewer lookups.
WINDOW_IDS_PER_ROW = 8
MIN_WINDOW_IDS = 4096
# Seconds from start to the first refresh: a fresh server should not serve its first
# ``refresh_s`` without copies.
FIRST_REFRESH_S = 5.0


def directory_bytes(table: CompressedTable) -> int:
    """Fixed cost of a table's hot-row overlay: two 8-byte words per 64 rows."""
    return 16 * -(-table.num_rows // 64)


def hot_row_ids(table: CompressedTable, recent_ids: torch.Tensor, budget: float) -> torch.Tensor:
    """The rows worth copying (see :func:`rank_hot_rows`), sorted."""
    return rank_hot_rows(table, recent_ids, budget)[0]


def rank_hot_rows(
    table: CompressedTable, recent_ids: torch.Tensor, budget: float
) -> tuple[torch.Tensor, float]:
    """The rows worth copying and the share of ``recent_ids`` they cover (``HotRows.coverage``):
    the most frequent compressed rows of ``recent_ids`` (raw rows need no decoding) that fit in
    ``budget`` x the table's raw bytes, the overlay's directory included. Sorted; empty when
    nothing qualifies or the budget does not cover the directory.

    Rows seen once qualify too, after every more frequent one: on Zipf traffic (alpha 1.05,
    8.4M rows, 200k recent ids; a development measurement) they raise the share of later
    lookups that hit a copy from 67 % to 72 %, and the budget bounds what they cost."""
    per_row = table.row_bytes + 8  # the copy and its id
    room = int(budget * table.raw_bytes) - directory_bytes(table)
    capacity = max(room, 0) // per_row
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

    def __init__(self, capacity: int, num_rows: int) -> None:
        self.num_rows = num_rows  # of the table version the ids were recorded against
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.next = 0  # where the next id goes
        self.filled = 0
        self.unseen = 0  # ids added since the last take_unseen (at most capacity)

    def add(self, ids: np.ndarray) -> None:
        capacity = self.ids.size
        ids = ids[-capacity:]
        n = ids.size
        head = min(n, capacity - self.next)
        self.ids[self.next : self.next + head] = ids[:head]
        self.ids[: n - head] = ids[head:]
        self.next = (self.next + n) % capacity
        self.filled = min(capacity, self.filled + n)
        self.unseen = min(capacity, self.unseen + n)

    def take_unseen(self) -> np.ndarray:
        """A copy of the ids added since the last call (the latest ``capacity`` of them)."""
        n, self.unseen = self.unseen, 0
        start = self.next - n
        if start >= 0:
            return self.ids[start : self.next].copy()
        return np.concatenate([self.ids[start:], self.ids[: self.next]])

    def recent(self) -> torch.Tensor:
        """A copy of the ids held (order does not matter to the ranking)."""
        return torch.from_numpy(self.ids[: self.filled].copy())


class HotRowTracker:
    """Per-table windows of recent lookup ids, turned into hot-row copies now and then.

    Parameters
    ----------
    store : the tables; copies are published into it.
    budget : host memory a table's copies may take, as a fraction of its raw bytes (0.01 = 1 %
        of the uncompressed table). Must be in (0, 1].
    refresh_s : seconds between refreshes of the background thread (:meth:`start`).
    window_ids : recent ids remembered per table at most (8 bytes each, allocated at the
        table's first lookup); smaller tables remember 8 per row, at least MIN_WINDOW_IDS.
    """

    def __init__(
        self,
        store: TableStore,
        *,
        budget: float,
        refresh_s: float = 30.0,
        window_ids: int = DEFAULT_WINDOW_IDS,
    ) -> None:
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"hot-row budget must be in (0, 1], got {budget}")
        if refresh_s <= 0:
            raise ValueError(f"hot-row refresh interval must be > 0 s, got {refresh_s}")
        if window_ids < 1:
            raise ValueError(f"window_ids must be >= 1, got {window_ids}")
        self.store = store
        self.budget = budget
        self.refresh_s = refresh_s
        self.window_ids = window_ids
        self._lock = threading.Lock()  # guards the windows; held for a copy at most
        self._windows: dict[str, _IdRing] = {}
        self._fresh: set[str] = set()  # tables with ids recorded since their last refresh
        # Per table: looked-up ids the tracker saw that its decoded copies held, and did not
        # (counted at each refresh, against the copies that served them). Refresh thread only.
        self.hits: collections.Counter[str] = collections.Counter()
        self.misses: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self, lookups: Iterable[tuple[str, np.ndarray, int]]) -> None:
        """Remember one request's ids: (table, int64 rows of it, the table's ``num_rows``) per
        table it read; repeats count. One call per request: the lock is taken once."""
        with self._lock:
            for table, ids, num_rows in lookups:
                window = self._windows.get(table)
                # A reload that resized the table restarts its window: the old ids name other
                # rows.
                if window is None or window.num_rows != num_rows:
                    size = min(self.window_ids, max(MIN_WINDOW_IDS, WINDOW_IDS_PER_ROW * num_rows))
                    window = self._windows[table] = _IdRing(size, num_rows)
                window.add(ids)
                self._fresh.add(table)

    def refresh(self, tables: Collection[str] | None = None) -> dict[str, int]:
        """Publish fresh copies for every table looked up since its last refresh, where the hot
        set changed. Returns the rows now cached per table republished.

        ``tables``: refresh these instead, looked up lately or not (a reload replaced them and
        their copies with them; their windows still hold the traffic's recent ids).
        """
        with self._lock:
            names = set(self._fresh) if tables is None else set(tables)
            windows = {n: self._windows[n] for n in names if n in self._windows}
            recent = {n: (w.recent(), w.num_rows) for n, w in windows.items()}
            unseen = {n: w.take_unseen() for n, w in windows.items()}
            self._fresh -= names
        with self.store.acquire() as snapshot:
            current = dict(snapshot.tables)
        with self._lock:  # windows of tables a reload dropped (a lookup of an older snapshot may
            for gone in set(self._windows) - set(current):  # have recorded one meanwhile)
                del self._windows[gone]
                self._fresh.discard(gone)
        cached: dict[str, int] = {}
        for name, (ids, num_rows) in recent.items():
            table = current.get(name)
            # Dropped by a reload, or resized: the window's ids name rows of the old table.
            if table is None or table.num_rows != num_rows:
                continue
            self._count(name, table, unseen[name])
            try:
                chosen, coverage = rank_hot_rows(table, ids, self.budget)
                held = table.hot.ids if table.hot is not None else chosen.new_empty(0)
                if torch.equal(held, chosen):
                    continue
                cached[name] = self.store.set_hot_rows(name, chosen, coverage=coverage)
            except (KeyError, IndexError):  # replaced or reshaped since the snapshot was read
                continue
            except Exception:  # e.g. out of memory for the copies: the others still refresh
                log.exception("hot-row refresh of table %r failed; keeping its copies", name)
                with self._lock:  # retried at the next refresh, traffic or not
                    self._fresh.add(name)
        return cached

    def _count(self, name: str, table: CompressedTable, ids: np.ndarray) -> None:
        """Hits and misses of the copies ``table`` holds (those that served ``ids``)."""
        held = 0
        if table.hot is not None and ids.size:
            held = int(np.isin(ids, table.hot.ids.numpy(), assume_unique=False).sum())
        self.hits[name] += held
        self.misses[name] += ids.size - held

    # -- background refreshes ------------------------------------------------------------------
    def start(self) -> None:
        """Refresh from a daemon thread: first after FIRST_REFRESH_S, then every refresh_s."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="ibpembed-hot-rows", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait = min(FIRST_REFRESH_S, self.refresh_s)
        while not self._stop.wait(wait):
            wait = self.refresh_s
            try:
                cached = self.refresh()
            except Exception:  # a failed refresh keeps the previous copies; lookups go on
                log.exception("hot-row refresh failed; keeping the previous copies")
                continue
            if cached:
                log.debug("hot rows refreshed: %s", cached)

    def close(self) -> None:
        """Stop the background thread (copies already published stay)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
