# SPDX-License-Identifier: Apache-2.0
"""A latency histogram of bounded size: log-spaced buckets, percentiles within half a bucket.

A load generator that keeps every latency grows without bound over a long run (and writes them
all into its report); this one holds about 2,100 counters whatever the run's length, like
HdrHistogram, and still reads p99.9 to within 0.5 % of the exact value.
"""

from __future__ import annotations

import math

import numpy as np

# 1 µs to 1000 s in buckets 1 % wide: 2,084 counters (plus one below and one above the range).
LOW_S = 1e-6
HIGH_S = 1e3
PRECISION = 0.01


class LatencyHistogram:
    """Counts of latencies (seconds) per log-spaced bucket, with exact count, sum, min, max.

    Bucket ``i`` (1-based) holds ``[LOW_S * r**(i-1), LOW_S * r**i)``, ``r = 1 + PRECISION``;
    bucket 0 holds anything below ``LOW_S``, the last anything from ``HIGH_S`` on. A percentile
    is the geometric middle of the bucket holding its rank (nearest rank), clamped to the
    observed min and max: within ``PRECISION / 2`` of the exact value inside the range.
    """

    def __init__(self) -> None:
        self._log_ratio = math.log1p(PRECISION)
        self.buckets = math.ceil(math.log(HIGH_S / LOW_S) / self._log_ratio)
        self.counts = np.zeros(self.buckets + 2, dtype=np.int64)
        self.count = 0
        self.sum_s = 0.0
        self.min_s = math.inf
        self.max_s = 0.0

    def add(self, seconds: float) -> None:
        if seconds < LOW_S:
            index = 0
        else:
            index = min(self.buckets + 1, 1 + int(math.log(seconds / LOW_S) / self._log_ratio))
        self.counts[index] += 1
        self.count += 1
        self.sum_s += seconds
        self.min_s = min(self.min_s, seconds)
        self.max_s = max(self.max_s, seconds)

    def lower_edge(self, index: int) -> float:
        """Seconds where bucket ``index`` starts (0 for the one below the range)."""
        return 0.0 if index == 0 else LOW_S * math.exp((index - 1) * self._log_ratio)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) in seconds; NaN when empty."""
        if not self.count:
            return math.nan
        rank = max(1, math.ceil(q / 100.0 * self.count))
        index = int(np.searchsorted(np.cumsum(self.counts), rank))
        if index == 0 or index > self.buckets:  # outside the range: only min/max are known
            return self.min_s if index == 0 else self.max_s
        middle = LOW_S * math.exp((index - 0.5) * self._log_ratio)
        return min(self.max_s, max(self.min_s, middle))

    def summary_ms(self) -> dict[str, float]:
        """p50, p90, p99, p99.9, mean and max in milliseconds (empty when nothing was added)."""
        if not self.count:
            return {}
        named = {"p50": 50, "p90": 90, "p99": 99, "p99.9": 99.9}
        summary = {name: 1000.0 * self.percentile(q) for name, q in named.items()}
        return summary | {"mean": 1000.0 * self.sum_s / self.count, "max": 1000.0 * self.max_s}

    def to_json(self) -> dict:
        """The non-empty buckets, as ``[lower edge ms, count]`` pairs, and the exact totals."""
        nonzero = np.flatnonzero(self.counts)
        return {
            "precision": PRECISION,
            "buckets_ms": [
                [1000.0 * self.lower_edge(int(i)), int(self.counts[i])] for i in nonzero
            ],
            "count": self.count,
            "sum_ms": 1000.0 * self.sum_s,
            "min_ms": 1000.0 * self.min_s if self.count else None,
            "max_ms": 1000.0 * self.max_s,
        }
