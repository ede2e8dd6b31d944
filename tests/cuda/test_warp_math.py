# SPDX-License-Identifier: Apache-2.0
"""Host emulation of the CUDA kernels' warp-level index math; runs on every machine.

warp_math_host.cpp is compiled with the system C++ compiler against the kernels' own lane
functions (csrc/cuda/warp_decode.cuh) and the CPU codec headers. It checks the run-based deposit
against the portable one, the warp-reduced row offsets against format.h, the dedupe runs of the
gather, and decodes rows encoded by the CPU codec after staging them like the kernels do (16-byte
windows at every slot alignment, W = 16/32/64, widths 1..2056 bytes, code widths C = 1..4 with
random masks and codebooks, every code and the escape used, raw and compressed), with each
lane's code checked against the encoder's and each read bounds-checked against the staging
buffer the launch allocates.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = os.environ.get("CXX", "g++")

pytestmark = pytest.mark.skipif(
    shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX}) to build the host emulation"
)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("warp_math") / "warp_math_host"
    build = subprocess.run(
        [
            CXX,
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{ROOT / 'csrc' / 'include'}",
            str(ROOT / "tests" / "cuda" / "warp_math_host.cpp"),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    return exe


def test_warp_math_matches_cpu_codec(harness: Path) -> None:
    result = subprocess.run([str(harness)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok "), result.stdout
