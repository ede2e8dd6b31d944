# SPDX-License-Identifier: Apache-2.0
"""The HBM tier's residency map, slots and publication, built on the CPU (the kernels that read
them run in tests/cuda/test_simt_hbm_tier.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ibpembed.codec import compress
from ibpembed.engine.hbm_tier import (
    MAP_BYTES_PER_ROW,
    PAYLOAD_PAD,
    HbmTier,
    build_tier,
    parse_form,
    slot_spans,
    tier_bytes,
    tier_capacity,
)
from ibpembed.engine.tier import HotTier
from ibpembed.tables.store import TableStore
from ibpembed.tables.tier_budget import tier_cost
from tests.codec.tables import make_table

DIM = 24


def _table(rows: int = 300, seed: int = 0):
    values = make_table(torch.float32, rows, DIM, "trained_like", seed=seed)
    values[7] = torch.randn(DIM) * 1e30  # stored raw
    return compress(values, align=1)


def _zipf(n: int, rows: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).zipf(1.3, n) - 1) % rows


def test_the_residency_map_names_each_tier_row_and_nothing_else() -> None:
    c = _table()
    rows = torch.tensor([250, 3, 7, 100, 3])  # unsorted, a repeat
    for form in ("decoded", "compressed"):
        t = build_tier(c, rows, form)
        assert t.rows.tolist() == [3, 7, 100, 250] and t.num_slots == 4
        assert t.slot_of.dtype == torch.int32 and t.slot_of.numel() == c.num_rows
        held = (t.slot_of >= 0).nonzero().flatten()
        assert held.tolist() == [3, 7, 100, 250]
        assert t.slot_of[held].tolist() == [0, 1, 2, 3]
        assert t.payload.numel() == int(t.slot_offset[-1]) + PAYLOAD_PAD
        assert t.decoded == (form == "decoded")


def test_decoded_slots_hold_the_rows_16_byte_aligned() -> None:
    c = _table()
    t = build_tier(c, torch.arange(0, 300, 7), "decoded")
    stride = -(-c.row_bytes // 16) * 16
    assert torch.equal(t.slot_offset, torch.arange(t.num_slots + 1) * stride)
    got = t.payload[: t.num_slots * stride].view(t.num_slots, stride)[:, : c.row_bytes]
    want = c.gather(t.rows).contiguous().view(torch.uint8).view(t.num_slots, -1)
    assert torch.equal(got, want)


def test_compressed_slots_are_the_tables_slots_byte_for_byte() -> None:
    c = _table()
    t = build_tier(c, torch.arange(0, 300, 5), "compressed")
    offset, size = slot_spans(c, t.rows)
    # Slot spans tile the payload: each row's slot ends where the next row's begins.
    all_offsets, all_sizes = slot_spans(c, torch.arange(c.num_rows))
    assert torch.equal(all_offsets[1:], all_offsets[:-1] + all_sizes[:-1])
    assert int(all_offsets[-1] + all_sizes[-1]) == int(c.block_base[-1])
    for s in range(t.num_slots):
        a, b = int(t.slot_offset[s]), int(t.slot_offset[s + 1])
        o = int(offset[s])
        assert b - a == int(size[s])
        assert torch.equal(t.payload[a:b], c.payload[o : o + b - a])
    # A compressed tier is smaller than a decoded one of the same rows.
    assert t.payload.numel() < build_tier(c, t.rows, "decoded").payload.numel()


def test_bad_rows_and_forms_are_refused() -> None:
    c = _table()
    with pytest.raises(IndexError):
        build_tier(c, torch.tensor([c.num_rows]), "decoded")
    with pytest.raises(ValueError, match="decoded, compressed"):
        parse_form("raw")


def test_capacity_pays_the_map_first_and_the_compressed_form_holds_more_rows() -> None:
    c = _table(3000)
    map_bytes = MAP_BYTES_PER_ROW * c.num_rows
    assert tier_capacity(c, "decoded", map_bytes) == 0
    one = tier_bytes(c, "decoded", 1)
    assert tier_capacity(c, "decoded", one) == 1 and tier_capacity(c, "decoded", one - 1) == 0
    assert build_tier(c, torch.tensor([5]), "decoded").nbytes == one
    budget = map_bytes + 64 * 1024
    decoded = tier_capacity(c, "decoded", budget)
    compressed = tier_capacity(c, "compressed", budget)
    assert 0 < decoded < compressed
    assert tier_capacity(c, "decoded", 10**12) == c.num_rows


@pytest.mark.parametrize("form", ["decoded", "compressed"])
def test_publication_follows_the_traffic_and_each_table_version(form) -> None:
    store = TableStore.from_tables({"t": _table()})
    tier = HbmTier(store, budget="20%", form=form, device="cpu")
    ids = _zipf(5000, 300)
    tier.record([("t", ids, 300)])
    assert tier.refresh() == {"t": tier.stats()["t"].rows}
    with store.acquire() as snap:
        v1 = snap.tables["t"]
    published = tier.tiers.get("t", v1)
    assert published is not None and published.table is v1
    top = np.bincount(ids, minlength=300).argmax()
    assert int(published.arrays.slot_of[top]) >= 0  # the hottest row is in
    before = tier.tiers.current()

    # A row update makes a new version: the old tier is never handed out with it, and the next
    # publication builds one from the new version's bits.
    store.update_rows("t", torch.tensor([int(top)]), torch.full((1, DIM), 3.0))
    with store.acquire() as snap:
        v2 = snap.tables["t"]
    assert tier.tiers.get("t", v2) is None
    assert before["t"] is published  # a reader's mapping is never changed under it
    tier.record([("t", ids, 300)])
    tier.refresh()
    fresh = tier.tiers.get("t", v2)
    assert fresh is not None and fresh.table is v2
    # A reader resolves tiers from the one mapping it took, whatever was published since.
    assert tier.tiers.get("t", v1, before) is published
    assert tier.tiers.get("t", v2, before) is None
    with store.acquire() as snap:
        assert tier.tier_of(snap, "t") is fresh
    assert fresh.counters is published.counters  # counts carry over publications
    slot = int(fresh.arrays.slot_of[top])
    if form == "decoded":
        stride = int(fresh.arrays.slot_offset[1])
        row = fresh.arrays.payload[slot * stride : slot * stride + 4 * DIM].view(torch.float32)
        assert torch.equal(row, torch.full((DIM,), 3.0))
    else:
        offset, size = slot_spans(v2, torch.tensor([int(top)]))
        a = int(fresh.arrays.slot_offset[slot])
        got = fresh.arrays.payload[a : a + int(size)]
        assert torch.equal(got, v2.payload[int(offset) : int(offset + size)])


def test_the_hbm_and_host_tiers_share_one_admission_policy() -> None:
    # The same traffic and the same capacity: the same rows, whichever tier holds them.
    store = TableStore.from_tables({"t": _table()})
    hbm = HbmTier(store, budget="20%", device="cpu")
    table = _current(store)
    capacity = hbm.capacity(table, 1.0)
    # The host budget, in bytes, that buys as many rows.
    host = HotTier(store, budget=str(tier_cost(table.num_rows, table.row_bytes, capacity)))
    assert host.capacity(table, 1.0) == capacity
    ids = _zipf(4000, 300, seed=3)
    for policy in (hbm, host):
        policy.record([("t", ids, 300)])
        policy.step()
    assert np.array_equal(hbm._tables["t"].residents, host._tables["t"].residents)
    assert hbm._tables["t"].residents.size == capacity


def _current(store: TableStore):
    with store.acquire() as snap:
        return snap.tables["t"]
