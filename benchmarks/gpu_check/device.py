# SPDX-License-Identifier: Apache-2.0
"""Where the CUDA ops' arguments live: page-locked host buffers for the big tables, and a small
table's op arguments for each payload placement (registered in place, pinned copy, GPU memory,
pageable)."""

from __future__ import annotations

import torch

from benchmarks.gpu_check.common import anonymous_bytes


class Pinned:
    """Page-locked host buffers for the big tables, as the server makes them.

    ``mode="register"``: plain host memory, filled by the caller, then registered in place
    (``place``) with its device alias wrapped once (``ibpembed._C.host_mapped_alias``, what the
    table store does with the mapped files); the CUDA ops then read the alias, a CUDA tensor.
    Registered read-only after it is written, so the pin holds the written pages (a read-only
    pin of never-touched memory may hold the zero page). ``mode="copy"``: torch's pinned
    allocator (the fallback when registration fails; it rounds sizes up to a power of two); the
    ops then resolve the pinned CPU tensor's device pointer per call. No GPU: plain host memory.
    ``anonymous_added``: the RssAnon the registrations added (should be about none).
    """

    def __init__(self, gpu: bool, mode: str = "register") -> None:
        self.gpu = gpu
        self.mode = mode
        self.aliases: dict[int, torch.Tensor] = {}  # host address -> device alias
        self.anonymous_added = 0
        self.registered_bytes = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        pin = self.gpu and self.mode == "copy"
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def place(self, buf: torch.Tensor) -> None:
        """Registers ``buf`` (one of this object's buffers, written) in place, in register mode."""
        if not self.gpu or self.mode != "register":
            return
        from ibpembed import _C

        before = anonymous_bytes()
        alias = _C.host_mapped_alias(buf, True, torch.cuda.current_device())
        self.anonymous_added += anonymous_bytes() - before
        self.registered_bytes += buf.numel()
        self.aliases[buf.data_ptr()] = alias

    def on_device(self, host: torch.Tensor) -> torch.Tensor:
        """What the CUDA ops read for ``host`` (one of this object's buffers)."""
        return self.aliases.get(host.data_ptr(), host)

    def release(self) -> None:
        self.aliases.clear()  # the last alias view going unregisters its buffer


def device_args(c, dev: torch.device, where: str = "registered") -> tuple:
    """A CompressedTable's op arguments as the CUDA ops take them (lookup_ops_cuda.cpp), the
    small tensors on ``dev`` and the payload: ``"registered"``, placed as the table store places
    it (``placement.place_table``: registered in place, read through its device alias);
    ``"pinned"``, a page-locked copy (``pin_memory()``); ``"device"``, in GPU memory; ``"host"``,
    pageable. With a CPU ``dev`` (--dry-run) these are the CPU ops' args."""
    from ibpembed.tables import placement

    gpu = dev.type == "cuda"
    if where == "registered" and gpu:
        aliases = placement.HostAliases(placement.cuda_register(dev))
        placed = placement.place_table(c, dev, aliases)
        return (
            placed.payload,
            placed.block_base,
            placed.row_units,
            placed.bitmask,
            placed.mask,
            placed.bitval,
            c.chunk_bits,
            c.row_bytes,
            c.unit_bytes,
            c.num_rows,
        )
    payload = {
        "registered": c.payload,
        "pinned": c.payload.pin_memory() if gpu else c.payload,
        "device": c.payload.to(dev),
        "host": c.payload,
    }[where]
    small = (c.block_base, c.row_units, c.bitmask, c.mask, c.bitval)
    return (
        payload,
        *(t.to(dev) for t in small),
        c.chunk_bits,
        c.row_bytes,
        c.unit_bytes,
        c.num_rows,
    )
