# SPDX-License-Identifier: Apache-2.0
"""``pack --shards``: the split, shard manifests (version 2), shard_map.json, store and engine."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ibpembed.engine import FeatureQuery, LookupEngine
from ibpembed.errors import InvalidArgument
from ibpembed.tables import format as tf
from ibpembed.tables.manifest import (
    MANIFEST,
    SHARD_MAP,
    RowRange,
    TableSetError,
    read_manifest,
    split_rows,
)
from ibpembed.tables.shards import pack_shards
from ibpembed.tables.store import TableStore
from tests.sharding.conftest import Packed
from tests.sharding.helpers import SHARDS

PACK = [sys.executable, "-m", "ibpembed.cli", "pack"]
SPLITS = [(1, 1), (2, 3), (10, 3), (1000, 3), (1001, 3), (7, 7), (64, 5)]


@pytest.mark.parametrize(("rows", "shards"), SPLITS)
def test_split_rows_is_contiguous_balanced_and_complete(rows, shards):
    ranges = split_rows(rows, shards)
    assert len(ranges) == shards
    assert ranges[0].start == 0 and ranges[-1].end == rows
    assert all(a.end == b.start for a, b in itertools.pairwise(ranges))
    sizes = [r.end - r.start for r in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert all(r.total == rows for r in ranges)


def shard_dir(packed: Packed, k: int) -> Path:
    return packed.sharded / f"shard-{k}-of-{SHARDS}"


def test_shard_manifests_record_ranges_and_rows_are_the_source_slices(packed):
    for source in packed.table_set.tables:
        n = source.weight.shape[0]
        expected = [r for r in split_rows(n, SHARDS) if r.start < r.end]
        found = []
        for k in range(SHARDS):
            manifest = read_manifest(shard_dir(packed, k))
            entry = manifest.tables.get(source.name)
            if entry is None:
                continue
            rows = entry.row_range
            found.append(rows)
            assert entry.total_rows == n
            assert set(entry.feature_names) <= set(manifest.features)
            loaded = tf.read_table(shard_dir(packed, k) / entry.file, verify=True)
            assert loaded.meta["row_start"] == rows.start and loaded.meta["total_rows"] == n
            got = loaded.table.decompress().view(torch.uint8)
            assert torch.equal(got, source.weight[rows.start : rows.end].view(torch.uint8))
        assert found == expected
    # emb_tiny (2 rows) has no row in shard 0: left out there, with its feature.
    assert "emb_tiny" not in read_manifest(shard_dir(packed, 0)).tables
    assert "tiny" not in read_manifest(shard_dir(packed, 0)).features


def test_manifest_versions(packed):
    assert json.loads((packed.whole / MANIFEST).read_text())["version"] == 1
    body = json.loads((shard_dir(packed, 1) / MANIFEST).read_text())
    assert body["version"] == 2
    assert "row_start" not in json.loads((packed.whole / MANIFEST).read_text())["tables"]["emb_f32"]


def test_manifest_rejects_bad_ranges(packed, tmp_path):
    body = json.loads((shard_dir(packed, 1) / MANIFEST).read_text())
    body["tables"]["emb_f32"]["total_rows"] = 400  # shard 1 holds [333, 666)
    (tmp_path / MANIFEST).write_text(json.dumps(body))
    with pytest.raises(TableSetError, match=r"row range \[333, 666\) does not lie"):
        read_manifest(tmp_path)
    body["version"] = 1
    body["tables"]["emb_f32"]["total_rows"] = 1000
    (tmp_path / MANIFEST).write_text(json.dumps(body))
    with pytest.raises(TableSetError, match="needs manifest version 2"):
        read_manifest(tmp_path)


def test_shard_map_file(packed):
    body = json.loads((packed.sharded / SHARD_MAP).read_text())
    assert body["format"] == "ibpembed.shard_map" and body["version"] == 1
    assert [s["directory"] for s in body["shards"]] == [
        f"shard-{k}-of-{SHARDS}" for k in range(SHARDS)
    ]
    assert all(s["address"] is None for s in body["shards"])
    f32 = body["tables"]["emb_f32"]
    assert (f32["num_rows"], f32["dim"], f32["dtype"], f32["quant"]) == (1000, 16, "float32", None)
    assert [(r["shard"], r["row_start"], r["row_end"]) for r in f32["ranges"]] == [
        (0, 0, 333),
        (1, 333, 666),
        (2, 666, 1000),
    ]
    assert [r["shard"] for r in body["tables"]["emb_tiny"]["ranges"]] == [1, 2]
    assert body["tables"]["emb_q8"]["quant"] == "int8_rowwise"
    assert body["features"]["user_hist"] == "emb_f32"


def test_cli_pack_shards_with_addresses(tmp_path):
    source = tmp_path / "t.npy"
    np.save(source, np.arange(50 * 4, dtype=np.float32).reshape(50, 4))
    out = tmp_path / "set"
    flags = ["--shards", "2", "--json", "--shard-address", "ibpembed-{shard}.ibpembed:50051"]
    result = subprocess.run(
        [*PACK, str(source), "-o", str(out), *flags],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["tables"]
    assert [(r["shard"], r["rows"]) for r in report] == [(0, 25), (1, 25)]
    body = json.loads((out / SHARD_MAP).read_text())
    assert [s["address"] for s in body["shards"]] == [
        "ibpembed-0.ibpembed:50051",
        "ibpembed-1.ibpembed:50051",
    ]
    bad = subprocess.run(
        [*PACK, str(source), "-o", str(tmp_path / "x"), "--shard-address", "h{shard}:1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "argument --shard-address: needs --shards" in bad.stderr


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("x-{foo}:1", "KeyError: 'foo'"),
        ("h-{}:1", "IndexError"),
        ("h-{shard:1", "ValueError"),
        ("h:1", "gives two shards the same address"),
    ],
)
def test_cli_pack_refuses_a_bad_address_template_before_packing(tmp_path, template, why):
    """A template that does not expand is a usage error naming the flag, and no shard is
    published: before, every shard's manifest was in place when the map's expansion raised."""
    source = tmp_path / "t.npy"
    np.save(source, np.arange(50 * 4, dtype=np.float32).reshape(50, 4))
    out = tmp_path / "set"
    bad = subprocess.run(
        [*PACK, str(source), "-o", str(out), "--shards", "2", "--shard-address", template],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2, bad.stderr
    assert "argument --shard-address" in bad.stderr and why in bad.stderr
    assert "Traceback" not in bad.stderr
    assert not out.exists()


def test_pack_shards_expands_the_template_before_writing_any_shard(packed, tmp_path):
    with pytest.raises(ValueError, match="does not expand"):
        pack_shards(tmp_path / "set", packed.table_set, 3, address_template="x-{foo}")
    assert not (tmp_path / "set").exists()


def test_store_row_ranges_survive_save_and_reload(packed, tmp_path):
    store = TableStore.load(shard_dir(packed, 1))
    with store.acquire() as snap:
        assert snap.row_range("emb_f32") == RowRange(333, 666, 1000)
    store.save(tmp_path / "saved")
    assert read_manifest(tmp_path / "saved").tables["emb_f32"].row_range == RowRange(333, 666, 1000)
    store.reload(tmp_path / "saved")
    with store.acquire() as snap:
        assert snap.row_range("emb_bf16") == RowRange(166, 333, 500)


def test_engine_takes_global_ids_and_names_the_shard_range(packed):
    engine = LookupEngine(TableStore.load(shard_dir(packed, 2)), max_workers=1)
    try:
        f32 = packed.table_set.tables[0].weight
        ids = np.array([999, 666, 700, 666], dtype=np.int64)
        query = FeatureQuery("user", ids, np.array([2, 0, 2], dtype=np.int32))
        rows = engine.run([query], "none").features[0].values
        assert torch.equal(rows.view(torch.uint8), f32[ids].view(torch.uint8))
        (desc,) = engine.describe("emb_f32")
        assert (desc.num_rows, desc.row_start, desc.row_end) == (1000, 666, 1000)
        outside = FeatureQuery("user", np.array([665], dtype=np.int64), np.array([1], np.int32))
        with pytest.raises(InvalidArgument, match=r"id 665 .*shard of rows \[666, 1000\) of 1000"):
            engine.run([outside], "sum")
    finally:
        engine.close()
