# SPDX-License-Identifier: Apache-2.0
"""The image's requirements: requirements/runtime.txt alone, in a fresh venv, runs
``ibpembed serve`` and answers a lookup; none of the development pins is needed or present.

The venv gets the runtime pins (torch from the machine's local wheels), the client package
installed non-editable with ``--no-deps``, and the server package from this checkout
(``PYTHONPATH=service``, with its built extension): building the extension again here would
only repeat what the image's build stage does.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "requirements" / "runtime.txt"
# What the image must not carry: the dev, test and benchmark pins.
DEV_ONLY = ("pytest", "ruff", "pandas", "fbgemm_gpu", "grpc_tools", "hypothesis", "matplotlib")


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-r"):
            name, version = line.split("==")
            found[name.lower()] = version
    return found


def test_runtime_pins_are_the_packages_dependencies_and_nothing_else():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert set(pins(RUNTIME)) == needed
    # The development set installs the same versions (dev.txt -> base.txt -> runtime.txt).
    assert "-r runtime.txt" in (ROOT / "requirements" / "base.txt").read_text()


@pytest.mark.skipif(not hasattr(sys, "_base_executable"), reason="needs a venv-capable Python")
def test_a_fresh_venv_with_the_runtime_requirements_serves(tmp_path: Path):
    venv = tmp_path / "venv"
    base = sys._base_executable
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "-r", str(RUNTIME)], check=True, timeout=1200)
    subprocess.run([*pip, "--no-deps", str(ROOT / "clients" / "python")], check=True, timeout=300)
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT / "service"),
        "PYTHONUNBUFFERED": "1",
    }
    for module in DEV_ONLY:
        probe = subprocess.run(
            [python, "-c", f"import {module}"], env=env, capture_output=True, timeout=120
        )
        assert probe.returncode != 0, f"{module} is importable from the runtime requirements"
    serve = ("serve", "--port", "0", "--metrics-port", "0", "--demo-max-rows", "300")
    server = subprocess.Popen(
        [python, "-m", "ibpembed.cli", *serve],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert server.stdout is not None
        target = ""
        for line in server.stdout:
            if line.startswith("listening on "):
                target = line.split()[2]
                break
        assert target, "the server exited before serving"
        # The fresh venv's own client, torch-free, asks the server.
        query = (
            "import sys; from ibpembed_client import LookupClient; "
            f"r = LookupClient('{target}', timeout=60).lookup({{'cat_0': [[1, 2]]}}); "
            "sys.exit(0 if r['cat_0'].shape == (1, 128) else 1)"
        )
        asked = subprocess.run(
            [python, "-c", query],
            env={**env, "PYTHONPATH": ""},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert asked.returncode == 0, asked.stderr
    finally:
        server.terminate()
        server.wait(timeout=120)
    assert server.returncode == 0
