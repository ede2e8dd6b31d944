# SPDX-License-Identifier: Apache-2.0
"""README.md's shared-memory snippet runs as written (alone, in a fresh torch-free interpreter)
against a real `ibpembed serve` of the embedded demo table set."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEFAULT_TARGET = "127.0.0.1:50051"


def _snippet(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_the_shared_memory_snippet_runs_alone() -> None:
    code = _snippet("SharedMemoryRegion.create")
    assert DEFAULT_TARGET in code
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "clients" / "python")]),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "ibpembed.cli", "serve", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--demo-max-rows", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    assert server.stdout is not None
    try:
        port = None
        for line in server.stdout:
            if line.startswith("listening on "):
                port = int(line.split()[2].rsplit(":", 1)[1])
                break
        assert port is not None, "the server did not start"
        # The snippet as written, with this server's port and a region name of this test's own.
        runnable = code.replace(DEFAULT_TARGET, f"127.0.0.1:{port}").replace(
            '"/frontend-0"', f'"/ibpembed-readme-{os.getpid()}"'
        )
        runnable += '\nassert result["cat_0"].shape == (2, 128), result["cat_0"].shape\n'
        client_env = {**os.environ, "PYTHONPATH": str(ROOT / "clients" / "python")}
        done = subprocess.run(
            [sys.executable, "-c", runnable], capture_output=True, text=True, timeout=120,
            env=client_env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)
