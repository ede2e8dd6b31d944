# SPDX-License-Identifier: Apache-2.0
"""CUDA execution: which device serves, each worker thread's CUDA stream, and results copied
back to the host. The kernels themselves are the ops the CPU path calls (``codec``), dispatched
on the tensors' device."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

# The oldest GPU the CUDA kernels run on (setup.py builds sm_80, sm_90 and compute_90 PTX).
MIN_CUDA_CAPABILITY = (8, 0)


def cuda_kernels_present() -> bool:
    """A GPU the CUDA kernels run on, and a build that has them."""
    return (
        torch.cuda.is_available()
        and torch._C._dispatch_has_kernel_for_dispatch_key("ibpembed::ibp_gather", "CUDA")
        # The kernels use sm_80 instructions (cp.async, __reduce_add_sync).
        and torch.cuda.get_device_capability() >= MIN_CUDA_CAPABILITY
    )


def resolve_device(device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when a GPU and the CUDA kernels are present).

    A server decides with :func:`ibpembed.selftest.choose_device`, which also runs the CUDA
    kernels once on its tables before trusting them."""
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    has_cuda_kernels = cuda_kernels_present()
    if device == "cuda" and not has_cuda_kernels:
        raise ValueError(
            "--device cuda needs an ibpembed build with CUDA kernels and a GPU of compute "
            f"capability >= {MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} "
            f"(cuda available: {torch.cuda.is_available()})"
        )
    return torch.device("cuda" if device != "cpu" and has_cuda_kernels else "cpu")


# Where each array of an upload starts in the staging buffer: 16-byte aligned, so every
# array's view has its dtype's alignment and the kernels' vector loads stay aligned.
_ALIGN = 16


def _packed(arrays: Sequence[np.ndarray | None]) -> tuple[list[int], int]:
    """Byte offset of each array in a buffer holding them back to back, and its size."""
    starts, end = [], 0
    for a in arrays:
        starts.append(end)
        if a is not None:
            end += -(-a.nbytes // _ALIGN) * _ALIGN
    return starts, end


class _Staging:
    """A worker thread's page-locked staging buffer, grown as requests need, and the event of
    its last copy (the buffer is rewritten only once that copy has read it)."""

    def __init__(self) -> None:
        self.host = torch.empty(0, dtype=torch.uint8)
        self.copied: torch.cuda.Event | None = None


class CudaStreams:
    """One CUDA stream per worker thread of an engine on ``device`` (made on first use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._local = threading.local()

    def upload(self, arrays: Sequence[np.ndarray | None]) -> list[torch.Tensor | None]:
        """A request's arrays (ids, offsets, weights; None stays None) on the GPU with one
        host-to-device copy from this thread's page-locked staging buffer, on its stream,
        asynchronous: three pageable copies would each stage through a driver buffer and wait
        for it. On the CPU, the arrays as tensors (no copy)."""
        if self.device.type != "cuda":
            return [None if a is None else torch.from_numpy(a) for a in arrays]
        starts, total = _packed(arrays)
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = _Staging()
        if staging.copied is not None:
            staging.copied.synchronize()  # the previous request's copy has read the buffer
        if staging.host.numel() < total:
            staging.host = torch.empty(max(total, 2 * staging.host.numel()), dtype=torch.uint8)
            staging.host = staging.host.pin_memory()
        host = staging.host.numpy()
        for a, start in zip(arrays, starts, strict=True):
            if a is not None:
                host[start : start + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
        device = staging.host[:total].to(self.device, non_blocking=True)
        staging.copied = torch.cuda.Event()
        staging.copied.record()
        out: list[torch.Tensor | None] = []
        for a, start in zip(arrays, starts, strict=True):
            if a is None:
                out.append(None)
                continue
            dtype = _TORCH_DTYPES[a.dtype]
            out.append(device[start : start + a.nbytes].view(dtype).view(a.shape))
        return out

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """On a GPU, one request's kernels: on this thread's own CUDA stream, so requests on
        different workers overlap instead of queueing on the default stream; with the ops'
        errors deferred to one check at the end (after the results were copied back, which
        synchronised the stream anyway) instead of a sync in every op. A no-op on the CPU."""
        if self.device.type != "cuda":
            yield
            return
        from ibpembed import _C

        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            _C.set_defer_cuda_errors(True)
            try:
                yield
            except BaseException:
                # This request is failing anyway: drain what its kernels reported, so that the
                # stream's next request is not blamed for it.
                with contextlib.suppress(RuntimeError, ValueError, IndexError):
                    _C.check_cuda_errors()
                raise
            finally:
                _C.set_defer_cuda_errors(False)
            _C.check_cuda_errors()


_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}


def to_host(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """GPU results copied to the host with one copy for all of them (each a separate copy and
    sync would cost more than a small request's kernel)."""
    if not values:
        return values
    flat = torch.cat([v.reshape(-1) for v in values]).cpu()
    parts = torch.split(flat, [v.numel() for v in values])
    return [p.view(v.shape) for p, v in zip(parts, values, strict=True)]
