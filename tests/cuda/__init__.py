# SPDX-License-Identifier: Apache-2.0
"""CUDA-path tests; they skip with the reason where no GPU (or no CUDA build) is there."""

from __future__ import annotations

import torch


def cuda_kernels_missing() -> str | None:
    """Why the ibpembed CUDA kernels cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("ibpembed::ibp_gather", "CUDA"):
        return "ibpembed._C was built without its CUDA kernels"
    return None
