# SPDX-License-Identifier: Apache-2.0
"""CompressedTableSet: several tables' pooled lookups in one op call, bit for bit what each
table's own lookup gives, with every argument checked before any table is read."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpembed import _C, compress, cpu_path
from ibpembed.codec import CompressedTable, CompressedTableSet, available_cpu_paths
from tests.codec.tables import FLOAT_DTYPES, KINDS, make_table


def _table(draw: st.DrawFn, seed: int) -> CompressedTable:
    rows = draw(st.integers(1, 80))
    if draw(st.integers(0, 5)) == 0:  # fbgemm row-wise int8: fp16 scale and bias, then codes
        codes = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (rows, 12)))
        header = torch.tensor([0.01, -0.5], dtype=torch.float16).view(torch.uint8)
        raw = torch.cat([header.expand(rows, 4), codes.to(torch.uint8)], dim=1).contiguous()
        return compress(raw, quant="int8_rowwise")
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    dim = draw(st.sampled_from((1, 3, 16, 33, 129)))
    kind = draw(st.sampled_from(KINDS))
    table = compress(
        make_table(dtype, rows, dim, kind, seed),
        chunk_bits=draw(st.sampled_from((None, 16, 32, 64))),
        code_bits=draw(st.sampled_from((None, 1, 3))),
    )
    if draw(st.booleans()):
        table = table.with_hot_rows(torch.arange(0, rows, 3))
    return table


@st.composite
def _calls(draw: st.DrawFn):
    seed = draw(st.integers(0, 2**32 - 1))
    tables = [_table(draw, seed + i) for i in range(draw(st.integers(1, 4)))]
    rng = np.random.default_rng(seed)
    # The call's tables: any of the set, in any order, a table possibly twice.
    picks = draw(st.lists(st.integers(0, len(tables) - 1), min_size=0, max_size=5))
    ids, lengths, first_bags, bag_counts = [], [], [], []
    for pick in picks:
        bags = int(rng.integers(0, 6))
        counts = rng.integers(0, 5, bags)
        first_bags.append(sum(len(x) for x in lengths))
        bag_counts.append(bags)
        lengths.append(counts)
        ids.append(rng.integers(0, tables[pick].num_rows, int(counts.sum())))
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int64)
    all_ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64)
    weights = None
    if draw(st.booleans()):
        weights = torch.from_numpy(rng.uniform(-2, 2, all_ids.size).astype(np.float32))
    pooling = draw(st.sampled_from(("sum", "mean")))
    return tables, picks, all_ids, offsets, first_bags, bag_counts, weights, pooling


@pytest.mark.parametrize("path", available_cpu_paths())
@settings(max_examples=40, deadline=None)
@given(call=_calls())
def test_one_call_equals_each_tables_own_lookup(path: str, call) -> None:
    tables, picks, ids, offsets, first_bags, bag_counts, weights, pooling = call
    table_set = CompressedTableSet(tables)
    ids_t, offsets_t = torch.from_numpy(ids), torch.from_numpy(offsets)
    before = cpu_path()
    try:
        _C.set_cpu_path(path)
        table_bags = torch.tensor(
            list(zip(picks, first_bags, bag_counts, strict=True)), dtype=torch.int64
        )
        values, seconds = table_set.lookup(
            table_bags.view(-1, 3), ids_t, offsets_t, weights, pooling
        )
    finally:
        _C.set_cpu_path(before)
    assert len(values) == len(seconds) == len(picks)
    assert all(s >= 0 for s in seconds)
    for pick, got, first, count in zip(picks, values, first_bags, bag_counts, strict=True):
        begin, end = int(offsets[first]), int(offsets[first + count])
        want = tables[pick].lookup(
            ids_t[begin:end],
            offsets_t[first : first + count + 1] - begin,
            None if weights is None else weights[begin:end],
            pooling,
        )
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.fixture(scope="module")
def table_set() -> CompressedTableSet:
    return CompressedTableSet([compress(torch.randn(10, 4)), compress(torch.randn(20, 8).half())])


IDS = torch.tensor([1, 2, 3, 15])
OFFSETS = torch.tensor([0, 2, 3, 4])


def _bags(*rows: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).view(-1, 3)


@pytest.mark.parametrize(
    ("bags", "offsets", "error", "match"),
    [
        (_bags((2, 0, 1)), OFFSETS, IndexError, "table 2 is not in this TableSet of 2"),
        (_bags((0, 2, 2)), OFFSETS, ValueError, r"table_bags\[0\] reads bags \[2, 4\)"),
        (_bags((0, -1, 1)), OFFSETS, ValueError, r"reads bags \[-1, 0\)"),
        (torch.zeros(2, 2, dtype=torch.int64), OFFSETS, ValueError, r"\[K, 3\]"),
        (_bags((1, 0, 2), (0, 2, 1)), OFFSETS, IndexError, r"index 15 .*table_bags\[1\]"),
        (_bags((0, 0, 3)), torch.tensor([0, 2, 1, 4]), ValueError, "non-decreasing"),
        (_bags((0, 0, 2)), torch.tensor([0, 4, 5]), ValueError, r"offsets\[-1\]"),
    ],
)
def test_bad_calls_are_refused_before_any_table_is_read(
    table_set, bags, offsets, error, match
) -> None:
    with pytest.raises(error, match=match):
        table_set.lookup(bags, IDS, offsets)


def test_bad_weights_and_pooling(table_set) -> None:
    args = (_bags((0, 0, 3)), IDS, OFFSETS)
    with pytest.raises(TypeError, match="float32"):
        table_set.lookup(*args, weights=torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="one weight per index"):
        table_set.lookup(*args, weights=torch.ones(3))
    with pytest.raises(ValueError, match="pooling"):
        table_set.lookup(*args, pooling="none")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="table_bags must be an integer tensor"):
        table_set.lookup(_bags((0, 0, 3)).double(), IDS, OFFSETS)  # 1.9 bags is no count


def test_only_poolable_tables_join_a_set() -> None:
    with pytest.raises(TypeError, match="cannot be pooled"):
        CompressedTableSet([compress(torch.randint(0, 255, (10, 8), dtype=torch.uint8))])


def test_a_set_keeps_its_tables_memory_alive() -> None:
    weight = torch.randn(5000, 16)
    table_set = CompressedTableSet([compress(weight)])
    table_set.tables = ()  # the op's own references are all that is left of the table
    gc.collect()
    torch.randn(5000, 16)  # reuse freed memory, if the set had let it go
    got, _ = table_set.lookup(_bags((0, 0, 1)), torch.tensor([3, 7]), torch.tensor([0, 2]))
    torch.testing.assert_close(got[0], weight[[3, 7]].sum(0, keepdim=True))
