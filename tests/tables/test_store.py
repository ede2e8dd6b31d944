# SPDX-License-Identifier: Apache-2.0
"""TableStore: snapshots, live reload, failed reloads, row updates, all under concurrent lookups."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpembed import _C, compress
from ibpembed.tables import format as tf
from ibpembed.tables import writer as tw
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import MANIFEST, TableSetError, read_manifest
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableBytes, TableSnapshot, TableStore
from ibpembed.tables.updates import MIN_SPILL_BYTES
from tests.codec.tables import make_table, stage_min_bytes_kept
from tests.tables.helpers import (
    flip_bit,
    mapped_from,
    same_bits,
    section_ranges,
    trained_like,
)

READERS = 4


def versioned_set(version: int, rows: int = 200) -> TableSet:
    """Two tables whose every value encodes ``version``: a mixed read shows up at once."""
    user = torch.full((rows, 8), float(version)) + torch.arange(rows)[:, None] * 1e-3
    item = torch.full((rows // 2, 4), float(version), dtype=torch.bfloat16)
    return TableSet(
        (
            TableSource("user", user.contiguous(), feature_names=("user_id", "user_hist")),
            TableSource("item", item.contiguous(), feature_names=("item_id",), pooling="mean"),
        )
    )


def pack(directory: Path, version: int) -> None:
    pack_table_set(directory, versioned_set(version), sample_rows=None)


@pytest.fixture
def table_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "set"
    pack(directory, 1)
    return directory


def snapshot_version(snap: TableSnapshot) -> set[float]:
    """The data versions a lookup sees across both tables of one snapshot."""
    _, user = snap.table_for_feature("user_hist")
    _, item = snap.table_for_feature("item_id")
    seen = set(user.gather(torch.tensor([0, 7, 199]))[:, 0].round().tolist())
    seen |= set(item.gather(torch.tensor([0, 99])).float()[:, 0].tolist())
    return seen


# -- basics ----------------------------------------------------------------------------------


def test_from_tables_defaults_features_to_table_names() -> None:
    weight = trained_like(50, 4)
    store = TableStore.from_tables({"t": compress(weight)})
    with store.acquire() as snap:
        name, table = snap.table_for_feature("t")
        assert name == "t" and same_bits(table.decompress(), weight)
        with pytest.raises(KeyError, match="unknown feature 'nope'"):
            snap.table_for_feature("nope")
    with pytest.raises(KeyError, match="feature 'f' maps to unknown table 'x'"):
        TableStore.from_tables({"t": compress(weight)}, {"f": "x"})


def test_load_maps_features_and_accounts_bytes(table_dir: Path) -> None:
    store = TableStore.load(table_dir, verify=True)
    with store.acquire() as snap:
        assert dict(snap.features) == {"user_id": "user", "user_hist": "user", "item_id": "item"}
        assert snapshot_version(snap) == {1.0}
        user = snap.tables["user"]
    acct = store.accounting()
    assert set(acct) == {"user", "item"}
    assert isinstance(acct["user"], TableBytes)
    assert acct["user"].raw == 200 * 8 * 4
    assert acct["user"].total == user.stored_bytes
    assert acct["user"].index == user.index_bytes and acct["user"].metadata == user.metadata_bytes
    assert acct["user"].ratio == pytest.approx(acct["user"].raw / acct["user"].total)
    assert acct["user"].savings == pytest.approx(1 - acct["user"].total / acct["user"].raw)


def test_snapshot_is_immutable(table_dir: Path) -> None:
    store = TableStore.load(table_dir)
    with store.acquire() as snap:
        with pytest.raises(TypeError):
            snap.tables["x"] = snap.tables["user"]  # type: ignore[index]
        with pytest.raises(AttributeError):
            snap.version = 5  # type: ignore[misc]


# -- reload ----------------------------------------------------------------------------------


def test_reload_publishes_a_new_version_only_when_the_set_changed(table_dir: Path) -> None:
    store = TableStore.load(table_dir)
    with store.acquire() as snap:
        old_user = snap.tables["user"]
    assert store.reload() is False  # nothing changed: same tables, same version
    with store.acquire() as snap:
        assert snap.version == 1 and snap.tables["user"] is old_user
    pack(table_dir, 2)
    assert store.reload() is True
    with store.acquire() as snap:
        assert snap.version == 2 and snapshot_version(snap) == {2.0}


def test_a_reload_that_fails_to_place_its_tables_is_retried_in_full(
    table_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TableStore.load(table_dir)
    pack(table_dir, 2)
    placed = store._placed

    def out_of_device_memory(tables, previous):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(store, "_placed", out_of_device_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        store.reload()
    with store.acquire() as snap:
        assert snap.version == 1 and snapshot_version(snap) == {1.0}
    monkeypatch.setattr(store, "_placed", placed)
    assert store.reload() is True  # not mistaken for an unchanged set
    with store.acquire() as snap:
        assert snap.version == 2 and snapshot_version(snap) == {2.0}


def test_old_version_is_released_when_its_last_lookup_ends(table_dir: Path) -> None:
    store = TableStore.load(table_dir)
    holding = store.acquire()
    old = holding.__enter__()
    old_ref = weakref.ref(old.tables["user"])
    pack(table_dir, 2)
    store.reload()
    assert store.live_versions() == {1, 2}
    assert snapshot_version(old) == {1.0}  # still readable: its mapping stays alive
    holding.__exit__(None, None, None)
    assert store.live_versions() == {2}
    del old, holding
    gc.collect()
    assert old_ref() is None


def _corrupt_table_file(directory: Path) -> None:
    path = next(directory.glob("user.*.ibpt"))
    begin, _ = section_ranges(path)["row_units"]
    flip_bit(path, begin)


def _missing_table_file(directory: Path) -> None:
    next(directory.glob("item.*.ibpt")).unlink()


def _bad_manifest(directory: Path) -> None:
    (directory / MANIFEST).write_text("{not json")


def _feature_to_missing_table(directory: Path) -> None:
    body = json.loads((directory / MANIFEST).read_text())
    body["features"]["ghost"] = "no_such_table"
    (directory / MANIFEST).write_text(json.dumps(body))


def _replaced_table_file(directory: Path) -> None:
    path = next(directory.glob("user.*.ibpt"))
    tw.pack_table(path, trained_like(10, 8), name="user")  # valid file, not the manifest's


@pytest.mark.parametrize(
    "damage",
    [
        _corrupt_table_file,
        _missing_table_file,
        _bad_manifest,
        _feature_to_missing_table,
        _replaced_table_file,
    ],
)
def test_failed_reload_keeps_serving_the_old_version(
    table_dir: Path, tmp_path: Path, damage
) -> None:
    store = TableStore.load(table_dir)
    new_dir = tmp_path / "next"
    pack(new_dir, 2)
    damage(new_dir)
    with pytest.raises(ValueError) as error:
        store.reload(new_dir)
    assert str(new_dir) in str(error.value)
    assert isinstance(error.value, (TableSetError, tf.TableFileError))
    assert store.version == 1
    with store.acquire() as snap:
        assert snapshot_version(snap) == {1.0}
    pack(table_dir, 3)
    assert store.reload()  # the store still reloads from its own directory afterwards
    with store.acquire() as snap:
        assert snap.version == 2 and snapshot_version(snap) == {3.0}


def test_reload_under_concurrent_lookups_never_mixes_versions(
    table_dir: Path, tmp_path: Path
) -> None:
    """Readers decode both whole tables per snapshot; every read must equal one version's
    tables bit for bit, and the reads must span several versions (they overlapped reloads)."""
    store = TableStore.load(table_dir)
    expected = {v: {t.name: t.weight for t in versioned_set(v).tables} for v in range(1, 6)}
    directories = []
    for version in range(2, 6):
        directory = tmp_path / f"v{version}"
        pack(directory, version)
        directories.append(directory)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[int] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                with store.acquire() as snap:
                    got = {name: table.decompress() for name, table in snap.tables.items()}
                version = round(float(got["user"][0, 0]))
                want = expected.get(version, {})
                if got.keys() != want.keys() or not all(same_bits(got[n], want[n]) for n in want):
                    raise AssertionError(f"a snapshot is not version {version} bit for bit")
                seen.append(version)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(READERS)]
    for t in threads:
        t.start()
    for version, directory in enumerate(directories, start=2):
        store.reload(directory)
        give_up = time.monotonic() + 10
        while version not in seen and not errors and time.monotonic() < give_up:
            time.sleep(0.001)  # until a reader has read this version (under the next reload)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert set(seen) >= {2, 3, 4, 5}, f"the reads missed versions: {sorted(set(seen))}"
    with store.acquire() as snap:
        assert snapshot_version(snap) == {5.0}


# -- row updates -----------------------------------------------------------------------------


@settings(max_examples=30)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.uint8]),
    rows=st.integers(1, 150),
    dim=st.sampled_from([1, 3, 8, 33]),
    seed=st.integers(0, 2**16),
    updates=st.lists(
        st.tuples(
            st.lists(st.integers(0, 10_000), min_size=0, max_size=40),
            st.sampled_from(["random_bits", "trained_like", "edge_values", "identical_rows"]),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_update_rows_is_lossless(dtype, rows, dim, seed, updates) -> None:
    reference = make_table(dtype, rows, dim, "trained_like", seed)
    store = TableStore.from_tables({"t": compress(reference)})
    reference = reference.clone()
    for step, (raw_ids, kind) in enumerate(updates):
        ids = torch.tensor(sorted({i % rows for i in raw_ids}), dtype=torch.int64)
        ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(step))]
        new_rows = make_table(dtype, max(ids.numel(), 1), dim, kind, seed + step)[: ids.numel()]
        store.update_rows("t", ids, new_rows)
        reference[ids] = new_rows
        with store.acquire() as snap:
            assert same_bits(snap.tables["t"].decompress(), reference)
            assert same_bits(snap.tables["t"].gather(ids), new_rows)


def test_update_rows_spills_then_compacts(tmp_path: Path) -> None:
    weight = trained_like(640, 16)
    store = TableStore.from_tables({"t": compress(weight)})
    reference = weight.clone()
    gen = torch.Generator().manual_seed(0)
    payload_buffers = set()
    for step in range(60):
        ids = torch.randperm(640, generator=gen)[:5]
        rows = torch.randn(5, 16, generator=gen) * (100.0 if step % 2 else 0.01)
        store.update_rows("t", ids, rows)
        reference[ids] = rows
        with store.acquire() as snap:
            payload_buffers.add(snap.tables["t"].payload.untyped_storage().data_ptr())
    # Several updates share one spill buffer; a full one is compacted into a new buffer.
    assert 1 < len(payload_buffers) < 60
    with store.acquire() as snap:
        assert same_bits(snap.tables["t"].decompress(), reference)
    store.save(tmp_path / "saved")
    reloaded = TableStore.load(tmp_path / "saved", verify=True)
    with reloaded.acquire() as snap:
        assert same_bits(snap.tables["t"].decompress(), reference)
    tf.verify_file(next((tmp_path / "saved").glob("t.*.ibpt")))


def test_update_of_a_mapped_table_then_reload_restores_the_file(table_dir: Path) -> None:
    store = TableStore.load(table_dir)
    ids = torch.tensor([0, 31, 32, 199])
    store.update_rows("user", ids, torch.full((4, 8), -7.0))
    with store.acquire() as snap:
        assert torch.equal(snap.tables["user"].gather(ids), torch.full((4, 8), -7.0))
    store.reload()  # updates are in memory; the directory wins on reload
    with store.acquire() as snap:
        assert snapshot_version(snap) == {1.0}


def test_update_rows_int8_rowwise_table() -> None:
    rows = torch.randint(0, 256, (70, 10), dtype=torch.uint8)
    rows[:, :4] = torch.tensor([0.02, -1.0], dtype=torch.float16).view(torch.uint8)
    store = TableStore.from_tables({"q": compress(rows, quant="int8_rowwise")})
    new = rows[:3].flip(1).contiguous()
    store.update_rows("q", torch.tensor([69, 0, 40]), new)
    with store.acquire() as snap:
        table = snap.tables["q"]
        assert table.quant == "int8_rowwise"
        assert torch.equal(table.gather(torch.tensor([69, 0, 40])), new)
        expected = rows.clone()
        expected[torch.tensor([69, 0, 40])] = new
        assert torch.equal(table.decompress(), expected)


@pytest.mark.parametrize(
    ("ids", "rows", "error"),
    [
        (torch.tensor([1, 1]), torch.zeros(2, 4), "distinct"),
        (torch.tensor([50]), torch.zeros(1, 4), r"\[0, 50\)"),
        (torch.tensor([-1]), torch.zeros(1, 4), r"\[0, 50\)"),
        (torch.tensor([1]), torch.zeros(1, 4, dtype=torch.float64), "float32"),
        (torch.tensor([1]), torch.zeros(1, 5), "float32"),
        (torch.tensor([[1]]), torch.zeros(1, 4), "1-D"),
        (torch.tensor([1.0]), torch.zeros(1, 4), "integer"),
    ],
)
def test_bad_updates_publish_nothing(ids, rows, error) -> None:
    weight = trained_like(50, 4)
    store = TableStore.from_tables({"t": compress(weight)})
    with pytest.raises((ValueError, TypeError), match=error):
        store.update_rows("t", ids, rows)
    with pytest.raises(KeyError, match="unknown table 'nope'"):
        store.update_rows("nope", torch.tensor([0]), torch.zeros(1, 4))
    assert store.version == 1
    with store.acquire() as snap:
        assert same_bits(snap.tables["t"].decompress(), weight)


def test_update_rows_under_concurrent_lookups() -> None:
    weight = trained_like(300, 8)
    store = TableStore.from_tables({"t": compress(weight)})
    # Expected content per version, recorded before the version is published.
    states = {1: weight.clone()}
    ids_all = torch.arange(300)
    stop = threading.Event()
    errors: list[BaseException] = []
    checks = [0]

    def reader() -> None:
        try:
            while not stop.is_set():
                with store.acquire() as snap:
                    got = snap.tables["t"].gather(ids_all)
                    pooled = snap.tables["t"].lookup(ids_all, lengths=torch.tensor([300]))
                    expected = states[snap.version]
                if not same_bits(got, expected):
                    raise AssertionError(f"version {snap.version}: rows differ")
                torch.testing.assert_close(
                    pooled, expected.sum(0, keepdim=True), rtol=1e-5, atol=1e-3
                )
                checks[0] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(READERS)]
    for t in threads:
        t.start()
    gen = torch.Generator().manual_seed(1)
    current = weight.clone()
    for step in range(40):
        ids = torch.randperm(300, generator=gen)[: 1 + step % 20]
        rows = torch.randn(ids.numel(), 8, generator=gen) * (0.05 if step % 3 else 50.0)
        current = current.clone()
        current[ids] = rows
        states[store.version + 1] = current
        store.update_rows("t", ids, rows)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert checks[0] > 0
    with store.acquire() as snap:
        assert snap.version == 41 and same_bits(snap.tables["t"].decompress(), current)


def test_put_table_adds_a_table_atomically() -> None:
    store = TableStore.from_tables({"a": compress(trained_like(40, 4))})
    weight = trained_like(20, 4, seed=5)
    store.put_table("b", compress(weight), {"b_feature": "b"})
    with store.acquire() as snap:
        name, table = snap.table_for_feature("b_feature")
        assert name == "b" and same_bits(table.decompress(), weight) and snap.version == 2


def test_save_keeps_pooling_and_file_metadata_of_updated_tables(tmp_path: Path) -> None:
    packed = torch.randint(0, 256, (100, 12), dtype=torch.uint8)
    table_set = TableSet(
        (
            TableSource("item", trained_like(100, 4), pooling="mean", origin="ckpt.pt"),
            TableSource("q4", packed, pooling="sum", origin="tbe", layout="fbgemm_int4_rowwise"),
        )
    )
    pack_table_set(tmp_path / "set", table_set, sample_rows=None)
    store = TableStore.load(tmp_path / "set")
    store.update_rows("item", torch.tensor([3]), torch.ones(1, 4))
    store.update_rows("q4", torch.tensor([5, 99]), packed[:2].flip(1).contiguous())

    def described(directory: Path) -> dict[str, tuple]:
        found = read_manifest(directory)
        metas = {n: tf.read_table(directory / e.file).meta for n, e in found.tables.items()}
        return {
            n: (e.pooling, metas[n]["pooling"], metas[n].get("origin"), metas[n].get("layout"))
            for n, e in found.tables.items()
        }

    want = {
        "item": ("mean", "mean", "ckpt.pt", None),
        "q4": ("sum", "sum", "tbe", "fbgemm_int4_rowwise"),
    }
    store.save(tmp_path / "saved")
    assert described(tmp_path / "saved") == want
    store.save(tmp_path / "set")  # in place, over the files it was loaded from
    assert described(tmp_path / "set") == want
    assert store.reload()  # the updated tables now come from the saved files
    store.update_rows("item", torch.tensor([4]), torch.ones(1, 4))
    store.save(tmp_path / "again")
    assert described(tmp_path / "again") == want
    with TableStore.load(tmp_path / "again", verify=True).acquire() as snap:
        assert torch.equal(snap.tables["item"].gather(torch.tensor([3, 4])), torch.ones(2, 4))
    # A table put in by hand keeps its pooling, not the old file's origin and layout.
    store.put_table("q4", compress(packed))
    store.save(tmp_path / "put")
    assert described(tmp_path / "put") == {**want, "q4": ("sum", "sum", None, None)}


def test_update_of_a_mapped_table_lets_go_of_the_mapping(table_dir: Path) -> None:
    store = TableStore.load(table_dir)
    user_file = str(next(table_dir.glob("user.*.ibpt")))
    with store.acquire() as snap:
        assert mapped_from(snap.tables["user"].mask.data_ptr()) == user_file
    store.update_rows("user", torch.tensor([5]), torch.ones(1, 8))
    with store.acquire() as snap:
        new = snap.tables["user"]
    del snap
    held = [new.payload, new.block_base, new.row_units, new.bitmask, new.mask, new.bitval]
    assert all(mapped_from(t.data_ptr()) != user_file for t in held)
    gc.collect()
    # Nothing of the old version is left: its file is unmapped (its disk space free once deleted).
    assert user_file not in Path("/proc/self/maps").read_text()
    assert str(next(table_dir.glob("item.*.ibpt"))) in Path("/proc/self/maps").read_text()


def test_accounting_counts_the_spill_areas_spare_room() -> None:
    store = TableStore.from_tables({"t": compress(trained_like(640, 16))})
    with store.acquire() as snap:
        assert store.accounting()["t"].stored == snap.tables["t"].payload_bytes
    store.update_rows("t", torch.tensor([100]), torch.ones(1, 16))
    with store.acquire() as snap:
        table = snap.tables["t"]
    sizes = store.accounting()["t"]
    buffer = table.payload.untyped_storage().nbytes()
    assert sizes.stored == buffer >= table.payload_bytes + MIN_SPILL_BYTES
    assert sizes.total == sizes.stored + sizes.index + sizes.metadata + sizes.hot
    assert sizes.total == table.stored_bytes + (buffer - table.payload_bytes)


def test_a_cpu_store_sizes_staged_reads_by_what_it_serves() -> None:
    # Publishing tells CPU lookups how many payload bytes the process serves (codec.h's
    # set_served_payload_bytes): a set within the last-level cache keeps the cache-sized rule.
    with stage_min_bytes_kept():
        _C.set_stage_min_bytes(0)
        TableStore.from_tables(
            {"t": compress(make_table(torch.float32, 64, 16, "trained_like", 0))}
        )
        assert _C.stage_min_bytes() == _C.default_stage_min_bytes()
