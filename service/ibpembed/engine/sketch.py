# SPDX-License-Identifier: Apache-2.0
"""A count-min frequency sketch with periodic halving (TinyLFU's frequency estimate).

Each id increments one counter in each of ``DEPTH`` rows, chosen by multiply-shift hashes; its
estimated frequency is the smallest of its counters (never below its true count, above it by
collisions only, up to ``CAP``). After ``sample`` increments every counter is halved, so the
estimate follows the recent traffic and old favourites age out. Counts are vectorised over a
batch of ids.

NOTE(tier): counters are bytes that saturate at CAP, as TinyLFU's are 4-bit: the hot tier ranks
the rows at its edge, which its window sees a few times each, while a row seen CAP times per
window is in any tier (at most sample / CAP such rows). Four-byte counters cost 64 bytes per tier
row, as much as a 64-byte tier row itself; bytes cost 16.
"""

from __future__ import annotations

import numpy as np

DEPTH = 4
MIN_WIDTH = 1 << 10
MAX_WIDTH = 1 << 22
CAP = 255


class FrequencySketch:
    """Estimated frequencies of int64 ids.

    Parameters
    ----------
    width : counters per row, rounded up to a power of two in [MIN_WIDTH, MAX_WIDTH]
        (DEPTH x width bytes of memory). A few times the ids the caller ranks keeps the
        over-estimates small.
    sample : increments between halvings (TinyLFU's window: ten times the ids ranked or more).
    seed : picks the hash functions.
    """

    def __init__(self, width: int, sample: int, *, seed: int = 0) -> None:
        if sample < 1:
            raise ValueError(f"sample must be >= 1, got {sample}")
        self.width = self.width_for(width)
        self._shift = np.uint64(64 - (self.width.bit_length() - 1))
        # Odd 64-bit multipliers: multiply-shift hashing (the high bits of id * a).
        rng = np.random.default_rng(seed)
        self._mult = rng.integers(1, 2**63, DEPTH, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.counts = np.zeros((DEPTH, self.width), dtype=np.uint8)
        self.sample = sample
        self.added = 0  # increments since the last halving

    @staticmethod
    def width_for(width: int) -> int:
        """Counters per row of a sketch asked for ``width``."""
        return min(MAX_WIDTH, max(MIN_WIDTH, 1 << max(width - 1, 0).bit_length()))

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        """[DEPTH, n] counter of each id in each row."""
        keys = ids.astype(np.uint64, copy=False)
        return ((keys[None, :] * self._mult[:, None]) >> self._shift).astype(np.intp)

    def add(self, ids: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Count distinct ``ids`` ``counts`` times each (once without ``counts``)."""
        if ids.size == 0:
            return
        weights = np.ones(ids.size, np.int64) if counts is None else counts.astype(np.int64)
        rows = np.arange(DEPTH, dtype=np.intp)[:, None] * self.width
        flat = (self._slots(ids) + rows).ravel()
        # Distinct ids may share a counter: sum their increments before saturating it.
        touched, at = np.unique(flat, return_inverse=True)
        sums = np.bincount(at, weights=np.tile(weights, DEPTH), minlength=touched.size)
        counters = self.counts.reshape(-1)
        counters[touched] = np.minimum(counters[touched] + sums, CAP)
        self.added += int(weights.sum())
        if self.added >= self.sample:
            self.counts >>= 1
            self.added //= 2

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """uint8 estimated frequency of each id (>= its count since the halvings, or CAP)."""
        if ids.size == 0:
            return np.zeros(0, np.uint8)
        slots = self._slots(ids)
        return self.counts[np.arange(DEPTH)[:, None], slots].min(axis=0)
