# SPDX-License-Identifier: Apache-2.0
"""Smoke test of benchmarks.integrations: the quick run (a real tritonserver, a real
``ibpembed serve``) checks that every path answers with the same bits, then writes its report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tools.triton_process import tritonserver_root

if tritonserver_root() is None or importlib.util.find_spec("tritonclient.http") is None:
    pytest.skip(
        "tritonserver / tritonclient are not installed: "
        "pip install --no-deps -r requirements/triton.txt (make setup does)",
        allow_module_level=True,
    )
pytest.importorskip("torchrec.modules.embedding_modules", reason="torchrec is not installed")

from benchmarks import integrations  # after the skips: it imports torchrec


def test_quick_run_reports_every_path(tmp_path: Path) -> None:
    assert integrations.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "integrations.json").read_text())
    paths = {(r["batch"], r["path"]) for r in report["lookups"]}
    assert len(paths) == len(integrations.LOOKUP_BATCHES) * 3
    modules = {(r["batch"], r["module"]) for r in report["modules"]}
    assert len(modules) == len(integrations.MODULE_BATCHES) * 3
    assert all(r["qps"] > 0 and r["calls"] > 0 for r in report["lookups"] + report["modules"])
    assert "| B | features | path | QPS |" in (tmp_path / "integrations.md").read_text()
