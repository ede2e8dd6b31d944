# SPDX-License-Identifier: Apache-2.0
"""Fit, compress and lookups give the same bytes whatever the number of threads.

The ops split their work with at::parallel_for: fits by chunk position, compression and gathers
by row, pooled lookups by bag. Each part must be computed as on one thread, or a table packed on
a 64-core host would differ from the same table packed on a laptop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from ibpembed import compress
from ibpembed._ops import ops
from tests.codec.tables import FLOAT_DTYPES, make_table, same_bits

T = TypeVar("T")
THREADS = 4  # more than this host's cores on purpose: the split, not the speed, is under test


def _on_threads(threads: int, fn: Callable[[], T]) -> T:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@given(
    dtype=st.sampled_from((*FLOAT_DTYPES, torch.uint8)),
    rows=st.integers(1, 3000),
    dim=st.sampled_from((1, 3, 33, 129, 384)),
    kind=st.sampled_from(("random_bits", "edge_values", "trained_like", "near_invariant")),
    chunk_bits=st.sampled_from((16, 32, 64)),
    seed=st.integers(0, 2**32 - 1),
)
def test_fits_do_not_depend_on_threads(dtype, rows, dim, kind, chunk_bits, seed) -> None:
    table = make_table(dtype, rows, dim, kind, seed)
    u8 = table.view(torch.uint8).view(rows, -1)

    def fits() -> list[torch.Tensor]:
        out = [*ops.ibp_fit(u8, chunk_bits, "ibpembed"), *ops.ibp_fit(u8, chunk_bits, "paper")]
        if chunk_bits < 64:
            out += ops.ibp_fit_codebooks(u8, chunk_bits, [2, 3, 4])
        return out

    one, many = _on_threads(1, fits), _on_threads(THREADS, fits)
    assert len(one) == len(many)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    dim=st.sampled_from((3, 64, 129)),
    pooling=st.sampled_from(("sum", "mean")),
    weighted=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_compress_and_lookups_do_not_depend_on_threads(dtype, dim, pooling, weighted, seed) -> None:
    rng = np.random.default_rng(seed)
    table = make_table(dtype, 5000, dim, "trained_like", seed)
    ids = torch.from_numpy(rng.integers(0, 5000, 4000))
    cuts = np.sort(rng.integers(0, ids.numel() + 1, 399))  # 400 bags, some empty
    offsets = torch.from_numpy(np.concatenate([[0], cuts, [ids.numel()]]))
    weights = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(seed))

    def run() -> tuple[torch.Tensor, ...]:
        c = compress(table, sample_rows=2000, seed=seed)
        pooled = c.lookup(ids, offsets, weights if weighted else None, pooling)
        return c.payload, c.bitmask, c.gather(ids), pooled

    one, many = _on_threads(1, run), _on_threads(THREADS, run)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])
    assert same_bits(one[2], many[2]) and same_bits(one[2], table[ids])
    assert same_bits(one[3], many[3])  # each bag is summed by one thread, in id order
