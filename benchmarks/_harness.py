# SPDX-License-Identifier: Apache-2.0
"""What every benchmark shares: where results go, the run's metadata, and how they are written.

Each benchmark writes ``<name>.json`` (everything measured, plus :func:`run_metadata`) and
``<name>.md`` (its section's tables) into one results directory; ``python -m benchmarks``
renders BENCHMARKS.md from those files alone, so every number in it comes from a rerunnable
command.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"  # committed: BENCHMARKS.md is rendered from it
QUICK_RESULTS = REPO / "benchmarks" / ".cache" / "quick"  # smoke sizes, git-ignored


def cpu_model() -> str:
    """The CPU's marketing name where Linux reports it, else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return None


# What a run writes (results, the page, the charts): not the code that measured.
NOT_CODE = (":(exclude)benchmarks/results", ":(exclude)BENCHMARKS.md", ":(exclude)docs/img")


def commit() -> str:
    """The checkout's short commit, ``+dirty`` when tracked files differ from it. The results
    and the page a run writes do not count: a run of several benchmarks rewrites them as it
    goes, which says nothing about the code that measured."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_CODE],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_metadata(command: str) -> dict[str, Any]:
    """Machine, software, commit, date and load of this run (the report's header block)."""
    import torch  # benchmarks all need it; imported here so the runner itself stays light

    memory = memory_gib()
    return {
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs"
        + (f", {memory:.0f} GiB RAM" if memory else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": command,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def settings(config: dict[str, Any]) -> str:
    """A run's settings as a reader scans them: ``max_rows=100,000, seconds=2.0, batches=1/64``."""

    def shown(value: Any) -> str:
        if isinstance(value, list | tuple):
            return "/".join(shown(v) for v in value)
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        return str(value)

    return ", ".join(f"{key}={shown(value)}" for key, value in config.items())


def write_results(out: Path, name: str, result: dict[str, Any], markdown: str) -> None:
    """``out/<name>.json`` and ``out/<name>.md``, the pair the report renders from."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown.rstrip() + "\n")
