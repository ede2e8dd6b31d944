# SPDX-License-Identifier: Apache-2.0
"""A small table's op arguments placed as the CUDA ops take them (csrc/ops/lookup_ops_cuda.cpp),
for each payload placement: what the CUDA tests and benchmarks.gpu_check pass to the ops."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # gpu_check imports ibpembed only once a phase runs (it may build it first)
    from ibpembed.codec import CompressedTable, TableArgs


def device_args(c: CompressedTable, dev: torch.device, where: str = "registered") -> TableArgs:
    """``c.op_args()`` with the small tensors on ``dev`` and the payload: ``"registered"``, placed
    as the table store places it (``placement.place_table``: registered in place, read through
    its device alias); ``"pinned"``, a page-locked copy (``pin_memory()``); ``"device"``, in GPU
    memory; ``"host"``, pageable (which the CUDA ops reject). With a CPU ``dev`` (gpu_check
    --dry-run) these are the CPU ops' arguments."""
    from ibpembed.tables import placement

    gpu = dev.type == "cuda"
    if where == "registered" and gpu:
        aliases = placement.HostAliases(placement.cuda_register(dev))
        return placement.place_table(c, dev, aliases).op_args()
    if where == "pinned" and gpu:
        payload = c.payload.pin_memory()
    elif where == "device":
        payload = c.payload.to(dev)
    elif where in ("registered", "pinned", "host"):
        payload = c.payload
    else:
        raise ValueError(f"unknown payload placement {where!r}")
    args = c.op_args()
    return args._replace(
        payload=payload,
        block_base=args.block_base.to(dev),
        row_units=args.row_units.to(dev),
        bitmask=args.bitmask.to(dev),
        mask=args.mask.to(dev),
        bitval=args.bitval.to(dev),
    )
