# SPDX-License-Identifier: Apache-2.0
"""The startup self-test that decides whether a server may run its kernels on the GPU.

Before a server on a CUDA node reports SERVING, it decodes a sample of rows of every loaded table
with the CUDA kernels and compares them bit for bit with the CPU path (the oracle every CPU test
checks). CUDA is used only when that passes: ``--device auto`` serves on the CPU otherwise, and
says so loudly in the log; ``--device cuda`` refuses to serve (:class:`SelfTestFailed`). A CUDA
error while decoding counts as a failure like a mismatch.

Torch-only (no transport): the server calls :func:`choose_device` between loading its tables
and reporting SERVING.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ibpembed.codec import CompressedTable
from ibpembed.engine import cuda_kernels_present, resolve_device

log = logging.getLogger(__name__)

# Rows compared per table: spread over the whole table (first, last and evenly spaced between),
# so every index block class and the raw-row copy path are likely met, in a few ms per table.
SAMPLE_ROWS = 1024

# Decodes ``ids`` of a table on the device under test and returns the rows on the CPU.
Decoder = Callable[[CompressedTable, torch.Tensor], torch.Tensor]


class SelfTestFailed(ValueError):
    """The CUDA kernels disagreed with the CPU path, or failed, on the loaded tables."""


@dataclass(frozen=True)
class SelfTestReport:
    """What the self-test compared, and the first problem found (None: every row matched)."""

    tables: int
    rows: int
    problem: str | None

    @property
    def passed(self) -> bool:
        return self.problem is None


def sample_ids(num_rows: int, count: int = SAMPLE_ROWS) -> torch.Tensor:
    """Up to ``count`` distinct row ids spread over ``[0, num_rows)``, first and last included."""
    if num_rows <= count:
        return torch.arange(num_rows, dtype=torch.int64)
    return torch.unique(torch.linspace(0, num_rows - 1, count).round().to(torch.int64))


def cuda_gather(table: CompressedTable, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` decoded by the CUDA kernels (ids on the GPU, as the engine sends them)."""
    rows = table.gather(ids.to("cuda"))
    torch.cuda.synchronize()
    return rows.cpu()


def _bits(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(torch.uint8)


def self_test(
    tables: Mapping[str, CompressedTable],
    *,
    decode: Decoder = cuda_gather,
    rows_per_table: int = SAMPLE_ROWS,
) -> SelfTestReport:
    """Compare ``decode`` with the CPU path on a sample of every table, bit for bit."""
    rows = 0
    for name, table in sorted(tables.items()):
        ids = sample_ids(table.num_rows, rows_per_table)
        expected = table.gather(ids)
        try:
            got = decode(table, ids)
        except Exception as exc:  # a CUDA error (launch, illegal address) is a failed test
            return SelfTestReport(len(tables), rows, f"table {name!r}: decoding failed: {exc!r}")
        if got.shape != expected.shape or got.dtype != expected.dtype:
            return SelfTestReport(
                len(tables),
                rows,
                f"table {name!r}: got {got.dtype} {list(got.shape)}, "
                f"expected {expected.dtype} {list(expected.shape)}",
            )
        differs = (_bits(got) != _bits(expected)).reshape(ids.numel(), -1).any(dim=1)
        if bool(differs.any()):
            bad = ids[differs]
            return SelfTestReport(
                len(tables),
                rows,
                f"table {name!r}: {bad.numel()} of {ids.numel()} sampled rows differ from the "
                f"CPU path (first: row {int(bad[0])})",
            )
        rows += ids.numel()
    return SelfTestReport(len(tables), rows, None)


def choose_device(
    requested: str,
    tables: Mapping[str, CompressedTable],
    *,
    cuda_present: Callable[[], bool] = cuda_kernels_present,
    decode: Decoder = cuda_gather,
) -> torch.device:
    """Where the kernels run: ``requested`` (``cpu``, ``cuda``, ``auto``) checked against the
    hardware and, for CUDA, against the self-test on ``tables``.

    Raises
    ------
    ValueError
        ``cuda`` without a usable GPU and CUDA kernels (:func:`~ibpembed.engine.resolve_device`).
    SelfTestFailed
        ``cuda`` and the self-test failed.
    """
    if requested == "cpu" or (requested == "auto" and not cuda_present()):
        return resolve_device("cpu")
    if requested == "cuda" and not cuda_present():
        return resolve_device("cuda")  # raises, saying what is missing
    report = self_test(tables, decode=decode)
    if report.passed:
        log.info(
            "CUDA self-test passed: %d rows of %d tables decoded on the GPU match the CPU path",
            report.rows,
            report.tables,
        )
        return torch.device("cuda")
    if requested == "cuda":
        raise SelfTestFailed(
            f"CUDA self-test failed: {report.problem}; --device cuda does not serve with "
            "kernels that disagree with the CPU path (--device auto serves on the CPU instead)"
        )
    log.error(
        "CUDA SELF-TEST FAILED: %s. The GPU kernels disagree with the CPU path on the loaded "
        "tables: serving on the CPU instead (--device auto). Report this with the GPU model, "
        "driver and ibpembed build.",
        report.problem,
    )
    return torch.device("cpu")
