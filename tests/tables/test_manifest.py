# SPDX-License-Identifier: Apache-2.0
"""Manifests: every field type-checked, file names kept inside the set, and every entry checked
against the file it names (rows, width, dtype, quantisation, row range)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import (
    MANIFEST,
    RowRange,
    TableSetError,
    load_table_set,
    read_manifest,
)
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableStore
from tests.tables.helpers import trained_like
from tests.tables.test_cli import run


@pytest.fixture
def whole(tmp_path: Path) -> Path:
    """A version-1 set: table 't', 100 x 8 float32."""
    directory = tmp_path / "whole"
    pack_table_set(directory, TableSet((TableSource("t", trained_like(100, 8)),)), sample_rows=None)
    return directory


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    """A version-2 set: rows [50, 100) of a 100-row table 't'."""
    directory = tmp_path / "shard"
    table_set = TableSet((TableSource("t", trained_like(100, 8)),))
    pack_table_set(directory, table_set, sample_rows=None, shard=(1, 2))
    return directory


def edit(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the manifest with ``change`` applied to its parsed body."""
    body = json.loads((directory / MANIFEST).read_text())
    change(body)
    (directory / MANIFEST).write_text(json.dumps(body))


def set_fields(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda body: body["tables"]["t"].update(fields)


def test_fixtures_are_what_the_edits_assume(whole: Path, shard: Path) -> None:
    entry = read_manifest(whole).tables["t"]
    assert (entry.num_rows, entry.dim, entry.dtype, entry.quant) == (100, 8, "float32", None)
    assert read_manifest(shard).tables["t"].row_range == RowRange(50, 100, 100)


# -- an entry must describe the file it names --------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "fields", "field", "in_file"),
    [
        ("whole", {"num_rows": 99}, "num_rows", 100),
        ("whole", {"dim": 3}, "dim", 8),
        ("whole", {"dtype": "float16"}, "dtype", "float32"),
        ("whole", {"quant": "int8_rowwise"}, "quant", None),
        ("whole", {"row_start": 0, "total_rows": 200, "version": 2}, "total_rows", 100),
        ("shard", {"num_rows": 40}, "num_rows", 50),
        ("shard", {"row_start": 40}, "row_start", 50),
        ("shard", {"row_start": 0}, "row_start", 50),
        ("shard", {"total_rows": 200}, "total_rows", 100),
    ],
)
def test_an_entry_that_disagrees_with_its_file_is_refused(
    request, fixture: str, fields: dict[str, Any], field: str, in_file: Any, capsys
) -> None:
    directory: Path = request.getfixturevalue(fixture)
    version = fields.pop("version", None)

    def change(body: dict[str, Any]) -> None:
        body["tables"]["t"].update(fields)
        if version is not None:
            body["version"] = version

    edit(directory, change)
    read_manifest(directory)  # a consistent manifest on its own: only the file tells
    said = fields[field]
    expected = (
        rf"{MANIFEST}: table 't': {field} is {said!r} in the manifest but {in_file!r} in .*\.ibpt"
    )
    with pytest.raises(TableSetError, match=expected):
        load_table_set(directory)
    with pytest.raises(TableSetError, match=expected):
        TableStore.load(directory)
    assert run(["verify", str(directory)]) == 1
    assert f"{field} is {said!r} in the manifest" in capsys.readouterr().out  # a FAIL line
    assert run(["inspect", str(directory)]) == 1
    assert f"{field} is {said!r} in the manifest" in capsys.readouterr().err


def test_consistent_entries_load_with_their_row_ranges(whole: Path, shard: Path) -> None:
    with TableStore.load(shard).acquire() as snap:
        rows = snap.row_range("t")
        assert (rows.start, rows.end, rows.total) == (50, 100, 100)
    with TableStore.load(whole).acquire() as snap:
        assert snap.row_range("t").is_whole
    assert run(["verify", str(whole)]) == 0
    assert run(["verify", str(shard)]) == 0


