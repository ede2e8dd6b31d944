# SPDX-License-Identifier: Apache-2.0
"""A real ``tritonserver`` as a child process on loopback, for tests and benchmarks.

The server is the binary inside the ``nvidia-pytriton`` wheel (requirements/triton.txt, installed
with ``--no-deps``), with its Python backend. The backend needs its stub for this interpreter's
Python version next to it; the wheel keeps the stubs apart, so a backend directory of links is
assembled in a temporary directory (nothing in the installed wheel is modified). The model's
``model.py`` imports torch and ibpembed from this venv: the venv's ``bin`` goes first on PATH and
its site-packages, ``service/`` and ``clients/python/`` on PYTHONPATH.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from ibpembed.triton.local import python_backend_dir, tritonserver_root

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonProcess:
    """``tritonserver --model-repository=REPO`` on free loopback ports; waits until ready.

    Parameters
    ----------
    repository : the model repository.
    flags : extra ``tritonserver`` flags (``--model-control-mode=explicit``, ...).
    wait : block until ``/v2/health/ready`` answers 200.
    env : extra environment variables (``OMP_NUM_THREADS`` for the models' torch, ...).
    """

    def __init__(
        self,
        repository: str | os.PathLike[str],
        *flags: str,
        wait: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        root = tritonserver_root()
        if root is None:
            raise RuntimeError(
                "nvidia-pytriton is not installed: pip install --no-deps -r requirements/triton.txt"
            )
        self._tmp = tempfile.TemporaryDirectory(prefix="ibpembed-triton-")
        backends = python_backend_dir(root, Path(self._tmp.name))
        self.http_port, self.grpc_port, self.metrics_port = (_free_port() for _ in range(3))
        argv = [
            str(root / "bin" / "tritonserver"),
            f"--model-repository={repository}",
            f"--backend-directory={backends}",
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--log-verbose=0",
            *flags,
        ]
        site = sysconfig.get_paths()["purelib"]
        python_path = os.pathsep.join(
            [str(REPO / "service"), str(REPO / "clients" / "python"), str(REPO), site]
        )
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": python_path,
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.http = f"127.0.0.1:{self.http_port}"
        self.grpc = f"127.0.0.1:{self.grpc_port}"
        if wait:
            self.wait_ready()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)

    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Block until the server reports ready (every model loaded), or fail with its log."""
        give_up = time.monotonic() + timeout
        url = f"http://{self.http}/v2/health/ready"
        while time.monotonic() < give_up:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(
            f"tritonserver not ready (exit {self.proc.poll()}):\n{self.log()[-6000:]}"
        )

    def metrics(self) -> str:
        """The Prometheus exposition of Triton's metrics endpoint."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (Triton unloads its models and exits), SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._tmp.cleanup()
        return self.proc.returncode

    def __enter__(self) -> TritonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
