# SPDX-License-Identifier: Apache-2.0
"""What every phase of gpu_check shares: sizes, the check tally, the switches the CUDA ops read
from the environment, and how a CUDA fault is told apart from a refused input."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "benchmarks" / ".cache"  # build outputs and phase files a later run reuses
GIB = 1 << 30
MIB = 1 << 20
ROW_BYTES = (64, 256, 512, 1024)
BATCHES = (1024, 4096, 16384, 65536)
# Below this many ids a call's fixed costs (launch, sync) dominate its time: compressed-vs-raw is
# reported there, judged only at and above it.
JUDGED_MIN_BATCH = 16384
BAG_SIZE = 16  # ids per bag in the pooled timings
# A GPU reads zero-copy host memory in 32-byte sectors: the wire cost of a slot is the sectors
# it touches, not its bytes (docs/cuda.md, *What compression saves on the wire*).
SECTOR_BYTES = 32
POOLED_1K_CALL_S = 20e-6  # the fixed-cost target for a pooled call of 1k ids
STAGING_ENV = "IBPEMBED_CUDA_STAGING"  # async (cp.async) or sync (plain loads)
SORT_ENV = "IBPEMBED_CUDA_SORT_MIN_IDS"  # gathers of at least this many ids sort them first
DECODE_ENV = "IBPEMBED_CUDA_DECODE"  # decode, or copy: the gather's copy-without-decode mode


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@dataclass
class Checks:
    passed: int = 0
    failures: list[str] | None = None
    kinds: dict[str, int] | None = None  # checks passed, by kind (default: the label's 1st word)

    def record(self, ok: bool, what: str, kind: str | None = None) -> None:
        if ok:
            self.passed += 1
            kind = kind or what.split()[0]
            self.kinds = {**(self.kinds or {}), kind: (self.kinds or {}).get(kind, 0) + 1}
            return
        self.failures = [*(self.failures or []), what]
        log(f"  FAIL {what}")


class CudaFault(RuntimeError):
    """A CUDA error that leaves the process's context unusable (an illegal address, a launch
    failure): the phase stops, writes what it has, and the driver decides what runs next."""


def is_cuda_fault(exc: BaseException) -> bool:
    """Errors the ops raise on bad input are ValueError/IndexError/TypeError; a CUDA runtime
    error surfaces as another RuntimeError (torch.AcceleratorError in newer torch) naming CUDA."""
    if isinstance(exc, (ValueError, IndexError, TypeError, CudaFault)):
        return False
    return isinstance(exc, RuntimeError) and "CUDA" in str(exc)


@contextlib.contextmanager
def env(name: str, value: str) -> Iterator[None]:
    """The CUDA ops run with environment variable ``name`` set to ``value`` (they read their
    switches at every launch), restored afterwards."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def staging(mode: str) -> contextlib.AbstractContextManager[None]:
    """IBPEMBED_CUDA_STAGING=mode (async: cp.async, sync: plain loads)."""
    return env(STAGING_ENV, mode)


def sort_min_ids(n: int) -> contextlib.AbstractContextManager[None]:
    """IBPEMBED_CUDA_SORT_MIN_IDS=n (0: always sort)."""
    return env(SORT_ENV, str(n))


@contextlib.contextmanager
def deferred_errors(gpu: bool) -> Iterator[None]:
    """The CUDA ops with their errors deferred, as the engine runs them (no sync inside each
    call), checked at the end; nothing on the CPU."""
    if not gpu:
        yield
        return
    from ibpembed import _C

    _C.set_defer_cuda_errors(True)
    try:
        yield
        _C.check_cuda_errors()
    finally:
        _C.set_defer_cuda_errors(False)


def has_baseline() -> bool:
    """Whether the UVA baseline is loaded (``torch.ops.ibpembed_bench``)."""
    try:
        return hasattr(torch.ops.ibpembed_bench, "uva_gather")
    except (AttributeError, RuntimeError):
        return False


def anonymous_bytes() -> int:
    """This process's resident anonymous memory (RssAnon; Linux, else 0): what a copy of a
    payload (pin_memory, or copy-on-write pages of a mapped file) adds, where pages of the file
    itself count as file pages."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def import_ibpembed():
    """ibpembed from this checkout (service/), with the extension just built."""
    import sys

    for path in (str(ROOT), str(ROOT / "service")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import ibpembed
    from ibpembed import _ops

    return ibpembed, _ops
