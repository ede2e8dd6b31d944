# SPDX-License-Identifier: Apache-2.0
"""The store's side of the hot tier: publishing a tier keeps the version and the payload, row
updates reach tier rows, reloads and put_table drop tiers of replaced rows."""

from __future__ import annotations

import torch

from ibpembed.codec import compress
from ibpembed.tables.store import TableStore
from tests.codec.tables import same_bits
from tests.tables.helpers import with_a_raw_row

ROWS, DIM = 4096, 32


def test_update_rows_reaches_cached_rows_and_spares_the_old_version() -> None:
    values = with_a_raw_row(ROWS, DIM)
    store = TableStore.from_tables({"t": compress(values)})
    store.set_hot_rows("t", torch.tensor([1, 2, 3, 100, 4000]))
    with store.acquire() as before:
        new_rows = torch.randn(3, DIM) * 0.05
        store.update_rows("t", torch.tensor([100, 2, 50]), new_rows)
        old = before.tables["t"]
    with store.acquire() as snap:
        table = snap.tables["t"]
    expected = values.clone()
    expected[torch.tensor([100, 2, 50])] = new_rows
    every = torch.arange(ROWS)
    assert same_bits(table.gather(every), expected)
    assert same_bits(old.gather(every), values)
    assert table.hot is not None and table.hot.ids.tolist() == [1, 2, 3, 100, 4000]


def test_row_updates_keep_their_spare_area_across_hot_row_refreshes() -> None:
    """Publishing copies keeps the payload: the next update appends to its spare area instead
    of copying the whole payload into a new buffer."""
    values = with_a_raw_row(ROWS, DIM)
    store = TableStore.from_tables({"t": compress(values)})
    store.update_rows("t", torch.tensor([100]), torch.full((1, DIM), 0.5))
    buffer = store._updates._spill["t"].buffer
    store.set_hot_rows("t", torch.arange(0, 100))
    store.update_rows("t", torch.tensor([200]), torch.full((1, DIM), 0.25))
    assert store._updates._spill["t"].buffer is buffer
    expected = values.clone()
    expected[100], expected[200] = 0.5, 0.25
    with store.acquire() as snap:
        assert same_bits(snap.tables["t"].gather(torch.arange(ROWS)), expected)


def test_reload_keeps_copies_of_unchanged_tables_and_put_table_drops_them(tmp_path) -> None:
    values = with_a_raw_row(ROWS, DIM)
    TableStore.from_tables(
        {"t": compress(values), "u": compress(with_a_raw_row(ROWS, DIM, seed=1))}
    ).save(tmp_path)
    store = TableStore.load(tmp_path)
    store.set_hot_rows("t", torch.arange(0, 300))
    store.reload()  # same files: the table objects, copies included, are kept
    with store.acquire() as snap:
        assert snap.tables["t"].hot is not None
        assert same_bits(snap.tables["t"].gather(torch.arange(ROWS)), values)
    replacement = with_a_raw_row(ROWS, DIM, seed=2)
    store.put_table("t", compress(replacement))  # new rows: no copies of the old ones
    with store.acquire() as snap:
        assert snap.tables["t"].hot is None
        assert same_bits(snap.tables["t"].gather(torch.arange(ROWS)), replacement)
