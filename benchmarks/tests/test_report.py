# SPDX-License-Identifier: Apache-2.0
"""BENCHMARKS.md is rendered from the results directory alone: what is there is shown with its
run's provenance, what is missing says how to produce it."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import __main__ as runner
from benchmarks import engine_paths
from benchmarks.report import SECTIONS, render


def test_an_empty_results_directory_names_the_command_of_every_section(tmp_path: Path) -> None:
    text = render(tmp_path, {})
    for section in SECTIONS:
        assert f"## {section.title}" in text
    assert "Not measured in this run (`python -m benchmarks --only codec`" in text
    assert "| zero-copy GPU gather, compressed vs raw rows | not measured |" in text


def test_a_real_run_is_rendered_with_its_command_and_tables(tmp_path: Path) -> None:
    assert engine_paths.main(["--quick", "--out", str(tmp_path)]) == 0
    assert runner.main(["--render-only", "--out", str(tmp_path), "--report",
                        str(tmp_path / "B.md")]) == 0  # fmt: skip
    text = (tmp_path / "B.md").read_text()
    meta = json.loads((tmp_path / "engine_paths.json").read_text())
    assert meta["commit"] and meta["machine"]
    # The setup block names the section's command; the section carries the benchmark's table.
    assert "| [engine_paths](#engine_paths) | `python -m benchmarks.engine_paths --quick` |" in text
    section = text.split("## Engine paths")[1].split("\n## ")[0]
    assert "| case | B |" in section
    assert "Not measured" not in section
