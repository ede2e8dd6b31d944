# SPDX-License-Identifier: Apache-2.0
"""Where the big tables' rows live for the CUDA ops: page-locked host buffers, as the server makes
them. A small table's op arguments for each payload placement: tools.device_args."""

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
