# SPDX-License-Identifier: Apache-2.0
"""deploy/triton/Dockerfile, checked offline: hadolint, and that it builds like CI."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "triton" / "Dockerfile"
HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=str(Path(sys.executable).parent)
)


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (requirements/deploy.txt)")
def test_hadolint_clean() -> None:
    result = subprocess.run(
        [HADOLINT, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_layers_ibpembed_onto_tritonserver_like_ci() -> None:
    ops = instructions()
    stages = [args for op, args in ops if op == "FROM"]
    assert len(stages) == 2
    assert stages[0].endswith("AS build")
    assert stages[1].startswith("nvcr.io/nvidia/tritonserver:")
    assert any(re.match(r"make setup\b", args) for op, args in ops if op == "RUN")
    (user,) = [args for op, args in ops if op == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    env = " ".join(args for op, args in ops if op == "ENV")
    # The Python backend's stub ignores PYTHONPATH; model.py applies it (see the README).
    assert "PYTHONPATH=" in env and "/src/service" in env
