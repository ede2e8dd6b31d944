# SPDX-License-Identifier: Apache-2.0
"""CUDA-path tests; they skip with the reason where no GPU (or no CUDA build) is there."""

from __future__ import annotations

import numpy as np
import torch


def cuda_kernels_missing() -> str | None:
    """Why the ibpembed CUDA kernels cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("ibpembed::ibp_gather", "CUDA"):
        return "ibpembed._C was built without its CUDA kernels"
    return None


def request_ids(
    rng: np.random.Generator, num_rows: int, n: int, hot_copies: int = 70
) -> torch.Tensor:
    """Unsorted ids with duplicates: one id `hot_copies` times (past a warp's run cap of 32, so a
    gather splits it over several warps), both ends of the table, the rest uniform."""
    ids = rng.integers(0, num_rows, n)
    ids[: min(n, hot_copies)] = rng.integers(0, num_rows)
    ids = np.concatenate([ids, [0, num_rows - 1, num_rows - 1]])
    rng.shuffle(ids)
    return torch.from_numpy(ids)
