# SPDX-License-Identifier: Apache-2.0
"""``pack --merge``: replace or add some tables of a set, keep the rest (whole and sharded sets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import (
    LOCK_FILE,
    MANIFEST,
    SHARD_MAP,
    TableSetError,
    read_manifest,
)
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.shards import pack_shards
from ibpembed.tables.store import TableStore
from tests.tables.helpers import same_bits, trained_like
from tests.tables.test_cli import run


def source(name: str, seed: int, rows: int = 120, features: tuple[str, ...] = ()) -> TableSource:
    """Rows that differ with ``seed``: a merge that kept an old table shows in its bits."""
    return TableSource(name, trained_like(rows, 8, seed=seed), feature_names=features)


def tables_of(directory: Path) -> dict[str, torch.Tensor]:
    with TableStore.load(directory, verify=True).acquire() as snap:
        return {name: t.decompress() for name, t in snap.tables.items()}


def test_merge_replaces_one_table_and_keeps_the_others_files(tmp_path: Path) -> None:
    a, b, b2, c = source("a", 1, features=("fa",)), source("b", 2), source("b", 3), source("c", 4)
    assert not same_bits(b.weight, b2.weight)
    pack_table_set(tmp_path, TableSet((a, b)), sample_rows=None)
    before = read_manifest(tmp_path).tables
    pack_table_set(tmp_path, TableSet((b2, c)), sample_rows=None, merge=True)
    manifest = read_manifest(tmp_path)
    assert manifest.tables["a"].file == before["a"].file  # untouched: a server reuses its mapping
    assert manifest.tables["b"].file != before["b"].file  # replaced
    assert dict(manifest.features) == {"fa": "a", "b": "b", "c": "c"}
    got = tables_of(tmp_path)
    assert got.keys() == {"a", "b", "c"}
    for want in (a, b2, c):
        assert same_bits(got[want.name], want.weight)
    # Only the files the manifest names are left: b's old file was swept.
    files = {p.name for p in tmp_path.glob("*.ibpt")}
    assert files == {e.file for e in manifest.tables.values()}


def test_without_merge_the_set_is_replaced(tmp_path: Path) -> None:
    pack_table_set(tmp_path, TableSet((source("a", 1), source("b", 2))), sample_rows=None)
    pack_table_set(tmp_path, TableSet((source("b", 3),)), sample_rows=None)
    assert set(read_manifest(tmp_path).tables) == {"b"}


def test_merge_into_an_empty_directory_is_a_plain_pack(tmp_path: Path) -> None:
    pack_table_set(tmp_path / "new", TableSet((source("a", 1),)), sample_rows=None, merge=True)
    assert set(read_manifest(tmp_path / "new").tables) == {"a"}


def test_a_feature_two_tables_claim_needs_an_explicit_mapping(tmp_path: Path) -> None:
    pack_table_set(tmp_path, TableSet((source("a", 1, features=("f",)),)), sample_rows=None)
    before = (tmp_path / MANIFEST).read_bytes()
    claim = source("c", 2, features=("f",))
    with pytest.raises(TableSetError, match="feature 'f' of table 'c' is already served by"):
        pack_table_set(tmp_path, TableSet((claim,)), sample_rows=None, merge=True)
    assert (tmp_path / MANIFEST).read_bytes() == before  # nothing published, nothing left
    assert len(list(tmp_path.glob("*.ibpt"))) == 1
    remap = TableSet((source("c", 2),), extra_features={"f": "c"})
    pack_table_set(tmp_path, remap, sample_rows=None, merge=True)
    assert dict(read_manifest(tmp_path).features) == {"f": "c", "c": "c"}


def test_merge_keeps_every_shards_other_tables_and_the_shard_map(tmp_path: Path) -> None:
    a, b, b2 = source("a", 1, rows=100), source("b", 2, rows=10), source("b", 3, rows=31)
    address = "shard-{shard}:50051"
    pack_shards(tmp_path, TableSet((a, b)), 3, address_template=address, sample_rows=None)
    pack_shards(tmp_path, TableSet((b2,)), 3, sample_rows=None, merge=True)
    body = json.loads((tmp_path / SHARD_MAP).read_text())
    assert set(body["tables"]) == {"a", "b"} and body["tables"]["b"]["num_rows"] == 31
    assert [s["address"] for s in body["shards"]] == [address.format(shard=k) for k in range(3)]
    rows = {"a": [], "b": []}
    for k in range(3):
        for name, values in tables_of(tmp_path / f"shard-{k}-of-3").items():
            rows[name].append(values)
    assert same_bits(torch.cat(rows["a"]), a.weight) and same_bits(torch.cat(rows["b"]), b2.weight)
    with pytest.raises(TableSetError, match="a merge must keep them"):
        pack_shards(tmp_path, TableSet((b2,)), 2, sample_rows=None, merge=True)


def test_a_sharded_merge_checks_every_shard_before_publishing_any(tmp_path: Path) -> None:
    tiny = source("tiny", 1, rows=1, features=("ft",))  # only in the last shard
    pack_shards(tmp_path, TableSet((source("a", 2, rows=30), tiny)), 3, sample_rows=None)
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*.json"))}
    claim = TableSet((source("x", 3, rows=30, features=("ft",)),))
    with pytest.raises(TableSetError, match="feature 'ft' of table 'x'"):
        pack_shards(tmp_path, claim, 3, sample_rows=None, merge=True)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*.json"))} == before


def test_cli_merge_flag(tmp_path: Path) -> None:
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    torch.save({"t_a": trained_like(50, 8)}, first)
    torch.save({"t_b": trained_like(60, 8)}, second)
    out = tmp_path / "set"
    assert run(["pack", str(first), "-o", str(out), "--no-progress"]) == 0
    assert run(["pack", str(second), "-o", str(out), "--no-progress", "--merge"]) == 0
    assert set(read_manifest(out).tables) == {"t_a", "t_b"}


def test_a_repacked_table_keeps_its_aliases_unless_remapped(tmp_path: Path) -> None:
    aliased = TableSet((source("a", 1), source("b", 2)), extra_features={"fa": "a", "fb": "b"})
    pack_table_set(tmp_path, aliased, sample_rows=None)
    pack_table_set(tmp_path, TableSet((source("a", 3),)), sample_rows=None, merge=True)
    assert dict(read_manifest(tmp_path).features) == {"a": "a", "b": "b", "fa": "a", "fb": "b"}
    remap = TableSet((source("a", 4),), extra_features={"fb": "a"})
    pack_table_set(tmp_path, remap, sample_rows=None, merge=True)
    assert dict(read_manifest(tmp_path).features) == {"a": "a", "b": "b", "fa": "a", "fb": "a"}


def test_a_sharded_merge_keeps_the_aliases_of_repacked_tables(tmp_path: Path) -> None:
    aliased = TableSet((source("a", 1, rows=30),), extra_features={"fa": "a"})
    pack_shards(tmp_path, aliased, 2, sample_rows=None)
    pack_shards(tmp_path, TableSet((source("a", 2, rows=30),)), 2, sample_rows=None, merge=True)
    assert json.loads((tmp_path / SHARD_MAP).read_text())["features"] == {"a": "a", "fa": "a"}
    for k in range(2):
        assert dict(read_manifest(tmp_path / f"shard-{k}-of-2").features) == {"a": "a", "fa": "a"}


def _files(directory: Path) -> dict[Path, bytes]:
    """Every file under ``directory`` and its bytes, but the lock a refused pack may create."""
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file() and p.name != LOCK_FILE}


def test_a_merge_must_keep_the_sets_layout(tmp_path: Path, capsys) -> None:
    """A sharded set merged without --shards, or a whole one with --shards, keeps nothing of
    the set it merges into: refused, with nothing written."""
    torch.save({"t": trained_like(50, 8)}, tmp_path / "t.pt")
    torch.save({"u": trained_like(60, 8)}, tmp_path / "u.pt")
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    pack = ["pack", str(tmp_path / "t.pt"), "--no-progress"]
    assert run([*pack, "-o", str(sharded), "--shards", "2"]) == 0
    assert run([*pack, "-o", str(whole)]) == 0
    capsys.readouterr()
    before = {d: _files(d) for d in (sharded, whole)}
    merge = ["pack", str(tmp_path / "u.pt"), "--no-progress", "--merge"]
    assert run([*merge, "-o", str(sharded)]) == 1
    err = capsys.readouterr().err
    assert f"{sharded / SHARD_MAP}: the set has 2 shards; a merge must keep them" in err
    assert run([*merge, "-o", str(whole), "--shards", "2"]) == 1
    err = capsys.readouterr().err
    assert f"{whole / MANIFEST}: the set is not split into shards; a merge must" in err
    assert {d: _files(d) for d in (sharded, whole)} == before
    assert run([*merge, "-o", str(sharded), "--shards", "2"]) == 0
    assert set(json.loads((sharded / SHARD_MAP).read_text())["tables"]) == {"t", "u"}


def test_a_feature_of_a_kept_table_needs_that_table_packed(tmp_path: Path, capsys) -> None:
    """--feature maps to the tables a pack packs; a merge keeps the others as they are, so an
    alias of one is refused saying so, and packing that table again maps it."""
    torch.save({"t": trained_like(50, 8)}, tmp_path / "t.pt")
    torch.save({"u": trained_like(60, 8)}, tmp_path / "u.pt")
    out = tmp_path / "set"
    assert run(["pack", str(tmp_path / "t.pt"), "-o", str(out), "--no-progress"]) == 0
    merge = ["-o", str(out), "--no-progress", "--merge", "--feature", "alias=t"]
    assert run(["pack", str(tmp_path / "u.pt"), *merge]) == 1
    err = capsys.readouterr().err
    assert "feature 'alias' maps to table 't', which is not among the tables packed ['u']" in err
    assert "for a table a merge keeps, pack that table again" in err
    assert run(["pack", str(tmp_path / "t.pt"), str(tmp_path / "u.pt"), *merge]) == 0
    assert read_manifest(out).features["alias"] == "t"
