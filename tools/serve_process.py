# SPDX-License-Identifier: Apache-2.0
"""The one way benchmarks, reliability campaigns and tests start ``ibpembed serve`` as a process.

A child process, not an in-process server: a crash is a dead process rather than a test
exception, and its RSS, CPU time and open descriptors can be read from ``/proc``. Both output
streams are pumped by threads into one line queue (and kept, for :meth:`ServerProcess.log`), so
a chatty server never blocks on a full pipe.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IBPEMBED = (sys.executable, "-m", "ibpembed.cli")


def proc_rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU time ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_fds(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class ServerProcess:
    """``ibpembed serve --port 0 --metrics-port 0 ...`` as a child process.

    Parameters
    ----------
    flags : extra ``serve`` flags (``--tables DIR``, TLS, token, limits).
    env : extra environment variables.
    wait : block until the banner names the port (``False``: call :meth:`wait_listening`, so
        several servers can load at once, or :meth:`wait_bound` to talk to one while it loads).
    """

    def __init__(
        self, *flags: str, env: Mapping[str, str] | None = None, wait: bool = True
    ) -> None:
        argv = [*IBPEMBED, "serve", "--port", "0", "--metrics-port", "0", *flags]
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.pid = self.proc.pid
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        for stream, sink in (
            (self.proc.stdout, self.stdout_lines),
            (self.proc.stderr, self.stderr_lines),
        ):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()
        self.port = 0
        self.target = ""
        # The last --metrics-port wins (argparse); 0 = metrics off. Set to the bound port by
        # wait_bound.
        self.metrics_port = int(argv[len(argv) - 1 - argv[::-1].index("--metrics-port") + 1])
        if wait:
            self.wait_listening()

    def wait_bound(self, timeout: float = 180.0) -> str:
        """Block until the server has bound its ports, before its tables load (health
        NOT_SERVING until they have); returns ``127.0.0.1:<port>``, sets :attr:`metrics_port`
        when metrics are on."""
        line = self.wait_for("bound ", timeout)
        self.port = int(line.split()[1].rsplit(":", 1)[1])
        self.target = f"127.0.0.1:{self.port}"
        if self.metrics_port:
            line = self.wait_for("metrics on ", timeout)
            self.metrics_port = int(line.rsplit(":", 1)[1].split("/")[0])
        return self.target

    def wait_listening(self, timeout: float = 180.0) -> str:
        """Block until the banner says the server is serving; returns ``127.0.0.1:<port>``."""
        line = self.wait_for("listening on ", timeout)
        self.port = int(line.split(":")[-1].split()[0])
        self.target = f"127.0.0.1:{self.port}"
        return self.target

    def _pump(self, stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)
            self._lines.put(line)

    def wait_for(self, text: str, timeout: float = 180.0) -> str:
        """The first output line (stdout or stderr) from now on that contains ``text``."""
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            try:
                line = self._lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self._lines.empty():
                    break
                continue
            if text in line:
                return line
        raise RuntimeError(
            f"server never printed {text!r} (exit {self.proc.poll()}):\n{self.log()[-4000:]}"
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        return proc_rss_bytes(self.pid)

    def fds(self) -> int:
        return proc_fds(self.pid)

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.pid)

    def log(self) -> str:
        """Everything the server wrote so far."""
        return "".join(self.stdout_lines) + "".join(self.stderr_lines)

    def kill(self) -> int:
        """SIGKILL, no drain: what an OOM kill or a lost node looks like to clients."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(timeout=30)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig``, wait for the exit code (SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
