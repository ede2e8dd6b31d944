# SPDX-License-Identifier: Apache-2.0
"""Smoke test of benchmarks.service: a tiny run measures every path at both loads against a real
server, with no errors, and reports the targets."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import service


def test_smoke_run_reports_every_path(tmp_path: Path) -> None:
    assert service.main(["--smoke", "--out", str(tmp_path), "--workers", "1"]) == 0
    report = json.loads((tmp_path / "service.json").read_text())
    rows = report["results"]
    assert rows[0]["path"] == "health" and rows[0]["requests"] > 0
    points = {(r["path"], r["batch"], r["load"]) for r in rows[1:]}
    assert points == {
        (path, batch, load)
        for path in service.PATHS
        for batch in service.SMOKE.batches
        for load in ("one", "saturation")
    }
    for row in rows:
        assert row["requests"] > 0 and not row["errors"], row
    assert set(report["targets"]) >= {"b1_p50_vs_health_p50", "b512_shm_vs_in_process_qps"}
    assert "| B | path | load |" in (tmp_path / "service.md").read_text()
