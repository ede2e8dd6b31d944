# SPDX-License-Identifier: Apache-2.0
"""Phase ``h2d``: the pinned host-to-device copy bandwidth of 1 GiB, the ceiling the zero-copy
gathers are measured against."""

from __future__ import annotations

import torch

from benchmarks.gpu_check.common import GIB
from benchmarks.gpu_check.device import Pinned
from benchmarks.gpu_check.timing import timed


def h2d_bandwidth(pinned: Pinned, gpu: bool) -> dict[str, float] | None:
    """GB/s by the wall clock and by CUDA events; None on the CPU."""
    if not gpu:
        return None
    src = pinned.empty(GIB)
    src.fill_(1)
    pinned.place(src)
    dst = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    t = timed(lambda: dst.copy_(src, non_blocking=True), gpu, budget_s=1.0)
    assert t.event_s is not None
    return {"wall": GIB / t.wall_s / 1e9, "event": GIB / t.event_s / 1e9}
