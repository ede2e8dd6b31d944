# SPDX-License-Identifier: Apache-2.0
"""The C++ codec against the independent numpy reference: same masks, same bytes, same rows."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from ibpembed import reference as ref
from ibpembed._ops import ops
from ibpembed.codec import slot_unit_bytes
from tests.codec.tables import DTYPES, make_table

KINDS = ("random_bits", "edge_values", "trained_like", "near_invariant")


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 40),
    dim=st.sampled_from((1, 3, 8, 33)),
    kind=st.sampled_from(KINDS),
    chunk_bits=st.sampled_from((16, 32, 64)),
    method=st.sampled_from(("ibpembed", "paper")),
    align=st.sampled_from((1, 8, 16)),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpp_codec_matches_reference_byte_for_byte(
    dtype, rows, dim, kind, chunk_bits, method, align, seed
) -> None:
    table = make_table(dtype, rows, dim, kind, seed)
    u8 = table.view(torch.uint8).reshape(rows, -1)
    npy = u8.numpy()

    mask, bitval = ops.ibp_fit(u8, chunk_bits, method)
    ref_fit = ref.fit_greedy if method == "ibpembed" else ref.fit_paper
    ref_mask, ref_bitval = ref_fit(npy, chunk_bits)
    np.testing.assert_array_equal(mask.numpy().view(np.uint64), ref_mask)
    np.testing.assert_array_equal(bitval.numpy().view(np.uint64), ref_bitval)

    unit = slot_unit_bytes(u8.shape[1], align)
    assert unit == ref.slot_unit_bytes(u8.shape[1], align)
    payload, block_base, row_units, bitmask = ops.ibp_compress(u8, chunk_bits, mask, bitval, unit)
    expected = ref.compress(npy, chunk_bits, ref_mask, ref_bitval, align)
    np.testing.assert_array_equal(payload.numpy(), expected.payload)
    np.testing.assert_array_equal(block_base.numpy(), expected.block_base)
    np.testing.assert_array_equal(row_units.numpy(), expected.row_units)
    np.testing.assert_array_equal(bitmask.numpy().view(np.uint32), expected.bitmask)

    np.testing.assert_array_equal(ref.decompress(expected), npy)
    slots = ops.ibp_slot_bytes(u8, chunk_bits, mask, bitval, unit)
    np.testing.assert_array_equal(slots.numpy(), expected.row_units[:rows].astype(np.int64) * unit)


def test_reference_bit_helpers_are_inverse() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        mask = int(rng.integers(0, 2**63)) | int(rng.integers(0, 2))
        x = int(rng.integers(0, 2**63))
        assert ref.deposit(ref.extract(x, mask), mask) == x & mask