# -- fields: types, presence, file names ---------------------------------------------------------


def _without(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda body: body["tables"]["t"].pop(key)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (set_fields(file="../whole/x.ibpt"), "field 'file' must be a plain file name"),
        (set_fields(file="/etc/passwd.ibpt"), "field 'file' must be a plain file name"),
        (set_fields(file="sub/t.ibpt"), "field 'file' must be a plain file name"),
        (set_fields(file=".t.tmp-1.ibpt"), "field 'file' must be a plain file name"),
        (set_fields(file="t.json"), "field 'file' must be a plain file name"),
        (set_fields(file=None), "field 'file' must be a plain file name"),
        (set_fields(file=7), "field 'file' must be a plain file name"),
        (set_fields(header_xxh3=12), "field 'header_xxh3' must be 16 lowercase hex digits"),
        (set_fields(num_rows="100"), "field 'num_rows' must be a positive integer, got '100'"),
        (set_fields(num_rows=True), "field 'num_rows' must be a positive integer"),
        (set_fields(num_rows=0), "field 'num_rows' must be a positive integer"),
        (set_fields(num_rows=1.5), "field 'num_rows' must be a positive integer"),
        (set_fields(dim=None), "field 'dim' must be a positive integer"),
        (set_fields(dtype=4), "field 'dtype' must be a dtype name"),
        (set_fields(quant=1), "field 'quant' must be null or a string"),
        (set_fields(pooling=["sum"]), "field 'pooling' must be null or a string"),
        (set_fields(feature_names="t"), "field 'feature_names' must be a list of strings"),
        (set_fields(feature_names=[1]), "field 'feature_names' must be a list of strings"),
        (set_fields(row_start="0"), "field 'row_start' must be a non-negative integer"),
        (set_fields(row_start=-1), "field 'row_start' must be a non-negative integer"),
        (set_fields(total_rows="x"), "field 'total_rows' must be null or a positive integer"),
        (_without("dim"), "field 'dim' is missing"),
        (set_fields(shape=[100, 8]), r"unknown field\(s\) \['shape'\]"),
        (lambda body: body["tables"].update(t=[1, 2]), "the entry must be a JSON object"),
        (lambda body: body.update(tables=[]), "field 'tables' must be a JSON object"),
        (lambda body: body.pop("features"), "field 'features' must be a JSON object"),
        (lambda body: body["features"].update(f=3), "feature 'f' must map to a table name"),
    ],
)
def test_malformed_fields_are_named(whole: Path, change, message: str, capsys) -> None:
    edit(whole, change)
    with pytest.raises(TableSetError, match=message) as error:
        read_manifest(whole)
    assert str(whole / MANIFEST) in str(error.value)
    with pytest.raises(TableSetError, match=message):
        TableStore.load(whole)
    for command in ("verify", "inspect"):
        assert run([command, str(whole)]) == 1  # an error line, not a traceback
        assert f"ibpembed {command}: error: {whole / MANIFEST}" in capsys.readouterr().err


def test_a_manifest_cannot_serve_another_sets_file(whole: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    body = json.loads((whole / MANIFEST).read_text())
    entry = body["tables"]["t"]
    for name in (f"../whole/{entry['file']}", str((whole / entry["file"]).resolve())):
        entry["file"] = name
        (other / MANIFEST).write_text(json.dumps(body))
        with pytest.raises(TableSetError, match="field 'file' must be a plain file name"):
            load_table_set(other)


def test_a_reload_of_a_malformed_manifest_is_refused_as_a_bad_set(whole: Path) -> None:
    store = TableStore.load(whole)
    edit(whole, set_fields(num_rows="100"))
    with pytest.raises(TableSetError, match="num_rows"):
        store.reload()
    assert store.version == 1
    with store.acquire() as snap:
        assert snap.tables["t"].num_rows == 100
        assert torch.equal(snap.tables["t"].gather(torch.tensor([3])), trained_like(100, 8)[3:4])
