# SPDX-License-Identifier: Apache-2.0
"""BENCHMARKS.md is rendered from the results directory alone: what is there is shown with its
run's provenance, what is missing says how to produce it."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import __main__ as runner
from benchmarks import engine_paths
from benchmarks._harness import RESULTS
from benchmarks.report import HEADLINE_ROWS, SECTIONS, headline_rows, load, render


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
    # The setup block names the section's command and commit; the section carries its table.
    row = "| [engine_paths](#engine_paths) | `python -m benchmarks.engine_paths --quick` | "
    assert row + meta["commit"] in text
    section = text.split("## Engine paths")[1].split("\n## ")[0]
    assert "| case | B |" in section
    assert "Not measured" not in section


def test_the_committed_page_is_the_render_of_the_committed_results() -> None:
    # BENCHMARKS.md is an output: a hand edit, a renderer change without a re-render, or results
    # left out of the commit all show up here.
    assert (RESULTS / "run.json").is_file(), "benchmarks/results/run.json is not committed"
    assert runner.REPORT.read_text() == render(RESULTS)


def test_every_committed_section_has_its_results_pair_and_provenance() -> None:
    results, markdown = load(RESULTS)
    for name, data in results.items():
        assert name in markdown, f"{name}.json is committed without {name}.md"
        assert data.get("command", "").startswith(f"python -m benchmarks.{name}")
        assert "--quick" not in data["command"], f"{name}: smoke sizes are not results"
    measured = [s.name for s in SECTIONS if s.args is not None]
    assert sorted(results) == sorted(measured), "a CPU section has no committed results"


def test_the_headline_stays_a_summary() -> None:
    results, _ = load(RESULTS)
    rows = headline_rows(results)
    assert 0 < len(rows) <= HEADLINE_ROWS
    assert all(len(row) == 5 for row in rows)
