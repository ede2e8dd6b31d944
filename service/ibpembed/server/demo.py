# SPDX-License-Identifier: Apache-2.0
"""The embedded demo table set: DLRM-DCNv2-profile tables built in-process, deterministically.

``ibpembed serve`` with no ``--tables`` serves this, so the first command in the README starts a
working server with no download. It is the MLPerf DLRM-DCNv2 (Criteo 1TB) profile scaled down:
26 categorical features ``cat_0`` ... ``cat_25``, each its own table, with the benchmark's
cardinalities capped at ``max_rows`` and D = 128. Values look trained rather than uniform: rows
are Gaussian with log-normally spread norms, a few rows are all zero (never-seen ids) and a few
are outliers (IBP's weak spot), and every fourth table is bf16-rounded (stored as fp32), like a
model trained in bf16. The same ``max_rows`` and ``seed`` always give bit-identical tables.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ibpembed.codec import CompressedTable, compress
from ibpembed_client.workload import DCNV2_CARDINALITIES

DIM = 128


__all__ = ["DIM", "build", "feature_names"]


def feature_names() -> list[str]:
    """``cat_0`` ... ``cat_25``."""
    return [f"cat_{i}" for i in range(len(DCNV2_CARDINALITIES))]


def demo_table(rows: int, dim: int, seed: int, *, bf16_rounded: bool) -> torch.Tensor:
    """One trained-looking fp32 table [rows, dim]."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, dim, generator=gen)
    # Trained tables have a wide spread of row norms (frequent ids move further from init).
    table *= 0.02 * torch.exp(0.5 * torch.randn(rows, 1, generator=gen))
    picks = torch.randperm(rows, generator=gen)
    zeros, outliers = picks[: max(1, rows // 1000)], picks[-max(1, rows // 2000) :]
    table[zeros] = 0.0
    table[outliers] *= 50.0
    if bf16_rounded:
        table = table.to(torch.bfloat16).to(torch.float32)
    return table


def build(
    max_rows: int = 20000,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, CompressedTable]:
    """The 26 compressed demo tables, keyed by feature name (~2 s on 2 cores). ``progress(done,
    total)``: tables built so far, before the first and after each."""
    tables = {}
    total = len(DCNV2_CARDINALITIES)
    if progress is not None:
        progress(0, total)
    for i, (name, cardinality) in enumerate(zip(feature_names(), DCNV2_CARDINALITIES, strict=True)):
        raw = demo_table(min(cardinality, max_rows), DIM, seed + i, bf16_rounded=i % 4 == 3)
        # 1024 sampled rows fit masks as good as 4096 do here (same stored size), 3x faster.
        tables[name] = compress(raw, sample_rows=1024, seed=seed)
        if progress is not None:
            progress(i + 1, total)
    return tables
