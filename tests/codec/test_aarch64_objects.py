# SPDX-License-Identifier: Apache-2.0
"""aarch64 builds multiply then add in the pooled sums, as the CUDA kernels do (accumulate.h).

FMA is in aarch64's baseline and GCC contracts C++ by default, so without setup.py's
-ffp-contract=off the portable loop compiles `acc += w * v` to fmla/fmadd and its sums differ from
the GPU's in the last bit. The translation unit holding the portable loop is cross-compiled with
setup.py's flags and its instructions read (scripts/check_aarch64_compile.sh reads every one).
"""

from __future__ import annotations

import re
import runpy
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[2]
CXX = "aarch64-linux-gnu-g++"
OBJDUMP = "aarch64-linux-gnu-objdump"
SETUP = runpy.run_path(str(ROOT / "setup.py"))  # its flags; it builds only as __main__
# Scalar fmadd/fmsub/fnmadd/fnmsub, vector fmla/fmls and fmlal/fmlsl, bfloat16 bfmlalb/bfmlalt.
FUSED = re.compile(r"^\s*[0-9a-f]+:\s+(f(n)?m(add|sub)|fml[as]|bfml[as])", re.MULTILINE)


@pytest.mark.skipif(
    shutil.which(CXX) is None or shutil.which(OBJDUMP) is None,
    reason=f"no {CXX} (g++-aarch64-linux-gnu)",
)
def test_the_portable_pooled_loop_fuses_no_multiply_add(tmp_path: Path) -> None:
    obj = tmp_path / "lookup_cpu.o"
    includes = [f"-I{ROOT / 'csrc' / 'include'}", f"-I{sysconfig.get_paths()['include']}"]
    includes += [f"-I{p}" for p in cpp_extension.include_paths()]
    flags = [*SETUP["CXX_FLAGS"], *SETUP["OPENMP_FLAGS"], "-fPIC", *includes]
    source = ROOT / "csrc" / "lookup" / "lookup_cpu.cpp"
    subprocess.run(
        [CXX, *flags, "-c", str(source), "-o", str(obj)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    disassembly = subprocess.run(
        [OBJDUMP, "-d", "--no-show-raw-insn", str(obj)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "pool_rows_portable" in disassembly
    fused = [m.group(0).strip() for m in FUSED.finditer(disassembly)]
    assert fused == [], f"{len(fused)} fused multiply-adds, e.g. {fused[:4]}"
