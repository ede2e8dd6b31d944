# SPDX-License-Identifier: Apache-2.0
"""Hypothesis strategies for codec tests: tables of every dtype built to hit edge cases; and the
process settings a test may switch for a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from hypothesis import strategies as st

from ibpembed import _C

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Awkward widths on purpose: 1 element, odd, one past a chunk, wide.
DIMS = (1, 2, 3, 5, 8, 16, 33, 64, 129)
KINDS = ("random_bits", "edge_values", "trained_like", "identical_rows", "near_invariant")

# Bit patterns that codecs get wrong: signed zeros, infinities, quiet/signalling NaNs with
# payloads, the smallest subnormals, the largest finite values.
_EDGE_BITS = {
    4: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFBFFFFF, 0x7F800001,
        0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x3F800000],
    2: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFDFF, 0x0001, 0x83FF, 0x7BFF, 0x7F80, 0xFF81],
    1: [0x00, 0x80, 0xFF, 0x7F, 0x01],
}  # fmt: skip


def make_table(dtype: torch.dtype, rows: int, dim: int, kind: str, seed: int) -> torch.Tensor:
    """A contiguous [rows, dim] table whose bits follow `kind`."""
    rng = np.random.default_rng(seed)
    size = dtype.itemsize
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
    if kind == "random_bits":
        bits = rng.integers(0, 2 ** (8 * size), (rows, dim), dtype=np.uint64).astype(uint)
    elif kind == "edge_values":
        edge = np.array(_EDGE_BITS[size], dtype=uint)
        bits = edge[rng.integers(0, len(edge), (rows, dim))]
    elif kind == "trained_like":
        values = rng.normal(0.0, 0.05, (rows, dim)).astype(np.float32)
        values[rng.random(rows) < 0.05] = 0.0  # zero rows
        values[rng.integers(0, rows), rng.integers(0, dim)] = 1e4  # one outlier
        if dtype in FLOAT_DTYPES:
            bits = torch.from_numpy(values).to(dtype).view(_view_int(size)).numpy().astype(uint)
        else:
            bits = np.clip(values * 1000 + 128, 0, 255).astype(uint)
    elif kind == "identical_rows":
        bits = np.repeat(rng.integers(0, 2 ** (8 * size), (1, dim)).astype(uint), rows, axis=0)
    else:  # near_invariant: every row the same but for single flipped bits
        bits = np.repeat(rng.integers(0, 2 ** (8 * size), (1, dim)).astype(uint), rows, axis=0)
        flips = rng.integers(0, 8 * size, (rows, dim)).astype(uint)
        bits ^= np.where(rng.random((rows, dim)) < 0.1, uint(1) << flips, uint(0)).astype(uint)
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8).reshape(rows, dim * size))
    return raw.view(dtype).reshape(rows, dim).contiguous()


def _view_int(size: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included), shapes and dtypes too."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@st.composite
def tables(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = DTYPES) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    rows = draw(st.one_of(st.integers(1, 4), st.integers(5, 100)))
    dim = draw(st.sampled_from(DIMS))
    kind = draw(st.sampled_from(KINDS))
    return make_table(dtype, rows, dim, kind, draw(st.integers(0, 2**32 - 1)))


# Pooled-lookup cases: float dtypes, awkward widths, both poolings, with and without weights.
POOLED_CASES = {
    "dtype": st.sampled_from(FLOAT_DTYPES),
    "dim": st.sampled_from((1, 3, 16, 129)),
    "pooling": st.sampled_from(("sum", "mean")),
    "weighted": st.booleans(),
    "seed": st.integers(0, 2**32 - 1),
}


@contextmanager
def stage_min_bytes_kept() -> Iterator[None]:
    """The process's stage_min_bytes (codec.h) as it was before the block, after it."""
    before = _C.stage_min_bytes()
    try:
        yield
    finally:
        _C.set_stage_min_bytes(before)


@contextmanager
def staged_reads(on: bool = True) -> Iterator[None]:
    """Within the block, every table reads its rows the way tables larger than the last-level
    cache do (codec.h's stage_min_bytes: staged, not prefetched; ``on=False``: no table does)."""
    with stage_min_bytes_kept():
        _C.set_stage_min_bytes(0 if on else 2**62)
        yield
