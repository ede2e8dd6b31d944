# SPDX-License-Identifier: Apache-2.0
"""The hot tier's gate: a table whose would-be hit ratio is too low to pay for the tier's
pre-pass gets no tier published, the policy keeps ranking its rows, and skewed traffic turns the
tier back on within a bounded number of steps; lookups return the table's rows bit for bit
across every switch."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from ibpembed.codec import CompressedTable, compress
from ibpembed.engine.hbm_tier import HbmTier
from ibpembed.engine.tier import HOT_TIER_GATE, HitRatioGate, HotTier
from ibpembed.tables.store import TableStore
from tests.codec.tables import same_bits

ROWS, DIM = 20_000, 32
STEP_IDS = 20_000
GATE = HOT_TIER_GATE


def _values(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, DIM, generator=gen) * 0.05


def _uniform(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, ROWS, STEP_IDS, dtype=np.int64)


# Zipf 1.05 over every row, the hot rows scattered over the table (a fixed permutation).
_RANKED = np.random.default_rng(99).permutation(ROWS)
_P = 1.0 / np.arange(1, ROWS + 1) ** 1.05
_P /= _P.sum()


def _zipf(rng: np.random.Generator) -> np.ndarray:
    return _RANKED[rng.choice(ROWS, STEP_IDS, p=_P)].astype(np.int64)


def _table(store: TableStore, name: str = "t") -> CompressedTable:
    with store.acquire() as snap:
        return snap.tables[name]


def _steps_until(tier: HotTier, on: bool, ids, rng: np.random.Generator, limit: int) -> int:
    """Steps of ``ids(rng)`` traffic until the gate reads ``on``; fails past ``limit``."""
    for step in range(1, limit + 1):
        tier.record([("t", ids(rng), ROWS)])
        tier.step()
        if tier.stats()["t"].on == on:
            return step
    pytest.fail(f"the gate did not turn {'on' if on else 'off'} within {limit} steps")


def _assert_serves(store: TableStore, values: torch.Tensor, rng: np.random.Generator) -> None:
    """Every row, a pooled lookup and a gather equal ``values`` bit for bit."""
    table = _table(store)
    assert same_bits(table.gather(torch.arange(ROWS)), values)
    ids = torch.from_numpy(_zipf(rng)[:4000])
    offsets = torch.arange(0, ids.numel() + 1, 20)
    expected = compress(values).lookup(ids, offsets)
    assert same_bits(table.lookup(ids, offsets), expected)


def test_uniform_ids_keep_the_tier_off_and_log_it_once(caplog) -> None:
    store = TableStore.from_tables({"t": compress(_values())})
    tier = HotTier(store, budget="1%")
    rng = np.random.default_rng(0)
    with caplog.at_level(logging.INFO, logger="ibpembed.engine.tier"):
        steps = _steps_until(tier, False, _uniform, rng, GATE.steps + 1)
        tier.publish()
        for _ in range(5):  # more of the same: no new decision, no new line
            tier.record([("t", _uniform(rng), ROWS)])
            tier.refresh()
    assert steps == GATE.steps + 1  # the first step has no target set to measure against
    stats = tier.stats()["t"]
    assert (stats.on, stats.reason) == (False, "flat")
    assert 0 < stats.would_be_hit_ratio < GATE.close_below
    assert stats.rows == stats.capacity > 0  # the policy still ranks the rows it would hold
    assert _table(store).hot is None  # so lookups skip the pre-pass
    lines = [r.getMessage() for r in caplog.records if "tier off" in r.getMessage()]
    assert len(lines) == 1 and "'t'" in lines[0], lines


def test_zipf_ids_keep_the_tier_on() -> None:
    store = TableStore.from_tables({"t": compress(_values())})
    tier = HotTier(store, budget="1%")
    rng = np.random.default_rng(1)
    for _ in range(GATE.steps + 2):
        tier.record([("t", _zipf(rng), ROWS)])
        tier.step()
    assert tier.publish()["t"] > 0
    stats = tier.stats()["t"]
    assert (stats.on, stats.reason) == (True, "skewed")
    assert stats.would_be_hit_ratio >= GATE.open_at
    hot = _table(store).hot
    assert hot is not None and hot.count == stats.rows


def test_a_switch_between_uniform_and_zipf_ids_moves_the_tier_and_never_serves_stale_rows() -> None:
    values = _values()
    store = TableStore.from_tables({"t": compress(values)})
    tier = HotTier(store, budget="1%")
    rng = np.random.default_rng(2)
    _steps_until(tier, False, _uniform, rng, GATE.steps + 1)
    tier.publish()
    assert _table(store).hot is None
    # Rows change while the tier is off: the hot ones among them.
    changed = torch.from_numpy(_RANKED[:50].copy())
    values[changed] = torch.randn(50, DIM) * 0.05
    store.update_rows("t", changed, values[changed])
    _assert_serves(store, values, rng)

    # Skewed traffic turns it on within the window's steps and one more.
    assert _steps_until(tier, True, _zipf, rng, GATE.steps + 1) <= GATE.steps + 1
    assert tier.stats()["t"].reason == "skewed"
    tier.publish()
    hot = _table(store).hot
    assert hot is not None and set(changed.tolist()) & set(hot.ids.tolist())
    _assert_serves(store, values, rng)  # the tier holds the updated rows
    changed = hot.ids[:20]  # rows in the tier change too
    values[changed] = torch.randn(20, DIM) * 0.05
    store.update_rows("t", changed, values[changed])
    _assert_serves(store, values, rng)

    # And uniform traffic turns it off again.
    _steps_until(tier, False, _uniform, rng, GATE.steps + 1)
    tier.publish()
    assert _table(store).hot is None
    _assert_serves(store, values, rng)


def test_the_background_thread_publishes_a_gate_change_without_waiting_for_the_refresh() -> None:
    store = TableStore.from_tables({"t": compress(_values())})
    tier = HotTier(store, budget="1%", refresh_s=3600, step_s=0.02)
    rng = np.random.default_rng(3)
    for _ in range(GATE.steps + 1):
        tier.record([("t", _zipf(rng), ROWS)])
        tier.step()
    tier.publish()
    assert _table(store).hot is not None
    tier.start()
    try:
        for traffic, has_tier in ((_uniform, False), (_zipf, True)):
            give_up = time.monotonic() + 30
            while (_table(store).hot is not None) != has_tier:
                assert time.monotonic() < give_up, f"no publication of {traffic.__name__}"
                tier.record([("t", traffic(rng), ROWS)])
                time.sleep(0.02)
    finally:
        tier.close()


def test_a_gate_change_publishes_its_own_table_and_leaves_the_others_to_the_refresh() -> None:
    store = TableStore.from_tables({"t": compress(_values()), "u": compress(_values(1))})
    tier = HotTier(store, budget="1%", refresh_s=3600, step_s=0.02)
    rng = np.random.default_rng(4)
    for _ in range(GATE.steps + 1):
        tier.record([("t", _zipf(rng), ROWS), ("u", _zipf(rng), ROWS)])
        tier.step()
    tier.publish()
    u_tier = _table(store, "u").hot
    assert _table(store, "t").hot is not None and u_tier is not None
    admitted = tier.stats()["u"].admissions
    # u's traffic takes on rows outside its tier (its gate stays open: most ids still hit).
    outside = np.setdiff1d(np.arange(ROWS), u_tier.ids.numpy())[:50]
    tier.start()
    try:
        give_up = time.monotonic() + 30
        while _table(store, "t").hot is not None:
            assert time.monotonic() < give_up, "t's closed gate was not published"
            u_ids = np.concatenate([_zipf(rng), np.repeat(outside, 100)])
            tier.record([("t", _uniform(rng), ROWS), ("u", u_ids, ROWS)])
            time.sleep(0.02)
    finally:
        tier.close()
    assert tier.stats()["u"].admissions > admitted  # u's target set changed...
    assert _table(store, "u").hot is u_tier  # ...and waits for the refresh


def test_a_policy_without_a_gate_publishes_whatever_the_traffic() -> None:
    store = TableStore.from_tables({"t": compress(_values())})
    rng = np.random.default_rng(4)
    for tier in (HotTier(store, budget="1%", gate=None), HbmTier(store, budget="1%", device="cpu")):
        assert [(s.rows, s.hits + s.misses) for s in tier.stats().values()] == [(0, 0)]
        for _ in range(GATE.steps + 2):
            tier.record([("t", _uniform(rng), ROWS)])
            tier.step()
        stats = tier.stats()["t"]
        assert (stats.on, stats.reason, stats.would_be_hit_ratio) == (True, "ungated", 0.0)
    assert HotTier(store, budget="1%").gate == HOT_TIER_GATE


def test_light_traffic_leaves_the_gate_undecided() -> None:
    store = TableStore.from_tables({"t": compress(_values())})
    tier = HotTier(store, budget="1%")
    rng = np.random.default_rng(5)
    for _ in range(GATE.steps * 3):  # uniform, but fewer ids in the window than min_ids
        tier.record([("t", _uniform(rng)[: GATE.min_ids // (GATE.steps + 1)], ROWS)])
        tier.step()
    assert (tier.stats()["t"].on, tier.stats()["t"].reason) == (True, "measuring")


@pytest.mark.parametrize(
    "bad",
    [
        {"close_below": 0.3, "open_at": 0.2},
        {"close_below": -0.1, "open_at": 0.2},
        {"close_below": 0.2, "open_at": 1.5},
        {"close_below": 0.2, "open_at": 0.3, "steps": 0},
    ],
)
def test_a_gate_rejects_thresholds_out_of_order(bad) -> None:
    with pytest.raises(ValueError, match="a gate needs"):
        HitRatioGate(**bad)
