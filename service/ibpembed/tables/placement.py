# SPDX-License-Identifier: Apache-2.0
"""Where each tensor of a table lives for the kernels of one device.

The CPU kernels read a table where it is. The CUDA kernels need the small tensors (index,
bitmask, masks and codebooks) in GPU memory and read the payload zero-copy from host memory
through a device alias. :func:`place_table` makes a table's copy for a device:

=================================  ==========================================================
tensor                             on a CUDA device
=================================  ==========================================================
block_base, row_units, bitmask,    copied to the device (about 1.5 bytes per row)
mask, bitval
payload                            host bytes registered in place (``cudaHostRegister``) and
                                   read through their device alias, a CUDA tensor made once
                                   per host buffer (:class:`HostAliases`); no copy
decoded tier                       dropped: a CPU-lookup cache the CUDA kernels do not read
=================================  ==========================================================

A table already on the device (payload included) keeps its tensors. Host bytes with the GPU
path are then the table files' bytes (or the row-update buffers'): nothing is copied into
page-locked memory, and torch's pinned allocator never rounds a payload up to a power of two.
That holds because a store for a GPU maps its files read-only shared (:func:`maps_shared`) and
every page is faulted in before its read-only registration (:func:`prefault`): the pin then
holds the page-cache pages themselves.
Where registration fails (a device that cannot register a read-only file mapping, a VM that
limits locked memory), the payload is copied into page-locked memory instead and the failure is
logged: slower to place, more host bytes, same results.

The table store (``TableStore(device=...)``) places every table of a snapshot it publishes, so a
snapshot owns its device copies and a row update or reload publishes fresh ones.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import mmap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ibpembed.codec import CompressedTable

log = logging.getLogger(__name__)

# (a CPU uint8 tensor over a whole storage, read-only) -> a tensor on the device aliasing it.
Register = Callable[[torch.Tensor, bool], torch.Tensor]


def maps_shared(device: torch.device) -> bool:
    """Whether table files for ``device`` are mapped read-only shared (``format.read_table``'s
    ``shared``) rather than copy-on-write: for CUDA, whose registration pins the payload pages
    long-term, and Linux >= 6.2 breaks copy-on-write for a long-term pin of a private file
    mapping (``gup_must_unshare``), copying every payload page into anonymous memory."""
    return device.type == "cuda"


def prefault(host: torch.Tensor) -> None:
    """Reads one byte of every page of ``host``, so that a read-only registration pins pages
    that hold its bytes: a page never touched would be pinned as whatever the kernel maps on a
    read fault (the shared zero page for anonymous memory), which a later write replaces under
    the pin (drivers that pin without FOLL_LONGTERM then keep reading the old page)."""
    if host.numel():
        int(host[:: mmap.PAGESIZE].sum()) + int(host[-1])  # the last page when unaligned


def cuda_register(device: torch.device) -> Register:
    """``cudaHostRegister`` in place (``ibpembed._C.host_mapped_alias``); CUDA builds only."""
    from ibpembed import _C

    index = device.index if device.index is not None else torch.cuda.current_device()
    return lambda host, read_only: _C.host_mapped_alias(host, read_only, index)


@dataclass
class _Alias:
    whole: torch.Tensor  # the device alias of the whole host storage
    users: int


class HostAliases:
    """Device aliases of host buffers, one registration per buffer (storage).

    Many payloads can share a buffer (successive row-update versions of a table view one spill
    buffer), and a range can be registered only once, so aliases are kept per storage and
    counted per placed table (``owner``): the registry lets go of a buffer's alias when the last
    table placed over it is gone, and the registration itself ends when the last view of the
    alias does (a lookup still running keeps it).

    Parameters
    ----------
    register : makes the alias of a whole host storage (default for CUDA: :func:`cuda_register`).
    read_only : ask for read-only registrations (the kernels never write a payload).
    """

    def __init__(self, register: Register, *, read_only: bool = True) -> None:
        self._register = register
        self._read_only = read_only
        self._lock = threading.Lock()
        self._aliases: dict[int, _Alias] = {}

    def __len__(self) -> int:
        """Host buffers registered now."""
        with self._lock:
            return len(self._aliases)

    def holds(self, payload: torch.Tensor) -> bool:
        """Whether the buffer under ``payload`` is registered here."""
        with self._lock:
            return payload.untyped_storage().data_ptr() in self._aliases

    def acquire(self, payload: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """The device alias of ``payload`` (a contiguous 1-D uint8 CPU tensor), and the call
        that gives it back (once; :func:`place_table` ties it to the placed table's life).

        Raises
        ------
        RuntimeError
            when the buffer cannot be registered (nothing is registered then).
        """
        if payload.device.type != "cpu" or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError("a payload alias needs a 1-D uint8 CPU tensor")
        if not payload.is_contiguous():
            raise ValueError("a payload alias needs a contiguous tensor")
        storage = payload.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            entry = self._aliases.get(key)
            if entry is None:
                whole = torch.empty(0, dtype=torch.uint8).set_(storage)
                if self._read_only:
                    prefault(whole)
                alias = self._register(whole, self._read_only)
                if alias.numel() != whole.numel():
                    raise RuntimeError(
                        f"the alias covers {alias.numel()} bytes of a {whole.numel()}-byte buffer"
                    )
                entry = self._aliases[key] = _Alias(alias, 0)
            entry.users += 1
        start = payload.storage_offset()
        return entry.whole[start : start + payload.numel()], functools.partial(self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._aliases[key]
            entry.users -= 1
            if entry.users == 0:
                del self._aliases[key]


def place_table(
    table: CompressedTable, device: torch.device, aliases: HostAliases | None = None
) -> CompressedTable:
    """``table`` as the kernels of ``device`` read it (see the module docstring): itself on the
    CPU; on another device, a new table whose small tensors are fresh copies on ``device`` and
    whose payload is the device alias of its host bytes (``aliases``), or stays where it is when
    already on a device, or is copied into page-locked memory (CUDA) when there are no aliases
    or registration fails."""
    if device.type == "cpu":
        return table

    def to_device(t: torch.Tensor) -> torch.Tensor:
        # A fresh copy even when ``t`` is already there: a snapshot owns its device tensors.
        return t.to(device, copy=True)

    payload = table.payload
    release = None
    # A buffer the registry holds is aliased again (a spill buffer shared by row-update
    # versions); other page-locked memory (torch's pinned allocator, another registration)
    # cannot be registered again, and the op reads it through its pointer as it is.
    held = aliases is not None and aliases.holds(payload)
    pinned = (
        not held and device.type == "cuda" and payload.device.type == "cpu" and payload.is_pinned()
    )
    if payload.device.type == "cpu" and aliases is not None and not pinned:
        try:
            payload, release = aliases.acquire(payload)
        except RuntimeError as exc:
            log.warning(
                "registering a %d-byte payload in place failed (%s); copying it into page-locked "
                "memory instead",
                payload.numel(),
                exc,
            )
    if payload.device.type == "cpu" and device.type == "cuda" and not pinned:
        payload = payload.pin_memory()
    placed = dataclasses.replace(
        table,
        payload=payload,
        block_base=to_device(table.block_base),
        row_units=to_device(table.row_units),
        bitmask=to_device(table.bitmask),
        mask=to_device(table.mask),
        bitval=to_device(table.bitval),
        hot=None,
    )
    if release is not None:
        weakref.finalize(placed, release)
    return placed
