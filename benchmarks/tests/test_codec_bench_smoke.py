# SPDX-License-Identifier: Apache-2.0
"""Smoke test of the codec benchmark's core functions on tiny synthetic tables.

Needs neither the MiniLM nor the recbole wheel (CI does not install them); zstd/lz4 and
torchrec/fbgemm are used when present and reported as missing otherwise.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

# Imported, not importorskip'd: CI installs the bench extras, so an import error is a defect of
# the benchmark, not a missing optional dependency.
from benchmarks import codec as codec_bench
from benchmarks import data
from ibpembed import compress

TINY = dataclasses.replace(
    codec_bench.QUICK, gather_gib=1 / 1024, gather_batches=2, rounds=1, threads=(1,)
)


@pytest.fixture(scope="module")
def tables() -> list:
    base = data.dlrm_table(512, 16, seed=1)
    return [
        codec_bench.Table("tiny_fp32", base, "test"),
        codec_bench.Table("tiny_bf16", base.bfloat16(), "test"),
        codec_bench.Table("tiny_int8", data.int8_rowwise(base), "test", "int8_rowwise"),
    ]


def test_dlrm_profile_has_zero_rows_and_outliers() -> None:
    table = data.dlrm_table(1000, 8, seed=0)
    assert int((table == 0).all(dim=1).sum()) >= 10
    assert float(table.abs().max()) > 10.0


def test_exponent_entropy_bound_on_known_tables() -> None:
    # One exponent and a single varying mantissa bit: 31 of 32 bits are free to drop.
    ones = torch.tensor([[1.0, 1.5]], dtype=torch.float32)
    assert codec_bench.exponent_entropy_bound(ones) == pytest.approx(31 / 32)
    assert codec_bench.exponent_entropy_bound(torch.zeros(2, 2, dtype=torch.uint8)) is None


def test_zipf_batches_shape() -> None:
    batches = data.zipf_batches(1000, num_batches=2, batch_size=8, max_pooling=5)
    for b in batches:
        assert b.offsets[-1] == b.ids.numel() == int(b.lengths.sum())
        assert int(b.ids.min()) >= 0 and int(b.ids.max()) < 1000
        assert int(b.lengths.min()) >= 1 and int(b.lengths.max()) <= 5


def test_quick_core_functions_render(tables: list, tmp_path: Path) -> None:
    results = {
        "machine": codec_bench.machine_description(),
        "date": "test",
        "command": "test",
        "revision": codec_bench.source_revision(),
        "load_average": [0.0, 0.0],
        "config": TINY.__dict__,
        "tables": [codec_bench.measure_table(t, reps=1) for t in tables],
        "alignment": codec_bench.alignment_sweep(tables[:1]),
        "cpu_paths": codec_bench.cpu_path_decode(tables[:1], reps=1),
        "gather": [codec_bench.gather_bench(TINY, profile) for profile in ("fp32", "bf16r")],
    }
    for row in results["tables"]:
        assert row["ours"] >= row["paper"] - 0.02, row["name"]
        assert row["decode_gbps"]["ours"] > 0
        assert row["target"] in ("met", "missed", "n/a")
    rates = results["gather"][1]["mlookups_per_s"]["1"]
    assert rates["ibpembed compressed"] > 0 and rates["ibpembed raw rows"] > 0
    assert rates["F.embedding_bag"] > 0
    markdown = codec_bench.render_markdown(results)
    assert "tiny_bf16" in markdown and "ibpembed raw rows" in markdown and "| target |" in markdown
    codec_bench.plot_savings(results, tmp_path / "chart.png")


def test_gather_footprint_counts_each_rows_granules() -> None:
    table = compress(data.dlrm_table(200, 16, seed=3), align=1)  # 64-byte rows, packed densely
    units, base = table.row_units.tolist(), table.block_base.tolist()
    sectors = lines = 0
    for r in range(table.num_rows):
        offset = base[r // 32] + table.unit_bytes * sum(units[r - r % 32 : r])
        size = table.unit_bytes * units[r]
        sectors += (offset % 32 + size + 31) // 32
        lines += (offset % 128 + size + 127) // 128
    # A raw 64-byte row in place touches 2 sectors and 1 line.
    footprint = codec_bench.gather_footprint(table)
    assert footprint["sectors"] == pytest.approx(sectors / (2 * table.num_rows))
    assert footprint["lines"] == pytest.approx(lines / table.num_rows)
    assert footprint["lines"] > 1.0  # dense packing straddles lines that raw rows never do
    raw = compress(data.dlrm_table(200, 16, seed=3), method="raw")
    assert codec_bench.gather_footprint(raw) == {"sectors": 1.0, "lines": 1.0}
