# SPDX-License-Identifier: Apache-2.0
"""The HBM tier's metrics: counts the kernels add up in the tier's counter array (here the
emulated kernels of tools/simt, on the CPU) reach /metrics through the tier's collector, with
the published rows and the budget."""

from __future__ import annotations

import shutil

import numpy as np
import prometheus_client
import pytest
import torch

from ibpembed.codec import compress
from ibpembed.engine.hbm_tier import HbmTier
from ibpembed.server.metrics import ServerMetrics
from ibpembed.tables.store import TableStore
from tests.codec.tables import make_table
from tests.metrics.helpers import parse, value
from tools.simt.harness import CXX, EmulatedKernels, Tier, build

pytestmark = pytest.mark.skipif(
    shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX}) to build the SIMT emulator"
)


def test_kernel_counts_reach_metrics(tmp_path) -> None:
    store = TableStore.from_tables(
        {"t": compress(make_table(torch.float32, 400, 16, "trained_like", seed=1))}
    )
    tier = HbmTier(store, budget="10%", device="cpu")
    ids = (np.random.default_rng(0).zipf(1.2, 3000) - 1) % 400
    tier.record([("t", ids, 400)])
    tier.refresh()
    with store.acquire() as snap:
        table = snap.tables["t"]
    published = tier.tiers.get("t", table)
    assert published is not None
    a = published.arrays
    kernels = EmulatedKernels(build(tmp_path))
    lookup = torch.from_numpy(ids[:200])
    rows, error = kernels.gather(
        table,
        lookup,
        tier=Tier.of(a, published.counters.device_counts),
    )
    assert error == 0 and torch.equal(rows.view(torch.float32).view(-1, 16), table.gather(lookup))

    metrics = ServerMetrics(store, device="cpu")
    metrics.watch_hbm_tier(tier)
    samples = parse(prometheus_client.generate_latest(metrics.registry).decode())
    hits = value(samples, "ibpembed_hbm_tier_hits_total", table="t")
    misses = value(samples, "ibpembed_hbm_tier_misses_total", table="t")
    assert hits > 0 and misses > 0
    assert (hits, misses) == tuple(published.counters.device_counts.tolist())
    assert value(samples, "ibpembed_hbm_tier_rows", table="t") == a.num_slots
    budget = value(samples, "ibpembed_table_hbm_tier_budget_bytes", table="t")
    assert a.nbytes == budget  # a full decoded tier: what the budget buys, byte for byte
