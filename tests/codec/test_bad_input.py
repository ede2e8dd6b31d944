# SPDX-License-Identifier: Apache-2.0
"""Bad input gets a clear Python exception: never a crash, a clamp or a silent zero."""

from __future__ import annotations

import pytest
import torch

from ibpembed import compress
from ibpembed._ops import ops


@pytest.fixture(scope="module")
def table():
    return compress(torch.randn(100, 16))


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (torch.randn(10, 4).double(), TypeError, "unsupported table dtype"),
        (torch.randn(10, 4).long(), TypeError, "unsupported table dtype"),
        (torch.randn(10), ValueError, "2-D"),
        (torch.randn(2, 3, 4), ValueError, "2-D"),
        (torch.randn(8, 10)[:, ::2], ValueError, "contiguous"),
        (torch.randn(0, 4), ValueError, "non-empty"),
        (torch.randn(4, 0), ValueError, "non-empty"),
        ([[1.0, 2.0]], TypeError, "torch.Tensor"),
    ],
)
def test_compress_rejects_bad_tables(bad, error, match) -> None:
    with pytest.raises(error, match=match):
        compress(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "zstd"}, "method"),
        ({"chunk_bits": 8}, "chunk_bits"),
        ({"align": 12}, "power of two"),
        ({"align": 1 << 17}, "power of two <= 65536"),
        ({"sample_rows": 0}, "sample_rows"),
        ({"quant": "int4"}, "quant"),
    ],
)
def test_compress_rejects_bad_options(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        compress(torch.randn(50, 4), **kwargs)


def test_quant_needs_uint8_rows() -> None:
    with pytest.raises(ValueError, match="uint8"):
        compress(torch.randn(10, 8), quant="int8_rowwise")


@pytest.mark.parametrize("bad_id", [100, 10**12, -1, -(2**63)])
def test_out_of_range_ids_name_the_id_and_the_table_size(table, bad_id: int) -> None:
    ids = torch.tensor([0, 5, bad_id])
    with pytest.raises(IndexError, match=rf"index {bad_id} at position 2 .* 100 rows"):
        table.gather(ids)
    with pytest.raises(IndexError, match=rf"index {bad_id}"):
        table.lookup(ids, torch.tensor([0, 3]))


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([1, 3], r"offsets\[0\] must be 0"),
        ([0, 2], r"offsets\[-1\] must equal the number of indices \(3\)"),
        ([0, 4], r"offsets\[-1\]"),
        ([0, 2, 1, 3], "non-decreasing"),
        ([], "B \\+ 1"),
    ],
)
def test_bad_offsets(table, offsets, match) -> None:
    with pytest.raises(ValueError, match=match):
        table.lookup(torch.tensor([1, 2, 3]), torch.tensor(offsets, dtype=torch.int64))


def test_bad_lookup_arguments(table) -> None:
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="pooling"):
        table.lookup(ids, torch.tensor([0, 3]), pooling="max")
    with pytest.raises(TypeError, match="integer"):
        table.lookup(ids.float(), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="exactly one"):
        table.lookup(ids)
    with pytest.raises(ValueError, match="non-negative"):
        table.lookup(ids, lengths=torch.tensor([4, -1]))
    with pytest.raises(ValueError, match="one weight per index"):
        table.lookup(ids, torch.tensor([0, 3]), torch.ones(2))
    with pytest.raises(TypeError, match="float32"):
        table.lookup(ids, torch.tensor([0, 3]), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D"):
        table.gather(ids.view(3, 1))


def test_plain_int8_rows_cannot_be_pooled() -> None:
    c = compress(torch.randint(0, 255, (10, 8), dtype=torch.uint8))
    with pytest.raises(TypeError, match="int8_rowwise"):
        c.lookup(torch.tensor([1]), torch.tensor([0, 1]))


def test_ops_validate_raw_tensor_arguments(table) -> None:
    args = list(table._args())
    bad_payload = args.copy()
    bad_payload[0] = table.payload[:10]
    with pytest.raises(ValueError, match="payload holds 10 bytes"):
        ops.ibp_decompress(*bad_payload)
    bad_units = args.copy()
    bad_units[8] = 3
    with pytest.raises(ValueError, match="unit_bytes 3"):
        ops.ibp_decompress(*bad_units)
    bad_units[8] = (1 << 62) + 1  # once sent the unit search into an endless loop
    with pytest.raises(ValueError, match="not a valid slot unit"):
        ops.ibp_decompress(*bad_units)
    rows = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="minimum slot unit"):
        ops.ibp_slot_bytes(rows, 32, torch.zeros(4, dtype=torch.int64),
                           torch.zeros(4, dtype=torch.int64), (1 << 62) + 1)  # fmt: skip
    bad_mask = args.copy()
    bad_mask[4] = torch.full_like(table.mask, -1) if table.chunk_bits < 64 else table.mask[:1]
    with pytest.raises(ValueError, match="mask"):
        ops.ibp_decompress(*bad_mask)
    bad_bitval = args.copy()
    bad_bitval[5] = table.bitval | ~table.mask
    with pytest.raises(ValueError, match="bitval"):
        ops.ibp_decompress(*bad_bitval)
    with pytest.raises(ValueError, match="chunk_bits"):
        ops.ibp_fit(torch.zeros(4, 4, dtype=torch.uint8), 8, "ibpembed")
    with pytest.raises(ValueError, match=r"uint8|Byte"):
        ops.ibp_fit(torch.zeros(4, 4), 32, "ibpembed")
