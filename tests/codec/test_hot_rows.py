# SPDX-License-Identifier: Apache-2.0
"""The decoded tier: lookups that read tier rows (the lean path) return exactly what decoding
returns, for ids all in the tier, none, mixed and repeated, pooled and unpooled."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ibpembed import _C, compress
from ibpembed._ops import ops
from ibpembed.codec import (
    CompressedTable,
    available_cpu_paths,
    tier_bytes_for,
    tier_directory_bytes,
)
from ibpembed.tables.store import TableStore
from tests.codec.tables import POOLED_CASES, make_table, same_bits, tables


def _subset(num_rows: int, rng: np.random.Generator, fraction: float) -> torch.Tensor:
    keep = rng.random(num_rows) < fraction
    return torch.from_numpy(np.flatnonzero(keep)).to(torch.int64)


@pytest.mark.usefixtures("restore_path")
@pytest.mark.parametrize("path", available_cpu_paths())
@given(
    table=tables(),
    code_bits=st.sampled_from((1, 2, 4)),
    fraction=st.sampled_from((0.0, 0.1, 0.5, 1.0)),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_with_a_tier_is_bit_exact(path, table, code_bits, fraction, seed) -> None:
    """Every dtype and width, 256 ids with duplicates (several rounds of the decode pipeline),
    none, some or all of them in the tier."""
    _C.set_cpu_path(path)
    rng = np.random.default_rng(seed)
    c = compress(table, code_bits=code_bits)
    tiered = c.with_hot_rows(_subset(c.num_rows, rng, fraction))
    ids = torch.from_numpy(rng.integers(0, table.shape[0], 256))
    assert same_bits(tiered.gather(ids), table[ids])
    assert same_bits(tiered.decompress(), table)


@pytest.mark.usefixtures("restore_path")
@pytest.mark.parametrize("path", available_cpu_paths())
@given(**POOLED_CASES, fraction=st.sampled_from((0.0, 0.3, 0.97, 1.0)))
def test_pooled_with_a_tier_equals_pooled_without(
    path, dtype, dim, pooling, weighted, seed, fraction
):
    """Same rows in the same order, so the fp32 sums agree bit for bit, not just within a bound:
    hits and misses interleave within bags (empty bags included)."""
    _C.set_cpu_path(path)
    rng = np.random.default_rng(seed)
    table = make_table(dtype, 300, dim, "trained_like", seed)
    c = compress(table)
    tiered = c.with_hot_rows(_subset(c.num_rows, rng, fraction))
    lengths = torch.from_numpy(rng.integers(0, 40, 64))
    ids = torch.from_numpy(rng.integers(0, 300, int(lengths.sum())))
    weights = torch.rand(ids.numel()) if weighted else None
    got = tiered.lookup(ids, None, weights, pooling, lengths=lengths)
    assert same_bits(got, c.lookup(ids, None, weights, pooling, lengths=lengths))


@pytest.mark.usefixtures("restore_path")
@pytest.mark.parametrize("path", available_cpu_paths())
@pytest.mark.parametrize("selection", ["none_looked_up", "one_row", "all_but_one", "all", "half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pooled_and_gathered_ids_across_selections(path, selection, dtype) -> None:
    """1000 rows, 5000 ids in 200 bags (one thread's share spans many decode rounds):
    misses only, a single hit, all but one row, every row (no directory), half."""
    _C.set_cpu_path(path)
    table = make_table(dtype, 1000, 33, "trained_like", 4)
    c = compress(table, code_bits=2)
    rng = np.random.default_rng(5)
    ids = torch.from_numpy(rng.integers(0, 500, 5000))  # rows 500.. never looked up
    chosen = {
        "none_looked_up": torch.arange(500, 1000),
        "one_row": ids[:1],
        "all_but_one": torch.arange(1, 1000),
        "all": torch.arange(1000),
        "half": torch.arange(0, 1000, 2),
    }[selection]
    tiered = c.with_hot_rows(chosen)
    assert tiered.hot is not None and tiered.tier_rows == torch.unique(chosen).numel()
    assert (tiered.hot.directory.numel() == 0) == (selection == "all")
    cuts = torch.from_numpy(np.sort(rng.integers(0, 5001, 199)))  # empty bags too
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([5000])])
    assert same_bits(tiered.gather(ids), table[ids])
    assert same_bits(tiered.lookup(ids, offsets), c.lookup(ids, offsets))
    w = torch.randn(5000)
    assert same_bits(tiered.lookup(ids, offsets, w, "mean"), c.lookup(ids, offsets, w, "mean"))


def test_tier_keeps_rows_in_row_order_raw_rows_included() -> None:
    table = make_table(torch.float32, 200, 16, "trained_like", 1)
    c = compress(table)
    wanted = torch.tensor([199, 63, 64, 0, 63, 127, 128])
    tiered = c.with_hot_rows(wanted)
    assert tiered.hot is not None
    assert tiered.hot.ids.tolist() == sorted(set(wanted.tolist()))
    assert same_bits(tiered.hot.rows.view(torch.float32), table[tiered.hot.ids])
    words = tiered.hot.directory.view(-1, 2)  # 4 words of 64 rows: a bit word, the rows before
    assert words.shape == (4, 2) and words[:, 1].tolist() == [0, 2, 4, 5]
    assert tiered.tier_bytes == tiered.hot.rows.numel() + 8 * 6 + tier_directory_bytes(200)
    assert tiered.tier_bytes == tier_bytes_for(200, c.row_bytes, 6)
    assert tiered.stored_bytes == c.stored_bytes  # the tier is counted apart
    assert tiered.payload is c.payload  # shared, not copied
    assert tiered.without_hot_rows().hot is None and c.without_hot_rows() is c


def test_raw_tables_and_empty_selections_give_no_tier() -> None:
    table = torch.randn(100, 8)
    raw = compress(table, method="raw")
    assert raw.with_hot_rows(torch.arange(100)).hot is None
    assert raw._tier_args()[1] is not None  # the payload itself, read by the lean path
    assert compress(make_table(torch.float32, 100, 8, "trained_like", 0))._tier_args() == (
        None,
        None,
    )
    assert compress(table).with_hot_rows(torch.tensor([], dtype=torch.int64)).hot is None


@pytest.mark.usefixtures("restore_path")
@pytest.mark.parametrize("path", available_cpu_paths())
@pytest.mark.parametrize("dim", [1, 3, 16, 129])
def test_raw_rows_lean_path_is_bit_exact(path, dim) -> None:
    """An all-raw table's lookups read its payload as a tier of every row (at the slot stride,
    padded slots included): the same bits as the index path."""
    _C.set_cpu_path(path)
    table = make_table(torch.float32, 300, dim, "random_bits", dim)
    rng = np.random.default_rng(dim)
    ids = torch.from_numpy(rng.integers(0, 300, 900))
    offsets = torch.arange(0, 901, 9)
    for align in (None, 64):
        raw = compress(table, method="raw", align=align)
        stride = raw._tier_args()[1].shape[1]  # type: ignore[union-attr]
        assert stride == (dim * 4 if align is None else -(-dim * 4 // 64) * 64)
        indexed = dataclasses.replace(raw)  # a fresh object: its own cached check
        assert same_bits(raw.gather(ids), table[ids])
        assert same_bits(
            raw.lookup(ids, offsets),
            ops.lookup_pooled(*indexed.op_args(), ids, offsets, None, 0, 0, None, None),
        )


def test_tier_capacity_rows_and_bad_budgets() -> None:
    c = compress(make_table(torch.float32, 1000, 16, "trained_like", 2))
    per_row, directory = c.row_bytes + 8, tier_directory_bytes(1000)
    assert directory == 16 * 16
    # Rows, their ids, the directory and a spare slot per eight rows.
    assert tier_bytes_for(1000, c.row_bytes, 16) == directory + 16 * per_row + 2 * c.row_bytes
    assert c.tier_capacity_rows(0) == 0
    assert c.tier_capacity_rows(directory + per_row - 1) == 0
    assert c.tier_capacity_rows(directory + 16 * per_row + 2 * c.row_bytes) == 16
    assert c.tier_capacity_rows(directory + 16 * per_row + 2 * c.row_bytes - 1) == 15
    every = 1000 * per_row  # every row: no directory, no spare slots until an update
    assert tier_bytes_for(1000, c.row_bytes, 1000) == every
    assert c.tier_capacity_rows(every) == 1000
    assert c.tier_capacity_rows(10**15) == 1000  # clamped to the table
    # 999 rows and their directory cost more than every row without one: the budget buys all.
    assert c.tier_capacity_rows(tier_bytes_for(1000, c.row_bytes, 999)) == 1000
    for k in (0, 10, 500, 1000):
        budget = tier_bytes_for(1000, c.row_bytes, k)
        assert c.tier_capacity_rows(budget) == k
        if 0 < k < 1000:
            assert c.tier_capacity_rows(budget - 1) == k - 1
        assert c.with_hot_rows(torch.arange(k)).tier_bytes == budget
    with pytest.raises(ValueError, match=">= 0"):
        c.tier_capacity_rows(-1)
    with pytest.raises(TypeError, match="int"):
        c.tier_capacity_rows(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 0"):
        tier_bytes_for(1000, c.row_bytes, -1)
    with pytest.raises(ValueError, match="spare_rows must be >= 0"):
        c.with_hot_rows(torch.arange(5), spare_rows=-1)
    spared = c.with_hot_rows(torch.arange(5), spare_rows=3).hot
    assert spared is not None and spared.bytes == 8 * c.row_bytes + 8 * 5 + directory


@pytest.mark.parametrize("bad", [[-1], [100], [3, 1000]])
def test_tier_ids_out_of_range_raise(bad) -> None:
    c = compress(torch.randn(100, 8))
    with pytest.raises(IndexError, match=r"\[0, 100\)"):
        c.with_hot_rows(torch.tensor(bad))


def test_ops_reject_an_inconsistent_tier() -> None:
    c = compress(make_table(torch.float32, 200, 16, "trained_like", 2))
    tier = c.with_hot_rows(torch.arange(0, 200, 3)).hot
    assert tier is not None
    ids = torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match="pass both or neither"):
        ops.ibp_gather(*c.op_args(), ids, tier.directory, None)
    with pytest.raises(ValueError, match="two per 64 rows"):
        ops.ibp_gather(*c.op_args(), ids, tier.directory[:-2], tier.rows)
    with pytest.raises(ValueError, match="last word ends at slot 67 but tier_rows holds 66"):
        ops.ibp_gather(*c.op_args(), ids, tier.directory, tier.rows[1:])
    with pytest.raises(ValueError, match="tier holds every row"):
        ops.ibp_gather(*c.op_args(), ids, tier.directory[:0], tier.rows)
    with pytest.raises(ValueError, match=r"tier_rows must be \[tier rows, >= 64\]"):
        ops.ibp_gather(*c.op_args(), ids, tier.directory, tier.rows[:, :8].contiguous())
    with pytest.raises(ValueError, match="tier_dir must be Long"):
        ops.lookup_pooled(
            *c.op_args(), ids, torch.tensor([0, 3]), None, 0, 0, tier.directory.int(), tier.rows
        )
    handle = torch.classes.ibpembed.TableSet()
    miscounted = tier.directory.clone()
    miscounted[3] += 60  # word 1's rows past the tier; the last word (checked per call) fits
    with pytest.raises(ValueError, match="rows of word 1 at slot 82, past the tier's 67 slots"):
        handle.add(*c.op_args(), 0, miscounted, tier.rows)
    past = tier.directory.clone()
    past[6] = (past[6] ^ 1) | (1 << 20)  # row 192 out, row 212 of a 200-row table in
    with pytest.raises(ValueError, match="past the table"):
        handle.add(*c.op_args(), 0, past, tier.rows)


@pytest.mark.usefixtures("restore_path")
@pytest.mark.parametrize("path", available_cpu_paths())
def test_lookups_read_the_tier(path) -> None:
    """Tampered tier rows show up in the results: the equality tests above are not passing
    because the tier is ignored."""
    _C.set_cpu_path(path)
    table = make_table(torch.float32, 300, 16, "trained_like", 3)
    c = compress(table)
    tiered = c.with_hot_rows(torch.arange(0, 300, 2))
    assert tiered.hot is not None
    tampered = dataclasses.replace(tiered.hot, rows=torch.full_like(tiered.hot.rows, 0x3F))
    marked = dataclasses.replace(tiered, hot=tampered)
    ids = torch.arange(300).repeat(2)  # 600 ids: the vector decoder's batch size too
    got = marked.gather(ids).view(torch.uint8).reshape(600, -1)
    held = torch.isin(ids, tiered.hot.ids)
    assert bool((got[held] == 0x3F).all())
    assert same_bits(got[~held].view(torch.float32), table[ids[~held]])
    pooled = marked.lookup(tiered.hot.ids[:1], torch.tensor([0, 1]))
    assert bool((pooled.view(torch.uint8) == 0x3F).all())
    both = marked.lookup(torch.tensor([0, 1]), torch.tensor([0, 2]))  # a hit, then a miss
    expected = torch.full((1, 64), 0x3F, dtype=torch.uint8).view(torch.float32) + table[1]
    assert same_bits(both, expected)


def test_row_updates_racing_lookups_never_serve_a_stale_tier_row() -> None:
    """update_rows publishes a version whose tier holds the rows' new bits (the old version
    keeps its own): lookups racing the updates, every result bit-exact to the version that
    served it."""
    rows, dim = 512, 16
    base = make_table(torch.float32, rows, dim, "trained_like", 7)
    base[0, 1] = 0.0  # row 0 (in the tier) names the version
    store = TableStore({"t": compress(base).with_hot_rows(torch.arange(0, rows, 2))}, {"t": "t"})
    versions = {0: base.clone()}
    stop = threading.Event()
    errors: list[str] = []
    rng = np.random.default_rng(8)
    ids = torch.from_numpy(rng.integers(0, 64, 4096))  # hot and cold rows the writer touches
    offsets = torch.arange(0, 4097, 16)

    def reader() -> None:
        while not stop.is_set():
            with store.acquire() as snapshot:
                table: CompressedTable = snapshot.tables["t"]
                got_rows, got_pooled = table.gather(ids), table.lookup(ids, offsets)
            hot = table.hot
            assert hot is not None
            marker = hot.rows[hot.slots(torch.tensor([0]))[0], :8]  # row 0, wherever it moved
            version = int(marker.view(torch.float32)[1].item())
            truth = versions[version]
            plain = compress(truth, method="raw")
            if not same_bits(got_rows, truth[ids]):
                errors.append(f"gather differs at version {version}")
            if not same_bits(got_pooled, plain.lookup(ids, offsets)):
                errors.append(f"pooled differs at version {version}")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        current = base.clone()
        for version in range(1, 30):
            changed = torch.from_numpy(rng.choice(64, 8, replace=False)).to(torch.int64)
            changed = torch.cat([changed[changed != 0], torch.tensor([0])])
            new_rows = torch.randn(changed.numel(), dim)
            new_rows[changed == 0, 1] = float(version)
            current[changed] = new_rows
            versions[version] = current.clone()
            store.update_rows("t", changed, new_rows)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    with store.acquire() as snapshot:
        final = snapshot.tables["t"]
    assert final.hot is not None and same_bits(final.gather(torch.arange(rows)), current)
