# SPDX-License-Identifier: Apache-2.0
"""New versions of a decoded tier (row updates, refreshes): each version reads exactly its own
rows through its tier, the versions share one tier buffer, and a new version copies the rows of
the directory words it changes, not the tier (ibpembed.tables.tier_versions)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpembed import compress
from ibpembed.codec import CompressedTable, CompressedTableSet
from ibpembed.tables.store import TableStore
from tests.codec.tables import DTYPES, FLOAT_DTYPES, make_table, same_bits


def _tier_ids(rows: int, selection: str, rng: np.random.Generator) -> torch.Tensor:
    if selection == "all":
        return torch.arange(rows)
    keep = rng.random(rows) < {"sparse": 0.1, "dense": 0.7}[selection]
    return torch.from_numpy(np.flatnonzero(keep)).to(torch.int64)


def _check_version(table: CompressedTable, truth: torch.Tensor) -> None:
    every = torch.arange(truth.shape[0])
    assert same_bits(table.gather(every), truth)
    if truth.dtype in FLOAT_DTYPES:
        # Through a table set too, whose registration checks every directory word.
        ids = torch.cat([every, every.flip(0)])
        offsets = torch.cat([torch.arange(0, ids.numel(), 3), torch.tensor([ids.numel()])])
        bags = torch.tensor([[0, 0, offsets.numel() - 1]])
        (pooled,), _ = CompressedTableSet([table]).lookup(bags, ids, offsets)
        plain = compress(truth, method="raw")
        assert same_bits(pooled, plain.lookup(ids, offsets))


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.sampled_from((1, 63, 64, 65, 200, 333)),
    dim=st.sampled_from((1, 3, 16, 33)),
    selection=st.sampled_from(("sparse", "dense", "all")),
    steps=st.lists(
        st.tuples(st.sampled_from(("update", "refresh")), st.integers(1, 40)),
        min_size=1,
        max_size=10,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_pinned_version_reads_its_own_rows(dtype, rows, dim, selection, steps, seed) -> None:
    """Random row updates (of tier rows and others) and refreshes (rows entering and leaving,
    whole tiers and none), every version kept pinned: each reads exactly the rows it was
    published with, whether its tier's words were moved, appended or compacted (small tiers run
    out of spare slots within a few versions)."""
    rng = np.random.default_rng(seed)
    kind = "random_bits" if seed % 3 == 0 else "trained_like"
    values = make_table(dtype, rows, dim, kind, seed)
    tiered = compress(values).with_hot_rows(_tier_ids(rows, selection, rng))
    store = TableStore({"t": tiered}, {"t": "t"}, keep_versions=len(steps) + 1)
    truths = [values.clone()]
    with contextlib.ExitStack() as pinned:
        tables = [pinned.enter_context(store.acquire()).tables["t"]]
        for step, size in steps:
            truth = truths[-1]
            if step == "update":
                ids = torch.from_numpy(rng.choice(rows, min(size, rows), replace=False))
                new_rows = make_table(dtype, ids.numel(), dim, "random_bits", int(rng.integers(9)))
                truth = truth.clone()
                truth[ids] = new_rows
                store.update_rows("t", ids, new_rows)
            else:
                chosen = ("sparse", "dense", "all")[size % 3] if size % 5 else "none"
                held = _tier_ids(rows, chosen, rng) if chosen != "none" else torch.arange(0)
                store.set_hot_rows("t", held)
            truths.append(truth)
            tables.append(pinned.enter_context(store.acquire()).tables["t"])
        for table, truth in zip(tables, truths, strict=True):
            _check_version(table, truth)


def test_an_update_copies_the_words_it_touches_not_the_tier() -> None:
    rows, dim = 8192, 32
    values = make_table(torch.float32, rows, dim, "trained_like", 4)
    store = TableStore(
        {"t": compress(values).with_hot_rows(torch.arange(rows))}, {"t": "t"}, keep_versions=2
    )
    # A tier of every row is built without spare slots: its first update copies it into a
    # buffer with some.
    store.update_rows("t", torch.tensor([5]), torch.ones(1, dim))
    with store.acquire() as first:
        before = first.tables["t"]
    assert before.hot is not None
    store.update_rows("t", torch.tensor([700, 701, 4000]), torch.full((3, dim), 2.0))
    with store.acquire() as second:
        after = second.tables["t"]
    assert after.hot is not None
    assert after.hot.rows.data_ptr() == before.hot.rows.data_ptr()  # one buffer, shared
    assert after.hot.rows.shape[0] == before.hot.rows.shape[0] + 2 * 64  # two words moved
    # The older version holds its index and directory beside the shared buffers, not a tier.
    assert 0 < store.older_versions_bytes() < before.hot.bytes // 8
    expected = values.clone()
    expected[5] = 1.0
    _check_version(before, expected)
    expected[torch.tensor([700, 701, 4000])] = 2.0
    _check_version(after, expected)


def test_a_refresh_copies_the_words_where_rows_enter_or_leave() -> None:
    rows, dim = 8192, 32
    values = make_table(torch.float32, rows, dim, "trained_like", 5)
    store = TableStore({"t": compress(values)}, {"t": "t"})
    store.set_hot_rows("t", torch.arange(0, rows, 3))  # built with an eighth of its rows spare
    with store.acquire() as snap:
        before = snap.tables["t"]
    assert before.hot is not None and before.hot.bytes > before.hot.rows.nbytes
    ids = torch.cat([torch.arange(0, rows, 3), torch.tensor([1000, 5000])]).unique()
    ids = ids[ids != 3]  # rows 1000 and 5000 enter, 3 leaves: words 0, 15 and 78 change
    store.set_hot_rows("t", ids)
    with store.acquire() as snap:
        after = snap.tables["t"]
    assert after.hot is not None
    assert after.hot.rows.data_ptr() == before.hot.rows.data_ptr()
    moved = sum(int(((ids >= 64 * w) & (ids < 64 * (w + 1))).sum()) for w in (0, 15, 78))
    assert after.hot.rows.shape[0] == before.hot.rows.shape[0] + moved
    assert after.hot.ids.tolist() == ids.tolist()
    _check_version(after, values)
    _check_version(before, values)


def test_table_sets_reject_a_word_outside_the_tier() -> None:
    values = make_table(torch.float32, 256, 16, "trained_like", 6)
    store = TableStore({"t": compress(values).with_hot_rows(torch.arange(0, 256, 2))}, {"t": "t"})
    store.update_rows("t", torch.tensor([2]), torch.zeros(1, 16))
    store.update_rows("t", torch.tensor([130]), torch.zeros(1, 16))
    with store.acquire() as snap:
        table = snap.tables["t"]
    hot = table.hot
    assert hot is not None
    CompressedTableSet([table])  # the moved words pass the full check
    beyond = hot.directory.clone()
    beyond[5] = hot.rows.shape[0] - 10  # word 2's 32 rows would end past the tier
    handle = torch.classes.ibpembed.TableSet()
    with pytest.raises(ValueError, match=r"rows of word 2 at slot \d+, past the tier's"):
        handle.add(*table.op_args(), table.dtype_code, beyond, hot.rows)
