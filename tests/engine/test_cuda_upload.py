# SPDX-License-Identifier: Apache-2.0
"""A request's one upload (CudaStreams.upload): where each array lies in the staging buffer, and
the CPU engine's arrays used in place. The copy to a GPU is tested in
tests/cuda/test_hbm_tier_gpu.py."""

from __future__ import annotations

import numpy as np
import torch

from ibpembed.engine.cuda import CudaStreams, _packed


def test_arrays_pack_back_to_back_at_16_byte_offsets() -> None:
    arrays = [np.zeros(3, np.int64), None, np.zeros(5, np.float32), np.zeros(1, np.int64)]
    starts, total = _packed(arrays)
    assert starts == [0, 32, 32, 64] and total == 80


def test_on_the_cpu_the_arrays_are_used_in_place() -> None:
    ids = np.arange(7, dtype=np.int64)
    offsets = np.array([0, 3, 7], dtype=np.int64)
    got = CudaStreams(torch.device("cpu")).upload([ids, offsets, None])
    assert got[2] is None
    assert got[0].data_ptr() == ids.ctypes.data and got[1].data_ptr() == offsets.ctypes.data
