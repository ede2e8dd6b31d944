# SPDX-License-Identifier: Apache-2.0
"""The HBM tier in the CUDA kernels (one launch: tier rows from the tier's payload, the rest
from the table's), run by the SIMT emulator against the CPU ops, in both tier forms: all hits,
all misses, mixed, duplicates, and a row update landing between two batches."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from ibpembed import CompressedTable, compress
from ibpembed.engine.hbm_tier import FORMS, build_tier
from ibpembed.tables.store import TableStore
from tests.codec.tables import make_table
from tests.cuda import request_ids
from tools.simt.harness import CXX, EmulatedKernels, Grid, Tier, build

pytestmark = pytest.mark.skipif(
    shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX}) to build the SIMT emulator"
)

ERR_TABLE = 4  # kernels.h ErrorBits


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> EmulatedKernels:
    return EmulatedKernels(build(tmp_path_factory.mktemp("simt_tier")))


def _cpu_rows(c: CompressedTable, ids: torch.Tensor) -> torch.Tensor:
    return c.gather(ids).contiguous().view(torch.uint8).view(ids.numel(), c.row_bytes)


def _table(rows: int = 160, dim: int = 40, chunk_bits: int = 32) -> CompressedTable:
    values = make_table(torch.float32, rows, dim, "trained_like", seed=dim)
    values[3] = torch.randn(dim) * 1e30  # stored raw: a raw row in the tier too
    return compress(values, chunk_bits=chunk_bits, align=1)


TIER_ROWS = {
    "all_hits": lambda n: torch.arange(n),
    "all_misses": lambda n: torch.empty(0, dtype=torch.int64),
    "mixed": lambda n: torch.arange(0, n, 3),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("which", list(TIER_ROWS))
@pytest.mark.parametrize("sort", [True, False])
def test_gather_with_a_tier_is_bit_exact(kernels, form, which, sort) -> None:
    c = _table()
    tier = Tier.of(build_tier(c, TIER_ROWS[which](c.num_rows), form))
    ids = request_ids(np.random.default_rng(7), c.num_rows, 90, hot_copies=40)  # duplicates
    rows, error = kernels.gather(c, ids, Grid(2, 2), sort=sort, tier=tier)
    assert error == 0
    assert torch.equal(rows, _cpu_rows(c, ids))
    hits, misses = tier.counters.tolist()
    if which == "all_hits":
        assert hits > 0 and misses == 0
    elif which == "all_misses":
        assert hits == 0 and misses > 0
    else:
        assert hits > 0 and misses > 0
    # A run of adjacent equal ids resolves once: the distinct ids at least, never more than all.
    assert ids.unique().numel() <= hits + misses <= ids.numel()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("chunk_bits", [16, 64])
def test_gather_with_a_tier_at_other_chunk_widths(kernels, form, chunk_bits) -> None:
    c = _table(96, 33, chunk_bits)
    tier = Tier.of(build_tier(c, torch.arange(1, c.num_rows, 2), form))
    ids = request_ids(np.random.default_rng(chunk_bits), c.num_rows, 70)
    rows, error = kernels.gather(c, ids, Grid(3, 4, async_copies=False), tier=tier)
    assert error == 0
    assert torch.equal(rows, _cpu_rows(c, ids))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("which", list(TIER_ROWS))
@pytest.mark.parametrize("pooling", [0, 1])
def test_pooled_with_a_tier_is_bit_exact(kernels, form, which, pooling) -> None:
    c = _table()
    tier = Tier.of(build_tier(c, TIER_ROWS[which](c.num_rows), form))
    rng = np.random.default_rng(pooling)
    lengths = rng.integers(0, 12, 20)
    lengths[::6] = 0
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    ids = torch.from_numpy(rng.integers(0, c.num_rows, int(lengths.sum())))
    ids[5:9] = ids[4]  # repeats: a compressed repeat is accumulated from the decoded row
    weights = torch.from_numpy(rng.random(ids.numel()).astype(np.float32))
    got, error = kernels.pooled(c, ids, offsets, weights, 0, pooling, Grid(2, 2), tier=tier)
    assert error == 0
    want = c.lookup(ids, offsets, weights, "mean" if pooling else "sum")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    hits, misses = tier.counters.tolist()
    assert hits + misses == ids.numel()  # the lanes resolve every id of a bag
    assert (hits > 0) == (which != "all_misses") and (misses > 0) == (which != "all_hits")


def test_pooled_tables_with_and_without_tiers_in_one_launch(kernels) -> None:
    a, b = _table(120, 40), _table(80, 24)
    tiers = [Tier.of(build_tier(a, torch.arange(0, 120, 2), "compressed")), None]
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 80, 60))
    offsets = torch.arange(0, 61, 6)
    outs, error = kernels.pooled_tables(
        [(a, 0), (b, 0)], [(0, 0, 5), (1, 5, 5)], ids, offsets, None, 0, Grid(2, 2), tiers=tiers
    )
    assert error == 0
    torch.testing.assert_close(outs[0], a.lookup(ids[:30], offsets[:6]), rtol=0, atol=0)
    torch.testing.assert_close(outs[1], b.lookup(ids[30:], offsets[5:] - 30), rtol=0, atol=0)


@pytest.mark.parametrize("form", FORMS)
def test_tier_rows_at_directory_word_edges_in_a_table_of_a_partial_last_word(kernels, form) -> None:
    c = _table(rows=200)  # 3 whole words of 64 rows and 8 rows of a fourth
    held = torch.tensor([0, 3, 62, 63, 64, 65, 127, 128, 191, 192, 199])
    tier = Tier.of(build_tier(c, held, form))
    ids = torch.arange(c.num_rows).flip(0)  # every row, each once
    rows, error = kernels.gather(c, ids, Grid(3, 2), tier=tier)
    assert error == 0 and torch.equal(rows, _cpu_rows(c, ids))
    assert tier.counters.tolist() == [held.numel(), c.num_rows - held.numel()]
    offsets = torch.arange(0, c.num_rows + 1, 8)
    got, error = kernels.pooled(c, ids, offsets, None, 0, 0, Grid(2, 3), tier=tier)
    assert error == 0
    torch.testing.assert_close(got, c.lookup(ids, offsets), rtol=0, atol=0)


@pytest.mark.parametrize("form", FORMS)
def test_an_update_between_two_batches_is_never_served_stale(kernels, form) -> None:
    values = make_table(torch.float32, 128, 40, "trained_like", seed=2)
    store = TableStore.from_tables({"t": compress(values, align=1)})
    with store.acquire() as snap:
        before = snap.tables["t"]
    tier_before = Tier.of(build_tier(before, torch.arange(64), form))
    ids = torch.arange(0, 128, 5)
    rows, error = kernels.gather(before, ids, tier=tier_before)
    assert error == 0 and torch.equal(rows, _cpu_rows(before, ids))

    updated = torch.tensor([0, 5, 10, 100])  # rows in the tier and out of it
    store.update_rows("t", updated, torch.randn(4, 40))
    with store.acquire() as snap:
        after = snap.tables["t"]
    want = _cpu_rows(after, ids)
    # The old version's tier holds the old bits: read with the new version it would be stale,
    # which is why a tier is only ever read with the version it was built from.
    stale, _ = kernels.gather(after, ids, tier=tier_before)
    assert not torch.equal(stale, want)
    # Until its own tier is published the new version is read from host memory; then from it.
    for tier in (None, Tier.of(build_tier(after, torch.arange(64), form))):
        rows, error = kernels.gather(after, ids, tier=tier)
        assert error == 0 and torch.equal(rows, want)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "base",
    [
        4,  # past the tier's 4 slots: the first held row of the word would be slot 4
        1 << 40,  # far past it
        -1,  # 2^64 - 1 as the uint64 the kernels read: base + 1 wraps to slot 0
    ],
)
def test_a_corrupt_directory_is_reported_not_read_through(kernels, form, base) -> None:
    c = _table()
    arrays = build_tier(c, torch.tensor([1, 2, 70, 71]), form)  # words 0 and 1, 2 rows each
    arrays.directory[1] = base  # word 0's base: rows 1 and 2 resolve past the tier
    ids = torch.tensor([0, 1, 2, 70, 71, 100])
    rows, error = kernels.gather(c, ids, tier=Tier.of(arrays))
    assert error & ERR_TABLE
    fine = torch.tensor([0, 3, 4, 5])  # not in the tier, or in its intact word 1
    assert torch.equal(rows[fine], _cpu_rows(c, ids[fine]))
    assert not rows[1:3].any()  # nothing was staged for the corrupt rows: no slot was read

    offsets = torch.tensor([0, 2, 4, 6])
    got, error = kernels.pooled(c, ids, offsets, None, 0, 0, Grid(2, 2), tier=Tier.of(arrays))
    assert error & ERR_TABLE
    # The bag of intact rows pools as on the CPU.
    torch.testing.assert_close(got[2:], c.lookup(ids[4:], offsets[:2]), rtol=0, atol=0)


def test_a_corrupt_slot_offset_is_reported_not_read_through(kernels) -> None:
    c = _table()
    arrays = build_tier(c, torch.arange(4), "compressed")
    assert arrays.slot_offset is not None
    arrays.slot_offset[2] = 1 << 40  # slot 1 ends, and slot 2 starts, far past the payload
    rows, error = kernels.gather(c, torch.tensor([0, 1, 2, 3]), tier=Tier.of(arrays))
    assert error & ERR_TABLE
    assert torch.equal(rows[[0, 3]], _cpu_rows(c, torch.tensor([0, 3])))
