# SPDX-License-Identifier: Apache-2.0
"""Smoke test of benchmarks.metrics_overhead: the quick run (real servers, metrics on and off)
writes its report, with the in-process cost of the metrics code."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import metrics_overhead


def test_quick_run_reports_both_arms(tmp_path: Path) -> None:
    assert metrics_overhead.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "metrics_overhead.json").read_text())
    assert report["hook_costs"]["per_request_s"] > 0
    assert report["hook_costs"]["per_table_s"] > 0
    (result,) = report["results"]
    assert result["batch"] == 1
    for arm in ("on", "off"):
        assert all(run["errors"] == {} and run["qps"] > 0 for run in result["runs"][arm])
    assert "| B | QPS off | QPS on |" in (tmp_path / "metrics_overhead.md").read_text()
