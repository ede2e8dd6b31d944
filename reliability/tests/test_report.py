# SPDX-License-Identifier: Apache-2.0
"""README.md's *Current figures* are the render of the committed campaign results, and those
results are the documented runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from reliability.report import CAMPAIGNS, README, RESULTS, load, render_readme, render_table


def test_the_committed_table_is_the_render_of_the_committed_results() -> None:
    text = README.read_text()
    assert render_readme(text) == text, "run `python -m reliability --render-only`"


def test_every_campaign_has_its_documented_run_committed() -> None:
    reports = load()
    assert sorted(reports) == sorted(c.name for c in CAMPAIGNS)
    for c in CAMPAIGNS:
        report = reports[c.name]
        assert report["command"] == c.command, f"{c.name}: not the documented run"
        assert {"machine", "commit", "date", "exit_code"} <= report["run"].keys()


def test_a_failure_in_a_report_shows_in_its_row(tmp_path: Path) -> None:
    shutil.copytree(RESULTS, tmp_path, dirs_exist_ok=True)
    faults = json.loads((tmp_path / "faults.json").read_text())
    faults["kill_pack"]["failures"].append("a stale lock after a kill")
    faults["run"]["exit_code"] = 1
    (tmp_path / "faults.json").write_text(json.dumps(faults))
    (row,) = [line for line in render_table(tmp_path).splitlines() if "(#faults)" in line]
    assert "1 failures (exit code 1)" in row and "all handled" not in row
