# SPDX-License-Identifier: Apache-2.0
"""The SIGBUS guard of mapped table files (csrc/ops/mapping_guard.cpp).

A served table is read through a memory mapping of its file, and a file shortened in place
makes the mapped pages past its new end raise SIGBUS, which kills the process. Once
:func:`enable` has run (``ibpembed serve`` does), every table file :func:`guard`-ed as it is
mapped gets zero pages instead of a SIGBUS on such a read, and the fault is counted against its
mapping: :func:`faulted` says which tables must not be answered from any more (their rows may
be zeros), so the engine refuses their lookups until the reload poll withdraws them. Only
truncation faults: a file rewritten in place at the same size is the poll's alone
(:mod:`ibpembed.tables.mapped_files`).
"""

from __future__ import annotations

import logging
import mmap
import warnings
import weakref

import torch

from ibpembed import _C
from ibpembed.codec import CompressedTable

log = logging.getLogger(__name__)
_enabled = False


def enable() -> None:
    """Guard the table files mapped from now on (installs the process's SIGBUS handler)."""
    global _enabled
    _C.install_mapping_guard()
    _enabled = True


def guard(data: mmap.mmap) -> None:
    """Guard a table file's mapping for as long as it is mapped (nothing unless enabled)."""
    if not _enabled or len(data) == 0:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        begin = torch.frombuffer(data, dtype=torch.uint8, count=1).data_ptr()
    slot = _C.guard_mapping(begin, len(data))
    if slot < 0:
        log.warning("every SIGBUS guard slot is taken: a table file mapped now is not guarded")
        return
    # Runs as the mapping is released, just after CPython unmaps it: for that instant the slot
    # covers freed addresses, which would absorb a SIGBUS only from another file mapped at the
    # very address and shortened within it.
    weakref.finalize(data, _C.unguard_mapping, slot)


def faults() -> int:
    """SIGBUS faults the guard absorbed since the process started (0: no table is suspect)."""
    return _C.mapping_faults_total()


def faulted(table: CompressedTable) -> bool:
    """Whether a read of ``table``'s mapped file faulted: its rows may read as zeros."""
    return any(
        _C.mapping_faults_at(t.data_ptr()) > 0
        for t in (table.payload, table.block_base, table.row_units)
        if t.numel() > 0
    )
