# SPDX-License-Identifier: Apache-2.0
"""Smoke test of benchmarks.engine_paths: the quick run writes its report with every variant, and
every variant's pooled sums agree with the fused kernel's (the timings compare like with like)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import engine_paths


def test_quick_run_reports_every_variant(tmp_path: Path) -> None:
    assert engine_paths.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "engine_paths.json").read_text())
    assert [r["batch"] for r in report["results"]] == [512, 64, 512]
    for result in report["results"]:
        assert set(result["ms"]) == set(engine_paths.VARIANTS)
        assert all(ms > 0 for ms in result["ms"].values())
        # Each variant's results, compared once with the fused variant's outside the timing.
        assert result["agree"] == dict.fromkeys(engine_paths.VARIANTS, True), result["case"]
    assert "| case | B |" in (tmp_path / "engine_paths.md").read_text()
