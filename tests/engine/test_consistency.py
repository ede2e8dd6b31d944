# SPDX-License-Identifier: Apache-2.0
"""The hot tier never serves a stale row: row updates (of rows in the tier), reloads and tier
publications run concurrently with lookups, and every row a lookup returns is bit-exact to the
table version that served it, pinned older versions included."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from ibpembed.codec import compress
from ibpembed.engine import FeatureQuery, LookupEngine, LookupOptions
from ibpembed.engine.requests import PackedRequest
from ibpembed.errors import VersionNotHeld
from ibpembed.tables.store import TableStore
from tests.codec.tables import same_bits

ROWS, DIM = 4096, 32
WRITES = 40
KEEP = 3


def _values(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, DIM, generator=gen) * 0.05


def _zipf(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.minimum(rng.zipf(1.2, n) - 1, ROWS - 1).astype(np.int64)


def test_updates_and_reloads_under_lookups_never_serve_a_stale_tier_row(tmp_path: Path) -> None:
    sets = {}
    for name, seed in (("a", 1), ("b", 2)):
        sets[name] = _values(seed)
        TableStore.from_tables({"t": compress(sets[name])}).save(tmp_path / name)
    store = TableStore.load(tmp_path / "a", keep_versions=KEEP)
    # The periodic publication is far off: the test publishes tiers itself, as often as it can.
    engine = LookupEngine(store, max_workers=1, hot_tier="10%", hot_tier_refresh_s=3600)
    assert engine.tier is not None
    expected = {store.version: sets["a"].clone()}  # version -> the rows it holds
    served: list[tuple[int, np.ndarray, torch.Tensor]] = []
    failures: list[BaseException] = []
    stop = threading.Event()
    hot_updates = 0

    def read(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                ids = _zipf(rng, 64)
                query = [FeatureQuery("t", ids, np.array([ids.size], np.int32))]
                pin = 0 if rng.random() < 0.7 else max(store.version - 1, 1)
                try:
                    result = engine.run(query, LookupOptions("none", table_version=pin))
                except VersionNotHeld:
                    continue
                served.append((result.version, ids, result.features[0].values))
        except BaseException as exc:
            failures.append(exc)

    def publish_tiers() -> None:
        try:
            while not stop.is_set():
                engine.tier.refresh()
        except BaseException as exc:
            failures.append(exc)

    def write() -> None:
        nonlocal hot_updates
        rng = np.random.default_rng(99)
        current, source = sets["a"].clone(), "a"
        try:
            for step in range(WRITES):
                if step % 10 == 9:  # a reload of the other table set
                    source = "b" if source == "a" else "a"
                    store.reload(tmp_path / source)
                    current = sets[source].clone()
                else:  # an update of rows the traffic keeps in the tier
                    with store.acquire() as snap:
                        hot = snap.tables["t"].hot
                    ids = torch.from_numpy(np.unique(_zipf(rng, 8)))
                    if hot is not None and bool(torch.isin(ids, hot.ids).any()):
                        hot_updates += 1
                    rows = torch.randn(ids.numel(), DIM) * 0.05
                    store.update_rows("t", ids, rows)
                    current[ids] = rows
                expected[store.version] = current.clone()
        except BaseException as exc:
            failures.append(exc)
        finally:
            stop.set()

    threads = [threading.Thread(target=read, args=(s,)) for s in (1, 2)]
    threads += [threading.Thread(target=publish_tiers), threading.Thread(target=write)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    engine.close()
    assert not failures, failures
    assert hot_updates > 0  # rows were updated while they sat in a published tier
    assert len({version for version, _, _ in served}) > WRITES // 4
    for version, ids, rows in served:
        assert same_bits(rows, expected[version][torch.from_numpy(ids)]), version
    with store.acquire() as snap:
        table = snap.tables["t"]
        every = torch.arange(ROWS)
        assert same_bits(table.gather(every), expected[snap.version][every])


def test_a_bad_setting_leaves_no_tier_thread_behind() -> None:
    store = TableStore.from_tables({"t": compress(torch.randn(256, 8))})
    before = {t for t in threading.enumerate() if "tier" in t.name}
    for _ in range(3):
        with pytest.raises(ValueError, match="hbm tier budget 'bogus'"):
            LookupEngine(store, hot_tier="1%", hbm_tier="bogus")
    assert {t for t in threading.enumerate() if "tier" in t.name} == before


def test_a_replaced_version_is_not_kept_alive_by_the_last_request() -> None:
    store = TableStore.from_tables({"t": compress(torch.randn(512, 16))})
    engine = LookupEngine(store, max_workers=1)
    try:
        one = PackedRequest(
            ["t"], np.array([1], np.int64), np.array([1], np.int32), np.array([1]), np.array([1])
        )
        engine.run(one, "sum")  # the pooled path caches what it planned for this version
        with store.acquire() as snap:
            old = weakref.ref(snap.tables["t"])
        del snap
        store.put_table("t", compress(torch.randn(512, 16)))
        gc.collect()
        assert old() is None
    finally:
        engine.close()


def test_older_versions_count_what_they_hold_beside_a_shared_payload() -> None:
    values = torch.randn(4096, 32) * 0.05
    store = TableStore({"t": compress(values)}, {"t": "t"}, keep_versions=2)
    store.update_rows("t", torch.tensor([100]), torch.zeros(1, 32))
    store.set_hot_rows("t", torch.arange(4096))
    store.update_rows("t", torch.tensor([200]), torch.ones(1, 32))  # the tier gets spare slots
    store.update_rows("t", torch.tensor([300]), torch.ones(1, 32))  # shares payload and tier
    with store.acquire(store.versions_held()[0]) as old, store.acquire() as new:
        o, n = old.tables["t"], new.tables["t"]
        assert o.payload.untyped_storage().data_ptr() == n.payload.untyped_storage().data_ptr()
        assert o.hot is not None and n.hot is not None
        assert o.hot.rows.data_ptr() == n.hot.rows.data_ptr()
        # Its index is its own; the buffers it shares with the current version count there.
        own = o.block_base.nbytes + o.row_units.nbytes + o.bitmask.nbytes
    assert own <= store.older_versions_bytes() < own + o.hot.rows.nbytes // 2
