# SPDX-License-Identifier: Apache-2.0
"""Smoke test of benchmarks.tables on a tiny table set: every pack and load figure is produced."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import tables


def test_tables_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    argv = ["--gib", "0.002", "--tables", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert tables.main(argv) == 0
    result = json.loads((tmp_path / "tables.json").read_text())
    assert result["pack"]["report"] and result["pack"]["seconds"] > 0
    # The pack's peak covers at least its interpreter and torch: far above the tiny table.
    assert result["pack"]["peak_rss_bytes"] > 50 * 2**20
    for state in ("cold", "warm"):
        for kind in tables.LOAD_KINDS:
            load = result["loads"][state][kind]
            assert load["load_s"] > 0 and load["first_lookup_s"] > 0
    markdown = (tmp_path / "tables.md").read_text()
    rows = len(tables.LOAD_KINDS)
    assert markdown.count("| cold |") == rows and markdown.count("| warm |") == rows
