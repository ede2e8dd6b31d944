# SPDX-License-Identifier: Apache-2.0
"""Lossless is the contract: every table, every method, every chunk width comes back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ibpembed import codec, compress
from ibpembed._ops import ops
from tests.codec.tables import DIMS, DTYPES, KINDS, make_table, same_bits, tables

METHODS = ("ibpembed", "paper", "raw")


@given(
    table=tables(),
    method=st.sampled_from(METHODS),
    chunk_bits=st.sampled_from((None, 16, 32, 64)),
    align=st.sampled_from((1, 8, 32)),
    data=st.data(),
)
def test_round_trip_is_bit_exact(table, method, chunk_bits, align, data) -> None:
    c = compress(table, method=method, chunk_bits=chunk_bits, align=align)
    assert same_bits(c.decompress(), table)
    ids = torch.tensor(
        data.draw(st.lists(st.integers(0, table.shape[0] - 1), max_size=50)), dtype=torch.int64
    )
    assert same_bits(c.gather(ids), table[ids])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", DIMS)
def test_grid_round_trip(dtype: torch.dtype, kind: str, dim: int) -> None:
    table = make_table(dtype, 97, dim, kind, seed=dim)
    c = compress(table)
    assert same_bits(c.decompress(), table)


@pytest.mark.parametrize("rows", [1, 2, 31, 32, 33, 1000])
def test_row_counts_around_index_blocks(rows: int) -> None:
    table = make_table(torch.float32, rows, 16, "trained_like", seed=rows)
    c = compress(table)
    assert same_bits(c.decompress(), table)
    ids = torch.arange(rows - 1, -1, -1)
    assert same_bits(c.gather(ids), table.flip(0))


def test_gather_duplicates_unsorted_and_empty() -> None:
    table = make_table(torch.bfloat16, 200, 64, "trained_like", seed=1)
    c = compress(table)
    ids = torch.tensor([199, 0, 5, 5, 199, 17, 0])
    assert same_bits(c.gather(ids), table[ids])
    empty = c.gather(torch.empty(0, dtype=torch.int64))
    assert empty.shape == (0, 64) and empty.dtype == torch.bfloat16
    assert same_bits(c.gather(torch.tensor([3, 1], dtype=torch.int32)), table[[3, 1]])


def test_wide_rows_use_a_bigger_slot_unit() -> None:
    # 3000 fp32 = 12000-byte rows: 8-byte units would need > 255 units per row.
    table = make_table(torch.float32, 40, 3000, "trained_like", seed=2)
    c = compress(table, align=8)
    assert c.unit_bytes == 64
    assert same_bits(c.decompress(), table)


@pytest.mark.parametrize("dtype", DTYPES)
def test_incompressible_table_costs_only_index_and_metadata(dtype: torch.dtype) -> None:
    table = make_table(dtype, 512, 64, "random_bits", seed=3)
    c = compress(table)
    assert same_bits(c.decompress(), table)
    aligned_raw = c.num_rows * -(-c.row_bytes // c.unit_bytes) * c.unit_bytes
    assert c.payload_bytes <= aligned_raw + 16
    assert c.stored_bytes <= c.raw_bytes + c.index_bytes + c.metadata_bytes + 16


@pytest.mark.parametrize("row_bytes", [4, 20, 132, 250, 1000, 4100])
def test_incompressible_odd_widths_need_no_raw_padding(row_bytes: int) -> None:
    # fbgemm int8 rows are D + 4 bytes wide: raw slots must not be padded to an 8-byte unit.
    table = make_table(torch.uint8, 300, row_bytes, "random_bits", seed=row_bytes)
    c = compress(table)
    assert same_bits(c.decompress(), table)
    padding = c.payload_bytes - 16 - c.raw_bytes
    if row_bytes % 4 == 0 and row_bytes <= 4 * 255:
        assert padding <= 0
    else:  # no power-of-two unit divides the row within 255 units: under 1/255 of a row
        assert padding <= c.num_rows * (c.unit_bytes - 1)


def test_narrow_rows_get_a_fine_slot_unit() -> None:
    table = make_table(torch.bfloat16, 2000, 16, "trained_like", seed=9)
    fine, coarse = compress(table), compress(table, align=8)
    assert fine.unit_bytes < 8
    assert fine.stored_bytes < coarse.stored_bytes
    assert same_bits(fine.decompress(), table)


def test_compressible_table_really_shrinks_host_bytes() -> None:
    values = torch.randn(4096, 128) * 0.05
    table = values.to(torch.bfloat16).float()  # bf16-rounded fp32: 16 invariant low bits
    c = compress(table)
    assert c.compressed_rows == 4096
    assert c.savings > 0.4
    assert c.stored_bytes == c.payload_bytes + c.index_bytes + c.metadata_bytes
    # The index stays within 1.25 bytes per row plus one block base.
    assert c.index_bytes <= 1.25 * c.num_rows + 8 * 2


def test_sampling_is_seeded_and_lossless_on_rows_outside_the_sample() -> None:
    table = make_table(torch.float32, 5000, 32, "trained_like", seed=4)
    a = compress(table, sample_rows=100, seed=7)
    b = compress(table, sample_rows=100, seed=7)
    assert torch.equal(a.mask, b.mask) and torch.equal(a.payload, b.payload)
    assert same_bits(a.decompress(), table)


def test_quant_int8_rowwise_round_trip() -> None:
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 256, (300, 36), dtype=np.uint8)
    codes[:, 0:4] = np.frombuffer(np.array([0.01, -0.5], dtype=np.float16).tobytes(), np.uint8)
    table = torch.from_numpy(codes)
    c = compress(table, quant="int8_rowwise")
    assert same_bits(c.decompress(), table)


@given(table=tables())
def test_default_unit_is_the_coarsest_that_stores_the_sample_smallest(table) -> None:
    """fit_table sizes the candidates once at the finest unit and derives the rest: the unit it
    picks is the one a separate sizing at every candidate picks."""
    fit = codec.fit_table(table)
    rows = table.view(torch.uint8).view(table.shape[0], -1)
    units = codec.slot_unit_candidates(rows.shape[1], None)
    sizes = {
        u: int(ops.ibp_slot_bytes(rows, fit.chunk_bits, fit.mask, fit.bitval, u).sum())
        for u in units
    }
    assert fit.unit_bytes == max(u for u, s in sizes.items() if s == min(sizes.values()))
