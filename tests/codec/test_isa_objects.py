# SPDX-License-Identifier: Apache-2.0
"""Code compiled with ISA flags never reaches a CPU that lacks them.

The linker keeps one copy of each weak (vague-linkage) symbol for the whole library, so a template
instance emitted by the -mavx512* translation unit could be the one the ref path runs on a CPU
without AVX-512. Every ISA translation unit (setup.py's ISA_SOURCES) must therefore define no weak
symbols at all, built with the flags setup.py gives it. The same objects also show whether the
compiler kept the decode loops' software prefetches.
"""

from __future__ import annotations

import platform
import runpy
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[2]
CXX = "g++"


SETUP = runpy.run_path(str(ROOT / "setup.py"))  # its flags; it builds only as __main__
pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="setup.py builds ISA translation units on x86-64 only"
)


TOOLS = (CXX, "nm", "objdump")
needs_tools = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in TOOLS), reason="no g++/nm/objdump"
)


@pytest.fixture(scope="module")
def isa_object(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Compiles an ISA translation unit with setup.py's flags (once per source and module)."""
    built: dict[str, Path] = {}
    includes = [f"-I{ROOT / 'csrc' / 'include'}"] + [
        f"-I{p}" for p in cpp_extension.include_paths()
    ]

    def build(source: str) -> Path:
        if source not in built:
            obj = tmp_path_factory.mktemp("isa") / "unit.o"
            flags = [*SETUP["CXX_FLAGS"], "-fPIC", *SETUP["ISA_SOURCES"][source], *includes]
            subprocess.run(
                [CXX, *flags, "-c", str(ROOT / source), "-o", str(obj)],
                check=True,
                capture_output=True,
                timeout=600,
            )
            built[source] = obj
        return built[source]

    return build


@needs_tools
@pytest.mark.parametrize("source", sorted(SETUP["ISA_SOURCES"]))
def test_isa_translation_unit_defines_no_weak_symbols(
    source: str, isa_object: Callable[[str], Path]
) -> None:
    symbols = subprocess.run(
        ["nm", "-C", "--defined-only", str(isa_object(source))],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    # V DW.ref.__gxx_personality_v0 is data (the EH personality pointer), not code.
    weak = [s for s in symbols if s.split()[1:2] in (["W"], ["V"]) and "DW.ref" not in s]
    assert weak == [], f"{source} emits shared template instances: {weak}"


def _function_bodies(disassembly: str) -> dict[str, str]:
    """objdump -d output split into {demangled symbol: its instructions}."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in disassembly.splitlines():
        if line.endswith(">:") and "<" in line:
            current = bodies.setdefault(line[line.index("<") + 1 : -2], [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in bodies.items()}


@needs_tools
@pytest.mark.parametrize("source", sorted(s for s in SETUP["ISA_SOURCES"] if "row_kernels" in s))
def test_decode_loops_keep_their_index_prefetches(
    source: str, isa_object: Callable[[str], Path]
) -> None:
    """GCC deletes calls to helpers whose only effect is a prefetch (row_kernels_impl.h's NOTE);
    a decode loop without its index prefetches is correct, and 25-35 % slower."""
    disassembly = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(isa_object(source))],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    loops = {
        name: body
        for name, body in _function_bodies(disassembly).items()
        if "decode_rows_with" in name and "[clone .cold]" not in name
    }
    assert loops, f"no decode_rows_with instances in {source}"
    missing = [name for name, body in loops.items() if "prefetcht0" not in body]
    assert missing == [], f"decode loops without index prefetches: {missing}"
