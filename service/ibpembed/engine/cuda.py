# SPDX-License-Identifier: Apache-2.0
"""CUDA execution: which device serves, each worker thread's CUDA stream, and results copied
back to the host. The kernels themselves are the ops the CPU path calls (``codec``), dispatched
on the tensors' device."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

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


class CudaStreams:
    """One CUDA stream per worker thread of an engine on ``device`` (made on first use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._local = threading.local()

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


def to_host(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """GPU results copied to the host with one copy for all of them (each a separate copy and
    sync would cost more than a small request's kernel)."""
    if not values:
        return values
    flat = torch.cat([v.reshape(-1) for v in values]).cpu()
    parts = torch.split(flat, [v.numel() for v in values])
    return [p.view(v.shape) for p, v in zip(parts, values, strict=True)]
