# SPDX-License-Identifier: Apache-2.0
"""The hot-row overlay: lookups that read cached rows return exactly what decoding returns."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ibpembed import _C, compress
from ibpembed._ops import ops
from ibpembed.codec import CompressedTable, available_cpu_paths
from tests.codec.tables import POOLED_CASES, make_table, same_bits, tables


def _hot_subset(c: CompressedTable, rng: np.random.Generator, fraction: float) -> torch.Tensor:
    keep = rng.random(c.num_rows) < fraction
    return torch.from_numpy(np.flatnonzero(keep)).to(torch.int64)


@pytest.mark.usefixtures("restore_path")
@pytest.mark.parametrize("path", available_cpu_paths())
@given(
    table=tables(),
    code_bits=st.sampled_from((1, 2, 4)),
    fraction=st.sampled_from((0.0, 0.1, 0.5, 1.0)),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_with_hot_rows_is_bit_exact(path, table, code_bits, fraction, seed) -> None:
    """256 ids with duplicates (several rounds of the decode pipeline),
    some of them cached, the rest decoded from the payload."""
    _C.set_cpu_path(path)
    rng = np.random.default_rng(seed)
    c = compress(table, code_bits=code_bits)
    hot = c.with_hot_rows(_hot_subset(c, rng, fraction))
    ids = torch.from_numpy(rng.integers(0, table.shape[0], 256))
    assert same_bits(hot.gather(ids), table[ids])
    assert same_bits(hot.decompress(), table)


@pytest.mark.usefixtures("restore_path")
@pytest.mark.parametrize("path", available_cpu_paths())
@given(**POOLED_CASES)
def test_pooled_with_hot_rows_equals_pooled_without(path, dtype, dim, pooling, weighted, seed):
    """Same rows in the same order, so the fp32 sums agree bit for bit, not just within a bound."""
    _C.set_cpu_path(path)
    rng = np.random.default_rng(seed)
    table = make_table(dtype, 300, dim, "trained_like", seed)
    c = compress(table)
    hot = c.with_hot_rows(_hot_subset(c, rng, 0.3))
    lengths = torch.from_numpy(rng.integers(0, 40, 64))
    ids = torch.from_numpy(rng.integers(0, 300, int(lengths.sum())))
    weights = torch.rand(ids.numel()) if weighted else None
    got = hot.lookup(ids, None, weights, pooling, lengths=lengths)
    assert same_bits(got, c.lookup(ids, None, weights, pooling, lengths=lengths))


@pytest.mark.usefixtures("restore_path")
@pytest.mark.parametrize("path", available_cpu_paths())
@pytest.mark.parametrize(
    "selection",
    ["word_edges", "every_64th", "all", "random"],
)
def test_directory_across_many_words(path, selection) -> None:
    """1000 rows = 16 directory words: rows either side of word edges, one row per word, every
    row, and a random 30 %."""
    _C.set_cpu_path(path)
    table = make_table(torch.float32, 1000, 16, "trained_like", 4)
    c = compress(table, code_bits=2)
    chosen = {
        "word_edges": torch.tensor([0, 63, 64, 127, 128, 511, 512, 959, 960, 999]),
        "every_64th": torch.arange(0, 1000, 64),
        "all": torch.arange(1000),
        "random": torch.from_numpy(np.flatnonzero(np.random.default_rng(4).random(1000) < 0.3)),
    }[selection]
    hot = c.with_hot_rows(chosen)
    assert hot.hot is not None and hot.hot.count == int(c.is_compressed(chosen).sum())
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, 1000, 2000))
    assert same_bits(hot.gather(ids), table[ids])
    offsets = torch.arange(0, 2001, 10)
    assert same_bits(hot.lookup(ids, offsets), c.lookup(ids, offsets))


def test_overlay_keeps_only_compressed_rows_in_row_order() -> None:
    table = make_table(torch.float32, 200, 16, "trained_like", 1)
    c = compress(table)
    wanted = torch.tensor([199, 63, 64, 0, 63, 127, 128])
    hot = c.with_hot_rows(wanted)
    assert hot.hot is not None
    compressed = {r for r in wanted.tolist() if (int(c.bitmask[r // 32]) >> (r % 32)) & 1}
    assert hot.hot.ids.tolist() == sorted(compressed)
    assert same_bits(hot.hot.rows.view(torch.float32), table[hot.hot.ids])
    assert hot.hot_bytes == hot.hot.rows.numel() + 8 * (hot.hot.count + 2 * 4)
    assert hot.stored_bytes == c.stored_bytes  # the overlay is counted apart
    assert hot.payload is c.payload  # shared, not copied
    assert hot.without_hot_rows().hot is None and c.without_hot_rows() is c


def test_raw_rows_and_empty_selections_give_no_overlay() -> None:
    table = torch.randn(100, 8)
    assert compress(table, method="raw").with_hot_rows(torch.arange(100)).hot is None
    assert compress(table).with_hot_rows(torch.tensor([], dtype=torch.int64)).hot is None


@pytest.mark.parametrize("bad", [[-1], [100], [3, 1000]])
def test_hot_row_ids_out_of_range_raise(bad) -> None:
    c = compress(torch.randn(100, 8))
    with pytest.raises(IndexError, match=r"\[0, 100\)"):
        c.with_hot_rows(torch.tensor(bad))


def test_ops_reject_an_inconsistent_overlay() -> None:
    c = compress(make_table(torch.float32, 200, 16, "trained_like", 2))
    hot = c.with_hot_rows(torch.arange(0, 200, 3)).hot
    assert hot is not None
    ids = torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match="pass both or neither"):
        ops.ibp_gather(*c._args(), ids, hot.directory, None)
    with pytest.raises(ValueError, match="two per 64 rows"):
        ops.ibp_gather(*c._args(), ids, hot.directory[:-2], hot.rows)
    with pytest.raises(ValueError, match="cached rows but hot_rows holds"):
        ops.ibp_gather(*c._args(), ids, hot.directory, hot.rows[1:])
    with pytest.raises(ValueError, match=r"hot_rows must be \[cached rows, 64\]"):
        ops.ibp_gather(*c._args(), ids, hot.directory, hot.rows[:, :8].contiguous())
    with pytest.raises(ValueError, match="hot_dir must be"):
        ops.lookup_pooled(
            *c._args(), ids, torch.tensor([0, 3]), None, 0, 0, hot.directory.int(), hot.rows
        )


@pytest.mark.usefixtures("restore_path")
@pytest.mark.parametrize("path", available_cpu_paths())
def test_lookups_read_the_overlay(path) -> None:
    """Tampered cached rows show up in the results: the equality tests above are not passing
    because the overlay is ignored."""
    _C.set_cpu_path(path)
    table = make_table(torch.float32, 300, 16, "trained_like", 3)
    c = compress(table)
    hot = c.with_hot_rows(torch.arange(0, 300, 2))
    assert hot.hot is not None
    tampered = dataclasses.replace(hot.hot, rows=torch.full_like(hot.hot.rows, 0x3F))
    marked = dataclasses.replace(hot, hot=tampered)
    ids = torch.arange(300).repeat(2)  # 600 ids: the vector decoder's batch size too
    got = marked.gather(ids).view(torch.uint8).reshape(600, -1)
    cached = torch.isin(ids, hot.hot.ids)
    assert bool((got[cached] == 0x3F).all())
    assert same_bits(got[~cached].view(torch.float32), table[ids[~cached]])
    pooled = marked.lookup(hot.hot.ids[:1], torch.tensor([0, 1]))
    assert bool((pooled.view(torch.uint8) == 0x3F).all())
