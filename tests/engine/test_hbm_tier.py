# SPDX-License-Identifier: Apache-2.0
"""The HBM tier's residency map, slots and publication, built on the CPU (the kernels that read
them run in tests/cuda/test_simt_hbm_tier.py)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np
import pytest
import torch

from ibpembed.codec import CompressedTableSet, HotRows, compress
from ibpembed.engine.hbm_tier import (
    FORMS,
    PAYLOAD_PAD,
    HbmTier,
    build_tier,
    map_bytes,
    parse_form,
    slot_spans,
    tier_bytes,
    tier_capacity,
)
from ibpembed.engine.tier import HotTier, policy_state_bytes
from ibpembed.tables.store import TableStore
from ibpembed.tables.tier_budget import tier_cost
from tests.codec.tables import make_table

DIM = 24


def _table(rows: int = 300, seed: int = 0):
    values = make_table(torch.float32, rows, DIM, "trained_like", seed=seed)
    values[min(7, rows - 1)] = torch.randn(DIM) * 1e30  # stored raw
    return compress(values, align=1)


def _zipf(n: int, rows: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).zipf(1.3, n) - 1) % rows


def _read_directory(directory: torch.Tensor, num_rows: int) -> np.ndarray:
    """Each row's slot by the directory (-1: not held), read word by word as tier.h's
    rank_slot states it: bit r & 63 of word r >> 6 set, slot = base + set bits below it."""
    words = directory.numpy().view(np.uint64).reshape(-1, 2)
    slots = np.full(num_rows, -1, dtype=np.int64)
    for r in range(num_rows):
        bits, base = int(words[r >> 6, 0]), int(words[r >> 6, 1])
        if bits >> (r & 63) & 1:
            slots[r] = base + bin(bits & ((1 << (r & 63)) - 1)).count("1")
    return slots


def _directory_cases() -> list[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(11)
    cases = [
        (300, np.array([], dtype=np.int64)),  # empty
        (300, np.arange(300)),  # every row
        (256, np.arange(256)),  # every row, a whole number of words
        (200, np.array([0, 62, 63, 64, 65, 127, 128, 191, 192, 199])),  # word edges, the tail
        (64, np.array([63])),  # bit 63: the int64 word's sign bit
        (65, np.array([63, 64])),
        (1, np.array([0])),
    ]
    for num_rows in (97, 1000, 4099):  # not multiples of 64
        for share in (0.01, 0.3, 0.9):
            rows = np.flatnonzero(rng.random(num_rows) < share)
            cases.append((num_rows, rows))
    return cases


@pytest.mark.parametrize(("num_rows", "rows"), _directory_cases())
def test_the_rank_directory_gives_each_tier_row_its_slot_and_no_other_row_one(
    num_rows, rows
) -> None:
    c = _table(num_rows)
    t = build_tier(c, torch.from_numpy(rows), "decoded")
    assert t.directory.dtype == torch.int64
    assert t.directory.numel() == 2 * -(-num_rows // 64)  # 16 bytes per 64 rows
    assert t.directory.nbytes == map_bytes(c)
    want = np.full(num_rows, -1, dtype=np.int64)
    want[rows] = np.arange(rows.size)  # slots in row order
    assert np.array_equal(_read_directory(t.directory, num_rows), want)
    # The CPU decoded tier's directory of the same rows, word for word (a tier of every row
    # needs none on the CPU; the GPU's always has one).
    if 0 < rows.size < num_rows:
        cpu = c.with_hot_rows(torch.from_numpy(rows))
        assert cpu.hot is not None and torch.equal(cpu.hot.directory, t.directory)


@pytest.mark.parametrize(("num_rows", "rows"), [c for c in _directory_cases()[:6] if c[1].size])
def test_the_cpu_ops_read_a_decoded_hbm_tier_through_its_directory(num_rows, rows) -> None:
    """tier.h's rank_slot, compiled into the CPU ops, finds every row of a decoded HBM tier;
    the CPU TableSet checks the directory word by word as it is added."""
    c = _table(num_rows)
    t = build_tier(c, torch.from_numpy(rows), "decoded")
    stride = -(-c.row_bytes // 16) * 16
    slots = t.payload[: t.num_slots * stride].view(t.num_slots, stride)
    tier_rows = slots[:, : c.row_bytes].contiguous()
    # Poison the tier copies: a row read from the tier now differs from the table's.
    tier_rows.view(-1, DIM * 4)[:, :4] ^= 0x5A
    read = dataclasses.replace(c, hot=HotRows(t.rows, t.directory, tier_rows))
    ids = torch.arange(num_rows)
    got = read.gather(ids)
    held = torch.zeros(num_rows, dtype=torch.bool)
    held[rows] = True
    assert torch.equal(got[~held], c.gather(ids[~held]))  # misses: the table's rows
    want = c.gather(ids[held]).contiguous().view(torch.uint8).view(-1, c.row_bytes).clone()
    want[:, :4] ^= 0x5A
    assert torch.equal(got[held].contiguous().view(torch.uint8).view(-1, c.row_bytes), want)
    CompressedTableSet([read])  # every word checked
    broken = t.directory.clone()
    broken[-1] += 1  # the last word's base one past the rows before it
    with pytest.raises(ValueError, match="tier_dir"):
        CompressedTableSet([dataclasses.replace(read, hot=HotRows(t.rows, broken, tier_rows))])


def test_the_residency_map_names_each_tier_row_and_nothing_else() -> None:
    c = _table()
    rows = torch.tensor([250, 3, 7, 100, 3])  # unsorted, a repeat
    for form in FORMS:
        t = build_tier(c, rows, form)
        assert t.rows.tolist() == [3, 7, 100, 250] and t.num_slots == 4
        slots = _read_directory(t.directory, c.num_rows)
        assert np.flatnonzero(slots >= 0).tolist() == [3, 7, 100, 250]
        assert slots[[3, 7, 100, 250]].tolist() == [0, 1, 2, 3]
        assert t.decoded == (form == "decoded")
        if form == "decoded":
            assert t.slot_offset is None  # a fixed stride: no offsets
            assert t.payload.numel() == 4 * (-(-c.row_bytes // 16) * 16) + PAYLOAD_PAD
        else:
            assert t.slot_offset is not None
            assert t.payload.numel() == int(t.slot_offset[-1]) + PAYLOAD_PAD


def test_decoded_slots_hold_the_rows_16_byte_aligned() -> None:
    c = _table()
    t = build_tier(c, torch.arange(0, 300, 7), "decoded")
    stride = -(-c.row_bytes // 16) * 16
    assert t.payload.numel() == t.num_slots * stride + PAYLOAD_PAD
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
    fixed = map_bytes(c) + PAYLOAD_PAD
    assert tier_capacity(c, "decoded", fixed) == 0
    one = tier_bytes(c, "decoded", 1)
    assert tier_capacity(c, "decoded", one) == 1 and tier_capacity(c, "decoded", one - 1) == 0
    assert build_tier(c, torch.tensor([5]), "decoded").nbytes == one
    for rows in (1, 17, 3000):  # a decoded tier's bytes are exact
        assert build_tier(c, torch.arange(rows), "decoded").nbytes == tier_bytes(c, "decoded", rows)
    budget = fixed + 64 * 1024
    decoded = tier_capacity(c, "decoded", budget)
    compressed = tier_capacity(c, "compressed", budget)
    assert 0 < decoded < compressed
    assert tier_capacity(c, "decoded", 10**12) == c.num_rows


def test_the_map_costs_a_quarter_byte_per_row() -> None:
    """16 bytes per 64 rows: a billion-row table's map is 250 MB, not 4 GB; the budget pays
    for it before rows, so a 1 % tier of 512-byte rows is nearly all rows."""
    billion = compress(make_table(torch.float32, 64, 128, "trained_like", seed=1), align=1)
    billion = dataclasses.replace(billion, num_rows=10**9)  # sizes only: nothing is read
    assert map_bytes(billion) == 16 * (10**9 // 64) == 250_000_000
    one_percent = billion.raw_bytes // 100
    rows = tier_capacity(billion, "decoded", one_percent)
    assert rows == (one_percent - map_bytes(billion) - PAYLOAD_PAD) // 512
    assert rows > 0.95 * one_percent // 512


@pytest.mark.parametrize("form", ["decoded", "compressed"])
def test_publication_follows_the_traffic_and_each_table_version(form) -> None:
    store = TableStore.from_tables({"t": _table()})
    tier = HbmTier(store, budget="20%", form=form, device="cpu")
    ids = _zipf(5000, 300)
    tier.record([("t", ids, 300)])
    held, wanted = tier.refresh()["t"], tier.stats()["t"].rows
    # A compressed tier drops its largest slots (row 7, stored raw) rather than overrun.
    assert held == wanted if form == "decoded" else 0 < held <= wanted
    with store.acquire() as snap:
        v1 = snap.tables["t"]
    published = tier.tiers.get("t", v1)
    assert published is not None and published.table is v1
    top = np.bincount(ids, minlength=300).argmax()
    assert top in published.arrays.rows.tolist()  # the hottest row is in
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
    slot = int(_read_directory(fresh.arrays.directory, 300)[top])
    assert slot >= 0
    if form == "decoded":
        stride = -(-4 * DIM // 16) * 16
        row = fresh.arrays.payload[slot * stride : slot * stride + 4 * DIM].view(torch.float32)
        assert torch.equal(row, torch.full((DIM,), 3.0))
    else:
        offset, size = slot_spans(v2, torch.tensor([int(top)]))
        assert fresh.arrays.slot_offset is not None
        a = int(fresh.arrays.slot_offset[slot])
        got = fresh.arrays.payload[a : a + int(size)]
        assert torch.equal(got, v2.payload[int(offset) : int(offset + size)])


def test_the_hbm_and_host_tiers_share_one_admission_policy() -> None:
    # The same traffic and the same capacity: the same rows, whichever tier holds them.
    store = TableStore.from_tables({"t": _table()})
    hbm = HbmTier(store, budget="20%", device="cpu")
    table = _current(store)
    capacity = hbm.capacity(table, 1.0)
    # The host budget, in bytes, that buys as many rows (and the policy's state for them).
    rows_bytes = tier_cost(table.num_rows, table.row_bytes, capacity)
    host = HotTier(store, budget=str(rows_bytes + policy_state_bytes(table.num_rows, capacity)))
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


def test_a_table_a_reload_drops_loses_its_tier_and_nothing_keeps_it(tmp_path) -> None:
    kept, dropped = tmp_path / "kept", tmp_path / "both"
    TableStore.from_tables({"a": _table(), "b": _table(seed=1)}).save(dropped)
    TableStore.from_tables({"a": _table()}).save(kept)
    store = TableStore.load(dropped)
    tier = HbmTier(store, budget="50%", device="cpu")
    ids = _zipf(2000, 300)
    tier.record([("a", ids, 300), ("b", ids, 300)])
    assert set(tier.refresh()) == {"a", "b"}
    with store.acquire() as snap:
        old_b = weakref.ref(snap.tables["b"])
    del snap
    assert store.reload(kept)
    tier.step()
    gc.collect()
    assert set(tier.tiers.current()) == {"a"} and set(tier.counts()) == {"a"}
    assert old_b() is None  # neither the tier nor its counters hold the dropped table


def test_the_last_pooling_set_does_not_keep_a_replaced_version_alive() -> None:
    store = TableStore.from_tables({"t": _table()})
    tier = HbmTier(store, budget="50%", device="cpu")
    with store.acquire() as snap:
        tier.table_set(snap)  # kept for the next request of the same version
        old = weakref.ref(snap.tables["t"])
    del snap
    store.put_table("t", _table(seed=1))
    tier.step()
    gc.collect()
    assert old() is None


def test_a_compressed_tier_of_larger_than_average_rows_stays_within_its_budget() -> None:
    """The compressed form is priced at the table's mean slot; hot rows stored raw are larger,
    so the tier drops its largest slots rather than exceed the budget."""
    rows, gen = 4000, torch.Generator().manual_seed(0)
    values = torch.randn(rows, DIM, generator=gen) * 0.05
    hot = np.arange(0, rows, 10)
    values[torch.from_numpy(hot)] = torch.randn(hot.size, DIM, generator=gen) * 1e30  # raw
    store = TableStore.from_tables({"t": compress(values)})
    tier = HbmTier(store, budget="5%", form="compressed", device="cpu")
    rng = np.random.default_rng(0)
    for _ in range(3):
        tier.record([("t", rng.choice(hot, 20_000), rows)])
        tier.refresh()
    with store.acquire() as snap:
        table = snap.tables["t"]
    published = tier.tiers.get("t", table)
    assert published is not None and 0 < published.arrays.num_slots < tier.stats()["t"].rows
    assert published.arrays.nbytes <= int(0.05 * table.raw_bytes)
    assert set(published.arrays.rows.tolist()) <= set(hot.tolist())
