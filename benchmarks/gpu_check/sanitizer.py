# SPDX-License-Identifier: Apache-2.0
"""Phase ``sanitizer``, last: compute-sanitizer memcheck and racecheck over the tiny correctness
cases with asynchronous staging (cp.async, the default and the path the emulator is weakest on:
it treats collectives as fences). Each run is a child of the driver's, under its own limit."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol

RUNS = (("memcheck", "async"), ("racecheck", "async"))
LIMIT_S = 75.0  # each sanitizer run; a slower one is killed and recorded as such
TOOL = "/usr/local/cuda/bin/compute-sanitizer"


class Runner(Protocol):
    gpu: bool

    def run(self, key: str, phase: str, options: list[str] | None = None, **kwargs) -> dict: ...

    def record(self, key: str, result: dict) -> None: ...


def run_sanitizer(driver: Runner) -> None:
    tool = shutil.which("compute-sanitizer") or TOOL
    if not driver.gpu or not Path(tool).exists():
        driver.record("sanitizer", {"skipped": "no GPU" if not driver.gpu else f"no {tool}"})
        return
    for name, mode in RUNS:
        wrapper = [tool, "--tool", name, "--error-exitcode", "97"]
        # Without torch's caching allocator every tensor is its own allocation, so memcheck
        # sees an access past a tensor even inside a cached block.
        driver.run(
            f"sanitizer_{name}_{mode}",
            "sanitizer",
            ["--tiny", "--staging", mode],
            env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
            wrapper=wrapper,
            limit_s=LIMIT_S,
        )
