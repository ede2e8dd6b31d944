# SPDX-License-Identifier: Apache-2.0
"""Code compiled with ISA flags never reaches a CPU that lacks them.

The linker keeps one copy of each weak (vague-linkage) symbol for the whole library, so a template
instance emitted by the -mavx512* translation unit could be the one the ref path runs on a CPU
without AVX-512. Every ISA translation unit (setup.py's ISA_SOURCES) must therefore define no weak
symbols at all, built with the flags setup.py gives it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[2]
CXX = "g++"


def _setup_constants() -> dict:
    """ISA_SOURCES and CXX_FLAGS as setup.py writes them (importing it would run setup())."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in ("ISA_SOURCES", "CXX_FLAGS")
    }


SETUP = _setup_constants()


@pytest.mark.skipif(shutil.which(CXX) is None or shutil.which("nm") is None, reason="no g++/nm")
@pytest.mark.parametrize("source", sorted(SETUP["ISA_SOURCES"]))
def test_isa_translation_unit_defines_no_weak_symbols(source: str, tmp_path: Path) -> None:
    obj = tmp_path / "unit.o"
    includes = [f"-I{ROOT / 'csrc' / 'include'}"] + [
        f"-I{p}" for p in cpp_extension.include_paths()
    ]
    flags = [*SETUP["CXX_FLAGS"], "-fPIC", *SETUP["ISA_SOURCES"][source], *includes]
    subprocess.run(
        [CXX, *flags, "-c", str(ROOT / source), "-o", str(obj)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    symbols = subprocess.run(
        ["nm", "-C", "--defined-only", str(obj)], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    # V DW.ref.__gxx_personality_v0 is data (the EH personality pointer), not code.
    weak = [s for s in symbols if s.split()[1:2] in (["W"], ["V"]) and "DW.ref" not in s]
    assert weak == [], f"{source} emits shared template instances: {weak}"
