# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu_check.py --dry-run: the GPU script's CPU half, so it does not rot between the
rare runs on a GPU machine (table tiling and the raw layout are checked against the CPU decoder)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_check


def test_dry_run_builds_checks_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--profile", "dlrm-bf16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["correctness"]["failures"] == []
    assert report["correctness"]["passed"] > 100
    assert report["big_table_checks"] == {"passed": 2 * len(gpu_check.ROW_BYTES), "failures": []}
    assert {row["row_bytes"] for row in report["results"]} == set(gpu_check.ROW_BYTES)
    assert report["targets"] == {}  # nothing GPU-side was timed
