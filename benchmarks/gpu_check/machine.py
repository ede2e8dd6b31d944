# SPDX-License-Identifier: Apache-2.0
"""The machine's facts the numbers depend on: GPU, driver, PCIe link, host kernel, THP mode,
HMM, memory. Each read is best effort: a fact that cannot be read is recorded as None."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.common import GIB

NVIDIA_SMI_FIELDS = (
    "name",
    "driver_version",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
    "memory.total",
)


def read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def nvidia_smi() -> dict[str, str] | None:
    """nvidia-smi's view of GPU 0 (the link generation reads its current, possibly idle-lowered,
    state: the max fields say what it trains to)."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}",
                "--format=csv,noheader,nounits",
                "--id=0",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in out.strip().split(",")]
    return dict(zip(NVIDIA_SMI_FIELDS, values, strict=False))


def mem_total_gib() -> float | None:
    for line in (read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) * 1024 / GIB, 1)
    return None


def cpu_model() -> str | None:
    for line in (read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def machine(gpu: bool) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernel": platform.release(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
        "mem_total_gib": mem_total_gib(),
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "memlock_limit": read_memlock(),
        "host": platform.node(),
    }
    if gpu:
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / GIB, 1),
            "sms": props.multi_processor_count,
            "cuda": torch.version.cuda,
            "nvidia_smi": nvidia_smi(),
            # 1: the UVM driver runs without HMM (heterogeneous memory management).
            "uvm_disable_hmm": read("/sys/module/nvidia_uvm/parameters/uvm_disable_hmm"),
        }
    return info


def read_memlock() -> str | None:
    """RLIMIT_MEMLOCK, which a VM's limits on locked memory show up in."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
