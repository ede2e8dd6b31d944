# SPDX-License-Identifier: Apache-2.0
"""The hot tier as an operator sees it: the real ``ibpembed serve --hot-tier``, its banner, and
its tier metrics scraped over HTTP; the gate's state (on or off and why) in the exposition; a
malformed budget stops the server at start."""

from __future__ import annotations

import re
import subprocess
import time

import numpy as np
import prometheus_client
import pytest
import torch

from ibpembed.codec import compress
from ibpembed.engine.sketch import DEPTH, FrequencySketch
from ibpembed.engine.tier import (
    DEFAULT_WINDOW_IDS,
    HOT_TIER_GATE,
    MIN_WINDOW_IDS,
    SKETCH_WIDTH_PER_ROW,
    WINDOW_IDS_PER_TIER_ROW,
    HotTier,
)
from ibpembed.server.metrics import ServerMetrics
from ibpembed.tables.store import TableStore
from ibpembed_client import LookupClient, RetryPolicy
from tests.metrics.helpers import fetch, free_port, parse, value
from tests.server.helpers import DEMO_300
from tools.serve_process import IBPEMBED, ServerProcess

WAIT_S = 90.0


def _series(samples: dict, name: str) -> dict[str, float]:
    """``{table: value}`` of one per-table metric."""
    return {dict(labels)["table"]: v for (n, labels), v in samples.items() if n == name}


def test_serve_exports_the_tier_and_prints_its_budget() -> None:
    port = free_port()
    flags = ("--metrics-port", str(port), "--hot-tier", "10%", "--hot-tier-refresh-s", "1")
    with ServerProcess(*DEMO_300, *flags) as server:
        banner = re.search(
            r"hot tier 10% of each table's raw bytes: up to ([\d,]+) bytes of decoded rows and "
            r"[\d,]+ of admission state, (-?[\d.]+)% saved net of both",
            server.log(),
        )
        assert banner is not None, server.log()
        planned = int(banner.group(1).replace(",", ""))
        client = LookupClient(server.target, timeout=30, retry=RetryPolicy(max_attempts=1))
        rng = np.random.default_rng(0)
        give_up = time.monotonic() + WAIT_S
        samples: dict = {}
        try:
            while time.monotonic() < give_up:
                ids = np.minimum(rng.zipf(1.3, 64) - 1, 299).tolist()
                client.lookup({"cat_0": [ids[:32], ids[32:]]})
                samples = parse(fetch(f"http://127.0.0.1:{port}/metrics"))
                held = value(samples, "ibpembed_table_hot_row_bytes", table="cat_0")
                if held > 0 and value(samples, "ibpembed_hot_row_hit_ratio", table="cat_0") > 0:
                    break
                time.sleep(0.2)
        finally:
            client.close()
    budgets = _series(samples, "ibpembed_table_hot_row_budget_bytes")
    assert sum(budgets.values()) == planned
    assert 0 < value(samples, "ibpembed_table_hot_row_bytes", table="cat_0") <= budgets["cat_0"]
    assert 0 < value(samples, "ibpembed_hot_row_hit_ratio", table="cat_0") <= 1
    assert value(samples, "ibpembed_hot_row_hits_total", table="cat_0") > 0
    assert value(samples, "ibpembed_hot_row_admissions_total", table="cat_0") > 0
    assert "cat_0" in _series(samples, "ibpembed_hot_row_evictions_total")
    # Tables nobody looked up have no tier and no traffic counted.
    assert value(samples, "ibpembed_table_hot_row_bytes", table="cat_1") == 0


def test_the_gate_says_whether_each_tier_is_on_and_why() -> None:
    rows = 10_000
    values = torch.randn(rows, 32, generator=torch.Generator().manual_seed(0))
    store = TableStore.from_tables({"flat": compress(values), "skewed": compress(values)})
    tier = HotTier(store, budget="5%")
    metrics = ServerMetrics(store, device="cpu")
    metrics.watch_hot_tier(tier)
    rng = np.random.default_rng(0)
    ranked = rng.permutation(rows)
    for _ in range(HOT_TIER_GATE.steps + 1):
        zipf = ranked[np.minimum(rng.zipf(1.3, 10_000) - 1, rows - 1)]
        tier.record([("flat", rng.integers(0, rows, 10_000), rows), ("skewed", zipf, rows)])
        tier.step()
    tier.publish()
    samples = parse(prometheus_client.generate_latest(metrics.registry).decode())
    assert value(samples, "ibpembed_hot_tier_on", table="flat", reason="flat") == 0
    assert value(samples, "ibpembed_hot_tier_on", table="skewed", reason="skewed") == 1
    flat = value(samples, "ibpembed_hot_row_would_be_hit_ratio", table="flat")
    skewed = value(samples, "ibpembed_hot_row_would_be_hit_ratio", table="skewed")
    assert 0 < flat < HOT_TIER_GATE.close_below <= HOT_TIER_GATE.open_at <= skewed <= 1
    # What the tier holds follows: the flat table's tier was withdrawn.
    assert value(samples, "ibpembed_table_hot_row_bytes", table="flat") == 0
    assert value(samples, "ibpembed_table_hot_row_bytes", table="skewed") > 0
    # The policy's own memory: its id buffer and sketch, sized by the tier, and its target set
    # (the published tier shares the target set's array), within what the budget paid for it.
    plans = tier.plan()
    for name, stats in tier.stats().items():
        ring = 8 * min(
            DEFAULT_WINDOW_IDS, max(MIN_WINDOW_IDS, WINDOW_IDS_PER_TIER_ROW * stats.capacity)
        )
        sketch = DEPTH * FrequencySketch.width_for(SKETCH_WIDTH_PER_ROW * stats.capacity)
        expected = ring + sketch + 8 * stats.rows
        assert value(samples, "ibpembed_hot_tier_policy_bytes", table=name) == expected
        assert 0 < expected <= plans[name].state_bytes
        assert stats.rows == stats.capacity == plans[name].rows


@pytest.mark.parametrize("bad", ["-5%", "lots", "5%%"])
def test_a_malformed_budget_stops_serve_at_start(bad: str) -> None:
    result = subprocess.run(
        [*IBPEMBED, "serve", "--port", "0", "--metrics-port", "0", f"--hot-tier={bad}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "hot tier budget" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
