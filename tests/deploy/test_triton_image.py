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


def test_runtime_stage_is_tritonserver_with_the_runtime_pins_and_two_wheels() -> None:
    ops = instructions()
    stages = [i for i, (op, _) in enumerate(ops) if op == "FROM"]
    assert len(stages) == 2
    build, runtime = ops[stages[0] : stages[1]], ops[stages[1] :]
    assert build[0][1].endswith("AS build")
    assert runtime[0][1].startswith("nvcr.io/nvidia/tritonserver:")
    # Like the main image: pinned requirements before any source, wheels built, no dev setup.
    copies = [args for op, args in build if op == "COPY"]
    assert copies[0].startswith("requirements/runtime.txt requirements/base.txt")
    assert not any(args.split()[0] == "." for args in copies), "the whole tree is copied"
    runs = " ".join(args for op, args in ops if op == "RUN")
    assert "make setup" not in runs and "dev.txt" not in runs and "pytriton" not in runs
    assert "pip wheel --no-deps --no-build-isolation -w /wheels . clients/python" in runs
    runtime_runs = [args for op, args in runtime if op == "RUN"]
    pins = next(i for i, r in enumerate(runtime_runs) if "-r /tmp/runtime.txt" in r)
    wheels = next(i for i, r in enumerate(runtime_runs) if "--no-deps /tmp/wheels/" in r)
    assert pins < wheels
    runtime_copies = [args for op, args in runtime if op == "COPY"]
    assert runtime_copies == [
        "requirements/runtime.txt /tmp/runtime.txt",
        "--from=build /wheels /tmp/wheels",
    ]
    # No Python version written into the image: the venv's site-packages is found at build time.
    text = DOCKERFILE.read_text()
    assert not re.search(r"python3\.\d+", text), "a hard-coded Python version"
    env = " ".join(args for op, args in runtime if op == "ENV")
    assert 'PYTHONPATH="/opt/venv/site-packages"' in env
    (user,) = [args for op, args in ops if op == "USER"]
    assert user.split(":")[0] not in ("0", "root")
