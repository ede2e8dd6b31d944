# SPDX-License-Identifier: Apache-2.0
"""Layering rules: the core (codec, tables, engine, torchrec, errors) imports neither grpc nor
the server package nor the client (which pulls in grpc), and tests/ never imports the benchmarks
or the reliability campaigns."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

CORE_MODULES = [
    "ibpembed.codec",
    "ibpembed.errors",
    "ibpembed.engine.tier",
    "ibpembed.tables",
    "ibpembed.tables.store",
    "ibpembed.tables.manifest",
    "ibpembed.tables.pack",
    "ibpembed.tables.shards",
    "ibpembed.tables.importers",
    "ibpembed.tables.tier_budget",
    "ibpembed.engine",
    "ibpembed.selftest",
    "ibpembed.torchrec",
    "ibpembed.torchrec.convert",
    "ibpembed.triton.repo",
    "ibpembed.triton.model",
]
FORBIDDEN_PREFIXES = ("grpc", "ibpembed.server", "ibpembed_client")

PROBE = """
import sys, importlib
importlib.import_module(sys.argv[1])
prefixes = tuple(sys.argv[2:])
print("\\n".join(sorted(m for m in sys.modules
                        if any(m == p or m.startswith(p + ".") for p in prefixes))))
"""


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_does_not_import_the_transport(module: str) -> None:
    # A fresh interpreter: this test process has long imported grpc for other tests.
    result = subprocess.run(
        [sys.executable, "-c", PROBE, module, *FORBIDDEN_PREFIXES],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.split() == [], f"{module} imports {result.stdout.split()}"


def test_the_probe_sees_a_transport_import() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, "ibpembed.server.status", *FORBIDDEN_PREFIXES],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "grpc" in result.stdout.split()


REPO = Path(__file__).resolve().parents[2]
IMPORT = re.compile(r"^\s*(?:from|import)\s+(benchmarks|reliability)\b", re.MULTILINE)


def test_product_tests_import_neither_benchmarks_nor_campaigns() -> None:
    # tests/ checks the package; what benchmarks and campaigns share with it lives in tools/.
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("*.py")
        if IMPORT.search(path.read_text())
    ]
    assert offenders == []


def test_the_import_scan_sees_an_import() -> None:
    assert IMPORT.search("import os\nfrom benchmarks import codec\n")
    assert not IMPORT.search('"""see benchmarks.codec"""\n')
