# SPDX-License-Identifier: Apache-2.0
"""A short run of the emulated CUDA kernel fuzz (reliability.fuzz_cuda_kernels): same cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reliability import fuzz_cuda_kernels as fk
from tools.simt.harness import CXX, EmulatedKernels, build

pytestmark = pytest.mark.skipif(
    shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX}) to build the SIMT emulator"
)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> EmulatedKernels:
    return EmulatedKernels(build(tmp_path_factory.mktemp("simt")))


def test_short_run_finds_nothing(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    assert fk.main(["--cases", "8", "--seed", "5", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["cases"] == 8 and summary["failures"] == []
    assert summary["rows_gathered"] >= 8 and summary["rows_decompressed"] >= 8


def test_checker_reports_a_wrong_row(kernels, monkeypatch) -> None:
    """The fuzz would say nothing if its comparison were vacuous: flip one bit, it must notice."""
    real = kernels.gather

    def corrupted(c, ids, grid):
        rows, error = real(c, ids, grid)
        rows = rows.clone()
        rows.view(-1)[0] ^= 1
        return rows, error

    monkeypatch.setattr(kernels, "gather", corrupted)
    problems = fk.run_case(kernels, 11, fk.Stats())
    assert len(problems) == 2
    assert "gather differs" in problems[0] and "decompress differs" in problems[1]
