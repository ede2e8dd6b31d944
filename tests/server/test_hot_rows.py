# SPDX-License-Identifier: Apache-2.0
"""The engine's hot-row policy: which rows get decoded copies, and that results never change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ibpembed.codec import compress
from ibpembed.engine import FeatureQuery, LookupEngine
from ibpembed.engine import tier as hot_rows
from ibpembed.engine.tier import HotRowTracker, directory_bytes, hot_row_ids, rank_hot_rows
from ibpembed.server.config import ServerConfig
from ibpembed.server.metrics import ServerMetrics
from ibpembed.tables.store import TableStore
from tests.codec.tables import same_bits
from tests.server.helpers import RecordingObserver

ROWS, DIM = 4096, 32


def _table(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(ROWS, DIM, generator=gen) * 0.05
    values[7] = torch.randn(DIM, generator=gen) * 1e30  # stored raw: no mask fits it
    return values


def _zipf_ids(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(1.3, n) - 1, ROWS - 1).astype(np.int64)


def test_hot_row_ids_take_the_most_frequent_compressed_rows_within_budget() -> None:
    c = compress(_table())
    assert not bool(c.is_compressed(torch.tensor([7])))
    recent = torch.tensor([5] * 9 + [7] * 8 + [3] * 7 + [11] * 3 + [2] * 2 + [9] + [ROWS + 5])
    room_for_two = (directory_bytes(c) + 2 * (c.row_bytes + 8)) / c.raw_bytes
    assert hot_row_ids(c, recent, room_for_two).tolist() == [3, 5]  # 7 is raw
    assert rank_hot_rows(c, recent, room_for_two)[1] == pytest.approx(16 / recent.numel())
    assert hot_row_ids(c, recent, 1.0).tolist() == [2, 3, 5, 9, 11]  # ROWS + 5 is no row
    assert hot_row_ids(c, recent, directory_bytes(c) / c.raw_bytes / 2).numel() == 0


def test_tracker_window_keeps_the_latest_ids() -> None:
    store = TableStore.from_tables({"t": compress(_table())})
    tracker = HotRowTracker(store, budget=0.05, window_ids=1000)
    window = None
    for i, n in enumerate([300, 500, 0, 150, 70, 2500, 30, 650]):
        tracker.record([("t", np.arange(n, dtype=np.int64) + 10_000 * i, ROWS)])
        window = tracker._windows["t"]
    assert window is not None and window.ids.size == 1000  # the buffer never grows
    expected = torch.cat([torch.arange(320, 2500) + 50_000, torch.arange(30) + 60_000,
                          torch.arange(650) + 70_000])[-1000:]  # fmt: skip
    assert torch.equal(window.recent().sort().values, expected.sort().values)
    default = HotRowTracker(store, budget=0.05)
    default.record([("small", np.arange(5), 10)])  # a small table's window is small
    assert default._windows["small"].ids.size == hot_rows.MIN_WINDOW_IDS


def test_window_restarts_when_a_reload_resizes_the_table() -> None:
    store = TableStore.from_tables({"t": compress(_table())})
    tracker = HotRowTracker(store, budget=0.05)
    tracker.record([("t", np.arange(100, dtype=np.int64), ROWS)])
    tracker.record([("t", np.arange(50, dtype=np.int64), ROWS)])
    assert tracker._windows["t"].filled == 150
    # Reloaded, twice as big.
    tracker.record([("t", np.arange(30, dtype=np.int64) + ROWS, 2 * ROWS)])
    window = tracker._windows["t"]
    assert window.ids.size == hot_rows.WINDOW_IDS_PER_ROW * 2 * ROWS
    assert torch.equal(window.recent(), torch.arange(30) + ROWS)  # the old rows' ids are gone
    capped = HotRowTracker(store, budget=0.05, window_ids=1000)  # both sizes hit the cap
    capped.record([("t", np.arange(100, dtype=np.int64), ROWS)])
    capped.record([("t", np.arange(7, dtype=np.int64), ROWS + 1)])
    assert capped._windows["t"].filled == 7


def test_refresh_after_a_reload_skips_windows_of_a_resized_table() -> None:
    store = TableStore.from_tables({"t": compress(_table()), "u": compress(_table(1))})
    tracker = HotRowTracker(store, budget=0.05)
    tracker.record([("t", _zipf_ids(5000, 0), ROWS)])
    tracker.record([("u", _zipf_ids(5000, 1), ROWS)])
    store.put_table("t", compress(_table(2)[: ROWS // 2]))  # a reload that shrank it
    store.put_table("u", compress(_table(3)))  # same size: its traffic still ranks it
    assert set(tracker.refresh(["t", "u"])) == {"u"}
    with store.acquire() as snap:
        assert snap.tables["t"].hot is None and snap.tables["u"].hot is not None


def test_a_failing_table_does_not_stop_the_others_and_is_retried(monkeypatch) -> None:
    store = TableStore.from_tables({"a": compress(_table(1)), "b": compress(_table(2))})
    tracker = HotRowTracker(store, budget=0.05)
    for name in ("a", "b"):
        tracker.record([(name, _zipf_ids(5_000, 3), ROWS)])
    publish = store.set_hot_rows

    def fail_for_a(name: str, ids: torch.Tensor, *, coverage: float) -> int:
        if name == "a":
            raise MemoryError("no room for the copies")
        return publish(name, ids, coverage=coverage)

    monkeypatch.setattr(store, "set_hot_rows", fail_for_a)
    assert set(tracker.refresh()) == {"b"}
    monkeypatch.setattr(store, "set_hot_rows", publish)
    assert set(tracker.refresh()) == {"a"}  # retried without new traffic
    with store.acquire() as snap:
        assert all(snap.tables[name].hot is not None for name in ("a", "b"))


def test_a_lookup_of_a_dropped_table_during_a_refresh_does_not_wedge_it(monkeypatch) -> None:
    store = TableStore.from_tables({"a": compress(_table(1))})
    tracker = HotRowTracker(store, budget=0.05)
    acquire = store.acquire

    def acquire_while_an_old_lookup_records_b():  # a lookup of a snapshot that still had "b"
        tracker.record([("b", _zipf_ids(5_000, 4), ROWS)])
        return acquire()

    tracker.record([("a", _zipf_ids(5_000, 3), ROWS)])
    monkeypatch.setattr(store, "acquire", acquire_while_an_old_lookup_records_b)
    assert "a" in tracker.refresh()
    monkeypatch.setattr(store, "acquire", acquire)
    assert "b" not in tracker._windows and "b" not in tracker._fresh
    tracker.record([("a", _zipf_ids(5_000, 5), ROWS)])
    tracker.refresh()  # raised KeyError('b') at every refresh before the fix


def test_refresh_publishes_copies_without_changing_rows_or_version() -> None:
    values = _table()
    store = TableStore.from_tables({"t": compress(values)})
    tracker = HotRowTracker(store, budget=0.05)
    ids = torch.from_numpy(_zipf_ids(20_000, 1))
    tracker.record([("t", ids.numpy(), ROWS)])
    version = store.version
    cached = tracker.refresh()
    assert 0 < cached["t"] <= 0.05 * values.numel() * 4 / (DIM * 4 + 8)
    assert store.version == version  # same rows, same version
    with store.acquire() as snap:
        table = snap.tables["t"]
    assert table.hot is not None and store.accounting()["t"].hot == table.hot_bytes > 0
    assert same_bits(table.gather(ids), values[ids])
    offsets = torch.arange(0, ids.numel() + 1, 20)
    assert same_bits(table.lookup(ids, offsets), compress(values).lookup(ids, offsets))
    assert tracker.refresh() == {}  # no lookups since: nothing to rank
    tracker.record([("t", ids[:10].numpy(), ROWS)])
    assert tracker.refresh() == {}  # the same hot set: nothing to republish
    with store.acquire() as snap:
        assert snap.tables["t"] is table


def test_update_rows_reaches_cached_rows_and_spares_the_old_version() -> None:
    values = _table()
    store = TableStore.from_tables({"t": compress(values)})
    store.set_hot_rows("t", torch.tensor([1, 2, 3, 100, 4000]))
    with store.acquire() as before:
        new_rows = torch.randn(3, DIM) * 0.05
        store.update_rows("t", torch.tensor([100, 2, 50]), new_rows)
        old = before.tables["t"]
    with store.acquire() as snap:
        table = snap.tables["t"]
    expected = values.clone()
    expected[torch.tensor([100, 2, 50])] = new_rows
    every = torch.arange(ROWS)
    assert same_bits(table.gather(every), expected)
    assert same_bits(old.gather(every), values)
    assert table.hot is not None and table.hot.ids.tolist() == [1, 2, 3, 100, 4000]


def test_row_updates_keep_their_spare_area_across_hot_row_refreshes() -> None:
    """Publishing copies keeps the payload: the next update appends to its spare area instead
    of copying the whole payload into a new buffer."""
    values = _table()
    store = TableStore.from_tables({"t": compress(values)})
    store.update_rows("t", torch.tensor([100]), torch.full((1, DIM), 0.5))
    buffer = store._spill["t"].buffer
    store.set_hot_rows("t", torch.arange(0, 100))
    store.update_rows("t", torch.tensor([200]), torch.full((1, DIM), 0.25))
    assert store._spill["t"].buffer is buffer
    expected = values.clone()
    expected[100], expected[200] = 0.5, 0.25
    with store.acquire() as snap:
        assert same_bits(snap.tables["t"].gather(torch.arange(ROWS)), expected)


def test_engine_records_traffic_and_serves_the_same_results() -> None:
    values = _table()
    engine = LookupEngine(
        TableStore.from_tables({"t": compress(values)}), max_workers=1, hot_row_budget=0.05
    )
    try:
        assert engine.hot_rows is not None
        ids = _zipf_ids(5000, 2)
        lengths = np.full(250, 20, np.int32)
        before = engine.run([FeatureQuery("t", ids, lengths)], "sum").features[0].values
        rows_before = engine.run([FeatureQuery("t", ids, lengths)], "none").features[0].values
        assert engine.hot_rows.refresh()["t"] > 0
        after = engine.run([FeatureQuery("t", ids, lengths)], "sum").features[0].values
        rows_after = engine.run([FeatureQuery("t", ids, lengths)], "none").features[0].values
    finally:
        engine.close()
    # Rows are the same bits; sums may take the other pooling path now (docs/codec.md), so they
    # agree within fp32 rounding.
    assert same_bits(rows_before, rows_after)
    assert same_bits(rows_after, values[torch.from_numpy(ids)])
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


def test_hot_rows_off_and_bad_settings() -> None:
    store = TableStore.from_tables({"t": compress(_table())})
    engine = LookupEngine(store, max_workers=1)
    assert engine.hot_rows is None
    engine.close()
    with pytest.raises(ValueError, match="hot_row_budget"):
        LookupEngine(store, hot_row_budget=-0.1)
    with pytest.raises(ValueError, match="hot-row budget"):
        HotRowTracker(store, budget=1.5)
    with pytest.raises(ValueError, match="hot_row_budget"):
        ServerConfig(hot_row_budget=2.0).validate()
    with pytest.raises(ValueError, match="hot_row_refresh_s"):
        ServerConfig(hot_row_refresh_s=0).validate()


@pytest.mark.parametrize(("coverage", "fused"), [(0.9, True), (0.2, False)])
def test_copies_that_cover_most_lookups_send_pooling_to_the_fused_kernel(coverage, fused) -> None:
    """Decode-once pays for its sort only when copies leave much decoding to the fused kernel."""
    values = _table()
    store = TableStore.from_tables({"t": compress(values)})
    store.set_hot_rows("t", torch.arange(0, 64), coverage=coverage)
    recorder = RecordingObserver()
    engine = LookupEngine(store, max_workers=1, observer=recorder, dedupe_min_ids=64)
    ids = np.repeat(np.arange(0, 200, dtype=np.int64), 4)  # 800 ids, 200 distinct
    try:
        pooled = engine.run([FeatureQuery("t", ids, np.full(80, 10, np.int32))], "sum")
    finally:
        engine.close()
    (_, _, nnz, decoded) = recorder.kernels[0]
    assert nnz == 800 and decoded == (800 if fused else 200)
    expected = values[torch.from_numpy(ids)].view(80, 10, DIM).sum(1)
    torch.testing.assert_close(pooled.features[0].values, expected, rtol=1e-5, atol=1e-6)


def test_reload_keeps_copies_of_unchanged_tables_and_put_table_drops_them(tmp_path) -> None:
    values = _table()
    TableStore.from_tables({"t": compress(values), "u": compress(_table(1))}).save(tmp_path)
    store = TableStore.load(tmp_path)
    store.set_hot_rows("t", torch.arange(0, 300))
    store.reload()  # same files: the table objects, copies included, are kept
    with store.acquire() as snap:
        assert snap.tables["t"].hot is not None
        assert same_bits(snap.tables["t"].gather(torch.arange(ROWS)), values)
    replacement = _table(2)
    store.put_table("t", compress(replacement))  # new rows: no copies of the old ones
    with store.acquire() as snap:
        assert snap.tables["t"].hot is None
        assert same_bits(snap.tables["t"].gather(torch.arange(ROWS)), replacement)


def test_hits_and_misses_count_ids_against_the_copies_that_served_them() -> None:
    store = TableStore.from_tables({"t": compress(_table())})
    tracker = HotRowTracker(store, budget=0.05, window_ids=1000)
    tracker.record([("t", np.array([5, 5, 5, 9, 9, 3], np.int64), ROWS)])
    tracker.refresh()  # no copies served those ids yet: all misses; copies of 5, 9, 3 now
    assert (tracker.hits["t"], tracker.misses["t"]) == (0, 6)
    with store.acquire() as snap:
        hot = set(snap.tables["t"].hot.ids.tolist())
    assert {5, 9, 3} <= hot
    cold = next(i for i in range(ROWS) if i not in hot and i != 7)
    tracker.record([("t", np.array([5, 9, cold, cold], np.int64), ROWS)])
    tracker.refresh()  # counted once each: the window's older ids are not counted again
    assert (tracker.hits["t"], tracker.misses["t"]) == (2, 8)
    tracker.refresh()  # no lookup since: nothing new
    assert (tracker.hits["t"], tracker.misses["t"]) == (2, 8)


def test_hot_row_counters_and_queue_wait_are_exported() -> None:
    store = TableStore.from_tables({"t": compress(_table())})
    metrics = ServerMetrics(store, device="cpu")
    engine = LookupEngine(store, max_workers=1, hot_row_budget=0.05, observer=metrics)
    assert engine.hot_rows is not None
    metrics.watch_hot_rows(engine.hot_rows)
    query = [FeatureQuery("t", np.array([1, 2, 1], np.int64), np.array([3], np.int32))]
    for _ in range(3):
        engine.submit(query, "sum").result(timeout=60)
    engine.hot_rows.refresh()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.registry.collect()
        for s in family.samples
    }
    assert samples[("ibpembed_queue_wait_seconds_count", ())] == 3
    assert samples[("ibpembed_hot_row_misses_total", (("table", "t"),))] == 9
    assert samples[("ibpembed_hot_row_hits_total", (("table", "t"),))] == 0
    engine.close()
