# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu_check.py --dry-run: the GPU script's CPU half, so it does not rot between the
rare runs on a GPU machine (table tiling and the raw layout are checked against the CPU decoder).

With no GPU the correctness checks compare the CPU ops with independent answers (the source rows
for gathers and decompression, ``ibpembed.reference`` for pooled lookups), so a wrong CPU op fails
here: the counts below are those real checks, every one of them run and passed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ibpembed
from benchmarks import gpu_check


def test_dry_run_builds_checks_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--profile", "dlrm-bf16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    correctness = report["correctness"]
    assert correctness["failures"] == []
    assert correctness["against"] == "source rows and ibpembed.reference"
    cases = [table for _, table, _ in gpu_check.small_cases()]
    floating = sum(table.dtype.is_floating_point for table in cases)
    assert correctness["passed_by_kind"] == {
        "gather": 2 * len(cases),  # payload "pinned" and "device" (both the host on a CPU)
        "decompress": len(cases),
        "pooled": 4 * (floating + 1),  # SUM/MEAN x weights or not; + the int8 row-wise table
        "errors": 3,
    }
    assert correctness["passed"] == sum(correctness["passed_by_kind"].values())
    assert report["big_table_checks"] == {"passed": 2 * len(gpu_check.ROW_BYTES), "failures": []}
    assert {row["row_bytes"] for row in report["results"]} == set(gpu_check.ROW_BYTES)
    assert report["targets"] == {}  # nothing GPU-side was timed
    for row in report["results"]:  # what a GPU run compares its timings with
        assert row["raw_wire_sectors"] == row["unique_ids"] * row["row_bytes"] // 32
        assert row["unique_ids"] <= row["ibp_wire_sectors"] <= row["raw_wire_sectors"] * 2


def test_slot_sectors_counts_each_rows_sectors() -> None:
    big = gpu_check.build_big(ibpembed, gpu_check.Pinned(False), 64, 1 << 20, "dlrm", False)
    _, block_base, row_units = big.comp_cpu[:3]
    ids = torch.tensor([0, 1, 31, 32, 33, 100, big.num_rows - 1])
    want = 0
    for r in ids.tolist():
        start = r - r % 32
        offset = int(block_base[r // 32]) + big.unit_bytes * int(row_units[start:r].sum())
        size = big.unit_bytes * int(row_units[r])
        want += (offset % 32 + size + 31) // 32
    assert gpu_check.slot_sectors(big, ids) == want
