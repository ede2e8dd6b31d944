# SPDX-License-Identifier: Apache-2.0
"""Small test tables and the observers that record (or hold) what an engine does: for the engine
tests, and for the servers and clients the other test folders run on them."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ibpembed.codec import CompressedTable, compress
from ibpembed.engine import KernelCall
from ibpembed.tables.store import TableStore

if TYPE_CHECKING:
    import grpc

# Two features share emb_f32 (the engine groups them into one kernel call). Awkward widths:
# D=3 fp16, D=8 bf16, int8 row-wise rows of 4 + 12 bytes.
FEATURES = {
    "user": "emb_f32",
    "user_hist": "emb_f32",
    "item": "emb_bf16",
    "ctx": "emb_f16",
    "quant": "emb_q8",
}


def int8_rowwise(rows: int, codes: int, rng: np.random.Generator) -> torch.Tensor:
    """fbgemm row-wise int8 rows: fp16 scale, fp16 bias, then ``codes`` uint8 codes."""
    header = np.stack(
        [rng.uniform(0.001, 0.01, rows), rng.uniform(-0.5, 0.0, rows)], axis=1
    ).astype(np.float16)
    body = rng.integers(0, 256, (rows, codes), dtype=np.uint8)
    return torch.from_numpy(np.concatenate([header.view(np.uint8), body], axis=1))


def source_tables(seed: int = 0) -> dict[str, torch.Tensor]:
    """The rows :func:`make_tables` compresses (an oracle independent of the codec)."""
    gen = torch.Generator().manual_seed(seed)
    f32 = torch.randn(1000, 16, generator=gen) * 0.05
    f32[::97] = 0.0  # zero rows, as never-trained ids leave them
    bf16 = (torch.randn(500, 8, generator=gen) * 0.05).to(torch.bfloat16)
    f16 = (torch.randn(300, 3, generator=gen) * 0.05).to(torch.float16)
    return {
        "emb_f32": f32,
        "emb_bf16": bf16,
        "emb_f16": f16,
        "emb_q8": int8_rowwise(300, 12, np.random.default_rng(seed)),
    }


def make_tables(seed: int = 0) -> dict[str, CompressedTable]:
    return {
        name: compress(rows, quant="int8_rowwise") if name == "emb_q8" else compress(rows)
        for name, rows in source_tables(seed).items()
    }


def make_store(seed: int = 0) -> TableStore:
    return TableStore.from_tables(make_tables(seed), FEATURES)


class RecordingObserver:
    """Records every kernel call and finished RPC: an engine's observer, and a server's metrics
    hook (``ServerObserver``) too."""

    def __init__(self) -> None:
        self.kernels: list[tuple[str, str, int, int]] = []
        self.rpcs: list[tuple[str, str]] = []
        self.lookups: list[str] = []  # answered lookup requests, by method
        self.reloads: list[str] = []
        self.queue_waits: list[float] = []
        self.outputs: list[tuple[str, int]] = []  # (transport, value bytes) per request
        self.wire: list[tuple[str, float]] = []  # (phase, seconds) per request and phase

    def kernels_done(self, pooling: str, calls: Sequence[KernelCall]) -> None:
        self.kernels += [(table, pooling, nnz, unique) for table, nnz, unique, _ in calls]

    def queue_waited(self, seconds: float) -> None:
        self.queue_waits.append(seconds)

    def rpc_done(self, method: str, code: grpc.StatusCode) -> None:
        self.rpcs.append((method.rsplit("/", 1)[-1], code.name))

    def lookup_started(self, method: str, request: Any) -> str:
        return method.rsplit("/", 1)[-1]

    def lookup_done(self, token: str, seconds: float, response: Any = None) -> None:
        self.lookups.append(token)

    def lookups_abandoned(self, count: int) -> None:
        """Part of the server's hook, not recorded: tests/metrics checks the count through the
        real metrics (a cancelled stream leaves nothing in flight)."""

    def reload_done(self, result: str) -> None:
        self.reloads.append(result)

    def output_written(self, transport: str, nbytes: int) -> None:
        self.outputs.append((transport, nbytes))

    def wire_timed(self, phase: str, seconds: float) -> None:
        self.wire.append((phase, seconds))


class GateObserver(RecordingObserver):
    """Holds every request after its kernel calls until :meth:`open` (so tests control what is
    in flight); with ``holds``, only the first ``holds`` requests, and lets the later ones by.

    ``entered`` counts requests that reached the gate; ``wait_entered(n)`` blocks until n did.
    """

    holds_kernels = True  # see tests.server.helpers.RunningServer

    def __init__(self, holds: int | None = None) -> None:
        super().__init__()
        self._gate = threading.Event()
        self._cond = threading.Condition()
        self.entered = 0
        self.holds = holds

    def kernels_done(self, pooling: str, calls: Sequence[KernelCall]) -> None:
        with self._cond:
            self.entered += 1
            held = self.holds is None or self.entered <= self.holds
            self._cond.notify_all()
        if held:
            self._gate.wait(timeout=60)

    def wait_entered(self, n: int, timeout: float = 30.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.entered >= n, timeout=timeout):
                raise TimeoutError(f"only {self.entered} of {n} lookups reached the gate")

    def open(self) -> None:
        self._gate.set()
