# SPDX-License-Identifier: Apache-2.0
"""Phase ``preflight``: registration in place and a zero-copy read of it before anything depends
on them (``register`` says whether the later phases register in place or fall back to
page-locked copies), and whether registering a table file in place keeps host memory in place.

A table file is mapped as the store maps it for a GPU (read-only shared, ``format.read_table``'s
``shared``), every page faulted in (``placement.prefault``), then registered read-only: RssAnon
must not grow by the file (``shared``). The same for a copy-on-write mapping (``private``), the
store's CPU mapping: on Linux >= 6.2 a long-term pin of it copies every page into anonymous
memory, which is why the GPU's mapping differs. Without a GPU the mappings and the prefault run
and registration is skipped."""

from __future__ import annotations

import mmap
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.common import CACHE, GIB, MIB, anonymous_bytes, same_bits
from tools.device_args import device_args

SHARED_BYTES = 4 * GIB  # about a real table set's payload: a pin's cost shows at this size
PRIVATE_BYTES = 1 * GIB
DRY_RUN_BYTES = 64 * MIB
IN_PLACE_SLACK = 64 * MIB  # RssAnon a registration may add (the driver's own bookkeeping)


def write_file(path: Path, nbytes: int) -> None:
    chunk = torch.randint(0, 256, (min(nbytes, 64 * MIB),), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(chunk)):
            f.write(chunk[: nbytes - start])


def register_mapping(path: Path, nbytes: int, shared: bool, gpu: bool) -> dict[str, Any]:
    """Maps the first ``nbytes`` of ``path`` (shared read-only, or copy-on-write), faults them
    in, registers them read-only (on a GPU) and reads them back zero-copy; the RssAnon each step
    added."""
    from ibpembed.tables.placement import prefault

    access = mmap.ACCESS_READ if shared else mmap.ACCESS_COPY
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), nbytes, access=access)
    whole = frombuffer(mapping)  # one storage over the mapping, as read_table's tensors share
    info: dict[str, Any] = {"bytes": whole.numel()}
    before = anonymous_bytes()
    start = time.perf_counter()
    prefault(whole)
    info["prefault_s"] = round(time.perf_counter() - start, 2)
    info["prefault_anonymous_added"] = anonymous_bytes() - before
    if not gpu:
        info["registration"] = "skipped: no GPU"
        return info
    from ibpembed import _C

    before = anonymous_bytes()
    start = time.perf_counter()
    try:
        alias = _C.host_mapped_alias(whole, True, torch.cuda.current_device())
    except RuntimeError as exc:
        info["error"] = repr(exc)
        return info
    info["register_s"] = round(time.perf_counter() - start, 2)
    info["anonymous_added"] = anonymous_bytes() - before
    info["reads_back"] = bool(torch.equal(alias[-4096:].cpu(), whole[-4096:]))
    start = time.perf_counter()
    del alias  # unregisters
    info["unregister_s"] = round(time.perf_counter() - start, 2)
    return info


def frombuffer(mapping: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # a shared mapping is read-only; nothing here writes it
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


def phase_preflight(gpu: bool) -> dict[str, Any]:
    info: dict[str, Any] = {}
    shared_bytes, private_bytes = (SHARED_BYTES, PRIVATE_BYTES) if gpu else (DRY_RUN_BYTES,) * 2
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        path = Path(tmp) / "table.bin"
        start = time.perf_counter()
        write_file(path, max(shared_bytes, private_bytes))
        info["file_write_s"] = round(time.perf_counter() - start, 1)
        # The private mapping first: its page copies are freed before the shared one is measured.
        info["private"] = register_mapping(path, private_bytes, shared=False, gpu=gpu)
        info["shared"] = register_mapping(path, shared_bytes, shared=True, gpu=gpu)
    added = info["shared"].get("anonymous_added", info["shared"]["prefault_anonymous_added"])
    info["shared_stays_in_place"] = added < IN_PLACE_SLACK
    if not gpu:
        info["register"] = True
        return info
    from ibpembed import _C, compress
    from ibpembed._ops import ops

    device = torch.cuda.current_device()
    info["read_only_supported"] = _C.host_register_read_only_supported(device)
    buffer = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8)
    alias = _C.host_mapped_alias(buffer, True, device)
    info["alias_reads_back"] = bool(torch.equal(alias[-4096:].cpu(), buffer[-4096:]))
    del alias
    table = compress(torch.randn(4096, 64))
    got = ops.ibp_gather(*device_args(table, torch.device("cuda")), torch.arange(4096).cuda())
    info["registered_gather_exact"] = same_bits(got.cpu(), ops.ibp_decompress(*table.op_args()))
    info["register"] = info["alias_reads_back"] and info["registered_gather_exact"]
    return info
