# SPDX-License-Identifier: Apache-2.0
"""Smoke test of benchmarks.cpu_engine: the torch-free build of the lookup engine compiles with
setup.py's flags, and its raw and compressed pooled sums equal the control loop's bit for bit (the
harness exits non-zero otherwise, which fails the run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import cpu_engine

pytestmark = pytest.mark.skipif(
    not cpu_engine.runs_here() or shutil.which("g++") is None,
    reason="the harness is x86-64 AVX2 code built with g++",
)


def test_quick_run_times_every_engine_and_agrees(tmp_path: Path) -> None:
    argv = ["--gib", "0.002", "--batches", "2", "--rounds", "2", "--reps", "1"]
    assert cpu_engine.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cpu_engine.json").read_text())
    assert report["table"]["rows"] == int(0.002 * (1 << 30)) // 512
    assert 0.05 < report["table"]["savings"] < 0.2  # DLRM-profile fp32 rows do compress
    (result,) = report["results"].values()
    for key in ("control_ns", "raw_ns", "compressed_ns"):
        assert len(result[key]) == 2 and all(ns > 0 for ns in result[key])
    assert "| engine source |" in (tmp_path / "cpu_engine.md").read_text()


def test_setup_flags_match_the_extension_build() -> None:
    cxx_flags, isa_sources = cpu_engine.setup_flags()
    assert "-O3" in cxx_flags
    assert "-mbmi2" in isa_sources["csrc/codec/row_kernels_bmi2.cpp"]
    # Every ISA-flagged source of the extension that the engine needs is compiled by the harness.
    needed = {f"csrc/{rel}" for rel in cpu_engine.ENGINE_SOURCES}
    assert set(isa_sources) <= needed
