# SPDX-License-Identifier: Apache-2.0
"""What a lookup takes and gives: a request's features, its options, its results, and the
observer hook the engine reports kernel calls to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

from ibpembed.errors import InvalidArgument

Pooling = Literal["sum", "mean", "none"]
POOLINGS: tuple[Pooling, ...] = ("sum", "mean", "none")
# Element types a pooled result may be rounded to (fp32 accumulation, one rounding, RNE).
OUTPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# One kernel call of a request: (table, nnz ids, unique distinct rows decoded, seconds).
KernelCall = tuple[str, int, int, float]


@dataclass(frozen=True)
class LookupOptions:
    """How one request is looked up (the same for every feature of it).

    Parameters
    ----------
    pooling : ``"sum"``, ``"mean"`` or ``"none"``.
    output_dtype : element type of pooled results: float16 or bfloat16 round each pooled value
        once, to nearest even, from its fp32 accumulation (a relative error of at most 2**-11
        resp. 2**-8, plus fp16's overflow to inf past 65504); NONE rows are never converted.
    table_version : the table-set version to read (one the store keeps); 0 = the newest.
    deadline : ``time.monotonic()`` past which the work is not started; None = none.
    output_window : the bytes of the shared-memory window the result goes to, which then
        bounds its size instead of the engine's ``max_output_bytes`` (it never enters a
        message); None = the result goes into a message.
    """

    pooling: Pooling = "sum"
    output_dtype: torch.dtype = torch.float32
    table_version: int = 0
    deadline: float | None = None
    output_window: int | None = None

    @classmethod
    def of(cls, options: LookupOptions | Pooling) -> LookupOptions:
        """``options`` itself, or the defaults with pooling ``options``."""
        return options if isinstance(options, LookupOptions) else cls(pooling=options)

    def check(self) -> None:
        """:class:`InvalidArgument` naming the field for a pooling or dtype the engine does not
        serve."""
        if self.pooling not in POOLINGS:
            raise InvalidArgument("pooling", f"must be one of {POOLINGS}, got {self.pooling!r}")
        if self.output_dtype not in OUTPUT_DTYPES:
            raise InvalidArgument("output_dtype", f"must be one of {OUTPUT_DTYPES}")
        if self.output_dtype != torch.float32 and self.pooling == "none":
            raise InvalidArgument(
                "output_dtype", "NONE returns rows bit-exact in the table's dtype: leave it unset"
            )


class LookupObserver(Protocol):
    """Optional hook for metrics, called from the engine's worker threads."""

    def kernels_done(self, pooling: Pooling, calls: Sequence[KernelCall]) -> None:
        """The kernel calls of one request, one per table it read, before it returns.

        NOTE(engine): once per request, not per call: a hook runs as Python on a worker thread
        while the event loop waits for the GIL, and 26 small per-table calls measured 3-4 us
        each in a loaded server (0.6 us alone) and +9 % server CPU per B=1 request.
        """

    def queue_waited(self, seconds: float) -> None:
        """A request admitted by :meth:`LookupEngine.submit` waited ``seconds`` for a worker
        thread (the queue-time half of a request's latency; the kernels are the other)."""


@dataclass(frozen=True)
class FeatureQuery:
    """One feature of a request.

    Parameters
    ----------
    name : feature name (mapped to a table by the store).
    ids : [nnz] int64 row ids.
    lengths : [B] int32 ids per sample, non-negative, summing to nnz.
    weights : optional [nnz] float32 per-id weights (SUM / MEAN only).
    """

    name: str
    ids: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None = None


@dataclass(frozen=True)
class PackedRequest:
    """A request's features as one array of each kind, features back to back in request order:
    what a transport decodes without per-feature numpy work (:meth:`LookupEngine.run` takes it
    like a list of :class:`FeatureQuery`).

    Parameters
    ----------
    names : feature names, in request order.
    ids : [nnz] int64, writable (shards shift them in place).
    lengths : [samples] int32.
    id_counts, sample_counts : [F] int64: each feature's ids and samples.
    """

    names: list[str]
    ids: np.ndarray
    lengths: np.ndarray
    id_counts: np.ndarray
    sample_counts: np.ndarray

    def check(self) -> None:
        """:class:`InvalidArgument` unless the counts split the arrays (a transport decodes
        them consistent; an in-process caller may not)."""
        features = len(self.names)
        for field, counts, array in (
            ("id_counts", self.id_counts, self.ids),
            ("sample_counts", self.sample_counts, self.lengths),
        ):
            if counts.shape != (features,):
                raise InvalidArgument(
                    field, f"must hold one count per feature ({features}), got {counts.shape}"
                )
            if features and (int(counts.min()) < 0 or int(counts.sum()) != array.size):
                raise InvalidArgument(
                    field, f"must be non-negative and sum to the {array.size} entries they split"
                )

    def queries(self) -> list[FeatureQuery]:
        """The same request feature by feature (:meth:`check` first)."""
        self.check()
        id_ends = np.cumsum(self.id_counts).tolist()
        sample_ends = np.cumsum(self.sample_counts).tolist()
        out, id_start, sample_start = [], 0, 0
        for name, id_end, sample_end in zip(self.names, id_ends, sample_ends, strict=True):
            out.append(
                FeatureQuery(name, self.ids[id_start:id_end], self.lengths[sample_start:sample_end])
            )
            id_start, sample_start = id_end, sample_end
        return out


Request = Sequence[FeatureQuery] | PackedRequest


@dataclass(frozen=True)
class FeatureResult:
    """One feature's output: [nnz, D] rows in the table dtype (NONE) or [B, D] fp32 (pooled)."""

    name: str
    values: torch.Tensor


@dataclass(frozen=True)
class LookupResult:
    """Results in request order, all served from table-set ``version``."""

    version: int
    features: list[FeatureResult]


@dataclass(frozen=True)
class TableDescription:
    """What DescribeTable reports for one table of one table-set version."""

    name: str
    num_rows: int
    dim: int
    dtype: torch.dtype
    quant: str | None
    raw_bytes: int
    stored_bytes: int
    chunk_bits: int
    version: int
    features: tuple[str, ...]
    row_start: int = 0
    row_end: int = 0
