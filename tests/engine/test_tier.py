# SPDX-License-Identifier: Apache-2.0
"""The hot tier's policy: which rows are kept decoded, how the tier is published, and that
results never change."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ibpembed.codec import CompressedTable, compress
from ibpembed.engine import FeatureQuery, LookupEngine
from ibpembed.engine import tier as hot_tier
from ibpembed.engine.tier import HotTier, hot_row_ids, policy_state_bytes, rank_hot_rows
from ibpembed.tables.store import TableStore
from ibpembed.tables.tier_budget import TableSize, capacity_rows, tier_cost
from tests.codec.tables import same_bits
from tests.engine.helpers import RecordingObserver
from tests.tables.helpers import with_a_raw_row

ROWS, DIM = 4096, 32


def _zipf_ids(n: int, seed: int, alpha: float = 1.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(alpha, n) - 1, ROWS - 1).astype(np.int64)


def _current(store: TableStore, name: str = "t") -> CompressedTable:
    with store.acquire() as snap:
        return snap.tables[name]


def _tier_ids(store: TableStore, name: str = "t") -> list[int]:
    with store.acquire() as snap:
        hot = snap.tables[name].hot
    return [] if hot is None else hot.ids.tolist()


def test_offline_ranking_takes_the_most_frequent_compressed_rows_within_budget() -> None:
    c = compress(with_a_raw_row(ROWS, DIM))
    assert not bool(c.is_compressed(torch.tensor([7])))
    recent = torch.tensor([5] * 9 + [7] * 8 + [3] * 7 + [11] * 3 + [2] * 2 + [9] + [ROWS + 5])
    room_for_two = tier_cost(ROWS, c.row_bytes, 2) / c.raw_bytes
    assert hot_row_ids(c, recent, room_for_two).tolist() == [3, 5]  # 7 is raw
    assert rank_hot_rows(c, recent, room_for_two)[1] == pytest.approx(16 / recent.numel())
    assert hot_row_ids(c, recent, 1.0).tolist() == [2, 3, 5, 9, 11]  # ROWS + 5 is no row
    assert hot_row_ids(c, recent, tier_cost(ROWS, c.row_bytes, 1) / c.raw_bytes / 2).numel() == 0


def test_the_tier_admits_the_hot_rows_and_publishes_them_without_a_new_version() -> None:
    values = with_a_raw_row(ROWS, DIM)
    store = TableStore.from_tables({"t": compress(values)})
    tier = HotTier(store, budget="5%")
    budget = int(0.05 * ROWS * DIM * 4)  # the rows and the policy's state for them
    capacity = capacity_rows(ROWS, DIM * 4, budget, policy_state_bytes)
    assert 0 < capacity < capacity_rows(ROWS, DIM * 4, budget)
    assert 0 < tier.plan()["t"].total_bytes <= budget
    ids = _zipf_ids(20_000, 1)
    tier.record([("t", ids, ROWS)])
    version = store.version
    assert tier.refresh()["t"] > 0
    assert store.version == version  # same rows, same version
    stats = tier.stats()["t"]
    assert stats.capacity == capacity and stats.rows == capacity
    assert stats.admissions == capacity and stats.evictions == 0
    # The most frequent rows are all in (a Zipf head is far above the sketch's error).
    distinct, counts = np.unique(ids, return_counts=True)
    head = distinct[np.argsort(-counts, kind="stable")[: capacity // 4]]
    held = set(_tier_ids(store))
    assert {int(i) for i in head if i != 7} <= held
    with store.acquire() as snap:
        table = snap.tables["t"]
    every = torch.arange(ROWS)
    assert same_bits(table.gather(every), values)
    offsets = torch.arange(0, ids.size + 1, 20)
    ids_t = torch.from_numpy(ids)
    assert same_bits(table.lookup(ids_t, offsets), compress(values).lookup(ids_t, offsets))
    assert tier.refresh() == {}  # no lookups since: nothing changed, nothing published
    with store.acquire() as snap:
        assert snap.tables["t"] is table
    store.put_table("t", compress(values))  # replaced in process: without its tier
    assert _tier_ids(store) == []
    assert tier.publish() == {"t": len(held)}  # the policy puts it back
    assert set(_tier_ids(store)) == held


def test_a_new_hot_set_displaces_the_coldest_residents() -> None:
    store = TableStore.from_tables({"t": compress(with_a_raw_row(ROWS, DIM))})
    tier = HotTier(store, budget="5%")
    capacity = tier.capacity(_current(store), 1.0)
    old_hot = np.arange(1000, 1000 + capacity, dtype=np.int64)
    new_hot = np.arange(2000, 2000 + capacity, dtype=np.int64)
    tier.record([("t", np.repeat(old_hot, 3), ROWS)])
    tier.refresh()
    assert _tier_ids(store) == old_hot.tolist()
    for _ in range(4):  # the traffic moved: the new rows get more frequent than the old
        tier.record([("t", np.repeat(new_hot, 4), ROWS)])
        tier.step()
    tier.publish()
    assert _tier_ids(store) == new_hot.tolist()
    stats = tier.stats()["t"]
    assert stats.admissions == 2 * capacity and stats.evictions == capacity
    # One-off rows do not displace residents seen more often.
    tier.record([("t", np.arange(3000, 3000 + capacity, dtype=np.int64), ROWS)])
    tier.refresh()
    assert _tier_ids(store) == new_hot.tolist()


def test_hits_and_the_hit_ratio_count_ids_against_the_published_tier() -> None:
    store = TableStore.from_tables({"t": compress(with_a_raw_row(ROWS, DIM))})
    tier = HotTier(store, budget="5%", window_ids=1000)
    tier.record([("t", np.array([5, 5, 5, 9, 9, 3], np.int64), ROWS)])
    tier.refresh()  # no tier served those ids yet: all misses; 5, 9, 3 are in it now
    stats = tier.stats()["t"]
    assert (stats.hits, stats.misses, stats.hit_ratio) == (0, 6, 0.0)
    assert {5, 9, 3} <= set(_tier_ids(store))
    cold = 4000
    tier.record([("t", np.array([5, 9, cold, cold], np.int64), ROWS)])
    tier.step()  # counted once each: ids are taken from the buffer
    stats = tier.stats()["t"]
    assert (stats.hits, stats.misses, stats.hit_ratio) == (2, 8, 0.5)
    tier.step()  # no lookup since: nothing new, the ratio of the last interval stays
    assert tier.stats()["t"] == stats


def test_the_buffer_keeps_the_latest_ids_and_restarts_on_a_resize() -> None:
    store = TableStore.from_tables({"t": compress(with_a_raw_row(ROWS, DIM))})
    tier = HotTier(store, budget="5%", window_ids=1000)
    for i, n in enumerate([300, 500, 0, 150, 70, 2500, 30, 650]):
        tier.record([("t", np.arange(n, dtype=np.int64) + 10_000 * i, ROWS)])
    pending = tier._tables["t"].pending
    assert pending.ids.size == 1000  # the buffer never grows
    expected = np.concatenate([np.arange(320, 2500) + 50_000, np.arange(30) + 60_000,
                               np.arange(650) + 70_000])[-1000:]  # fmt: skip
    assert np.array_equal(pending.take(), expected)
    default = HotTier(store, budget="5%")  # a small tier's buffer is small
    assert default._tables["t"].pending.ids.size == hot_tier.MIN_WINDOW_IDS
    tier.record([("t", np.arange(30, dtype=np.int64), ROWS)])
    # A reload that resized the table: its ids are not recorded until a step sizes its state.
    tier.record([("t", np.arange(30, dtype=np.int64) + ROWS, 2 * ROWS)])
    assert np.array_equal(tier._tables["t"].pending.take(), np.arange(30))


def test_a_resized_or_dropped_table_starts_anew() -> None:
    store = TableStore.from_tables(
        {"t": compress(with_a_raw_row(ROWS, DIM)), "u": compress(with_a_raw_row(ROWS, DIM, seed=1))}
    )
    tier = HotTier(store, budget="5%")
    tier.record([("t", _zipf_ids(5000, 0), ROWS), ("u", _zipf_ids(5000, 1), ROWS)])
    tier.step()
    # t as a reload that shrank it; u the same size: what the policy learnt still holds.
    store.put_table("t", compress(with_a_raw_row(ROWS, DIM, seed=2)[: ROWS // 2]))
    store.put_table("u", compress(with_a_raw_row(ROWS, DIM, seed=3)))
    published = tier.refresh(["t", "u"])
    assert published["t"] == 0 and published["u"] > 0
    assert _tier_ids(store, "t") == [] and _tier_ids(store, "u") != []
    assert tier.stats()["t"].admissions == 0  # what it learnt of the old rows is gone
    tier.record([("gone", np.arange(5, dtype=np.int64), 10)])  # an older snapshot's table
    tier.step()
    assert "gone" not in tier.stats()


def test_a_failing_table_does_not_stop_the_others_and_is_retried(monkeypatch) -> None:
    store = TableStore.from_tables(
        {
            "a": compress(with_a_raw_row(ROWS, DIM, seed=1)),
            "b": compress(with_a_raw_row(ROWS, DIM, seed=2)),
        }
    )
    tier = HotTier(store, budget="5%")
    for name in ("a", "b"):
        tier.record([(name, _zipf_ids(5_000, 3), ROWS)])
    publish = store.set_hot_rows

    def fail_for_a(name: str, ids: torch.Tensor, *, coverage: float) -> int:
        if name == "a":
            raise MemoryError("no room for the tier")
        return publish(name, ids, coverage=coverage)

    monkeypatch.setattr(store, "set_hot_rows", fail_for_a)
    assert set(tier.refresh()) == {"b"}
    monkeypatch.setattr(store, "set_hot_rows", publish)
    assert set(tier.refresh()) == {"a"}  # retried without new traffic
    assert _tier_ids(store, "a") and _tier_ids(store, "b")


def test_an_all_budget_decodes_every_row_without_traffic() -> None:
    values = with_a_raw_row(ROWS, DIM)
    store = TableStore.from_tables({"t": compress(values)})
    tier = HotTier(store, budget="all")
    tier.refresh()
    compressed = [i for i in range(ROWS) if i != 7]  # the overlay leaves raw rows as they are
    assert set(compressed) <= set(_tier_ids(store))
    assert tier.stats()["t"].capacity == ROWS
    assert tier.refresh() == {}  # nothing to re-decide
    with store.acquire() as snap:
        assert same_bits(snap.tables["t"].gather(torch.arange(ROWS)), values)
    # A budget past the whole table is the same as all.
    assert HotTier(store, budget="400%").plan() == tier.plan()


def test_the_engine_records_traffic_and_serves_the_same_results() -> None:
    values = with_a_raw_row(ROWS, DIM)
    engine = LookupEngine(
        TableStore.from_tables({"t": compress(values)}),
        max_workers=1,
        hot_tier="5%",
        hot_tier_refresh_s=3600,
    )
    try:
        assert engine.tier is not None
        ids = _zipf_ids(5000, 2)
        lengths = np.full(250, 20, np.int32)
        before = engine.run([FeatureQuery("t", ids, lengths)], "sum").features[0].values
        rows_before = engine.run([FeatureQuery("t", ids, lengths)], "none").features[0].values
        assert engine.tier.refresh()["t"] > 0
        after = engine.run([FeatureQuery("t", ids, lengths)], "sum").features[0].values
        rows_after = engine.run([FeatureQuery("t", ids, lengths)], "none").features[0].values
    finally:
        engine.close()
    # Rows are the same bits; sums may take the other pooling path now (docs/codec.md), so they
    # agree within fp32 rounding.
    assert same_bits(rows_before, rows_after)
    assert same_bits(rows_after, values[torch.from_numpy(ids)])
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


def test_off_leaves_hand_made_tiers_alone_and_bad_budgets_fail() -> None:
    store = TableStore.from_tables({"t": compress(with_a_raw_row(ROWS, DIM))})
    store.set_hot_rows("t", torch.arange(10, 20))  # in process: a tier chosen offline
    engine = LookupEngine(store, max_workers=1, hot_tier="off")
    assert engine.tier is None
    query = [FeatureQuery("t", np.arange(100, dtype=np.int64), np.array([100], np.int32))]
    engine.run(query, "sum")
    engine.close()
    assert _tier_ids(store) == list(range(10, 20))
    for bad in ("-5%", "-1", "lots", "5%%", "", "1e3", 0.05):
        with pytest.raises(ValueError, match="hot tier budget"):
            LookupEngine(store, hot_tier=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="other than off"):
        HotTier(store, budget="0")
    with pytest.raises(ValueError, match="refresh_s"):
        HotTier(store, budget="1%", refresh_s=0)
    for never in ({"refresh_s": math.inf}, {"step_s": math.inf}, {"step_s": math.nan}):
        with pytest.raises(ValueError, match="finite"):  # the policy thread would die waiting
            HotTier(store, budget="1%", **never)
    with pytest.raises(ValueError, match="finite"):
        LookupEngine(store, hot_tier="1%", hot_tier_refresh_s=math.inf)
    with pytest.raises(TypeError, match="window_ids must be an integer"):
        HotTier(store, budget="1%", window_ids=1.9)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be integers"):
        hot_tier.HitRatioGate(0.1, 0.2, steps=2.5)  # type: ignore[arg-type]
    table = _current(store)
    with pytest.raises(TypeError, match="share of the raw bytes"):
        rank_hot_rows(table, torch.arange(10), "5%")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite share"):
        rank_hot_rows(table, torch.arange(10), math.nan)


@pytest.mark.parametrize(("coverage", "fused"), [(0.9, True), (0.2, False)])
def test_tiers_that_cover_most_lookups_send_pooling_to_the_fused_kernel(coverage, fused) -> None:
    """Decode-once pays for its sort only when the tier leaves much decoding to the kernel."""
    values = with_a_raw_row(ROWS, DIM)
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


def test_table_size_reads_the_table() -> None:
    c = compress(with_a_raw_row(ROWS, DIM))
    size = TableSize.of(c)
    assert (size.num_rows, size.raw_bytes, size.stored_bytes) == (ROWS, c.raw_bytes, c.stored_bytes)


def test_a_savings_tier_keeps_an_updated_table_within_its_raw_bytes() -> None:
    """A row update leaves spare room in the payload's spill buffer: resident, so priced."""
    rows, dim = 20_000, 64
    gen = torch.Generator().manual_seed(0)
    store = TableStore.from_tables({"t": compress(torch.randn(rows, dim, generator=gen) * 0.05)})
    store.update_rows("t", torch.tensor([100]), torch.randn(1, dim, generator=gen) * 0.05)
    updated = _current(store)
    assert updated.resident_bytes > updated.stored_bytes
    assert TableSize.of(updated).stored_bytes == updated.resident_bytes
    tier = HotTier(store, budget="savings", gate=None)
    rng = np.random.default_rng(0)
    for _ in range(3):
        tier.record([("t", np.minimum(rng.zipf(1.2, 100_000) - 1, rows - 1), rows)])
        tier.refresh()
    held = store.accounting()["t"]
    assert held.hot > 0
    assert held.total + tier.stats()["t"].policy_bytes <= held.raw


def test_a_step_prices_tables_without_holding_the_lock_lookups_record_under(monkeypatch) -> None:
    store = TableStore.from_tables(
        {"t": compress(with_a_raw_row(ROWS, DIM)), "u": compress(with_a_raw_row(ROWS, DIM, 2))}
    )
    tier = HotTier(store, budget="5%", gate=None)
    held_while_pricing = []
    capacity = tier.capacity

    def priced(table: CompressedTable, share: float) -> int:
        held_while_pricing.append(tier._lock.locked())
        return capacity(table, share)

    monkeypatch.setattr(tier, "capacity", priced)
    tier.record([("t", _zipf_ids(5000, seed=0), ROWS), ("u", _zipf_ids(5000, seed=1), ROWS)])
    tier.refresh()
    assert held_while_pricing and not any(held_while_pricing)
    assert _tier_ids(store, "t") and _tier_ids(store, "u")
