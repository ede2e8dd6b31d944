# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu_check.py --dry-run: the GPU script's CPU half, so it does not rot between the
rare runs on a GPU machine (table tiling and the raw layout are checked against the CPU decoder).

With no GPU the correctness checks compare the CPU ops with independent answers (the source rows
for gathers and decompression, ``ibpembed.reference`` for pooled lookups), so a wrong CPU op fails
here: the counts below are those real checks, every one of them run and passed."""

from __future__ import annotations

import json
from pathlib import Path

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
