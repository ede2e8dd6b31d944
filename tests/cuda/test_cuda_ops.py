# SPDX-License-Identifier: Apache-2.0
"""CUDA ops against the CPU ops on the same compressed tables: bit-exact rows and pooled sums.

These run only where torch sees a GPU and ibpembed._C was built with its CUDA kernels; elsewhere
they skip with the reason. The table layout of the CUDA argument contract (lookup_ops_cuda.cpp):
payload in pinned host memory (or on the GPU), the small index tensors on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ibpembed import CompressedTable, compress
from ibpembed._ops import ops
from ibpembed.layout import INT8_ROWWISE_CODE, POOLING_CODES
from tests.codec.tables import DTYPES, FLOAT_DTYPES, make_table, same_bits
from tests.cuda import cuda_kernels_missing, request_ids
from tools.device_args import device_args

_REASON = cuda_kernels_missing()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
GPU = torch.device("cuda")


def _as_rows(c: CompressedTable, raw: torch.Tensor) -> torch.Tensor:
    return raw.view(c.dtype).view(raw.shape[0], c.dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1, 3, 16, 33, 129])
@pytest.mark.parametrize("kind", ["random_bits", "edge_values", "trained_like", "near_invariant"])
@pytest.mark.parametrize("chunk_bits", [16, 32, 64])
def test_gather_and_decompress_are_bit_exact(dtype, dim, kind, chunk_bits) -> None:
    table = make_table(dtype, 300, dim, kind, seed=dim * 7 + chunk_bits)
    rng = np.random.default_rng(dim)
    for align in (1, 8, 32):
        c = compress(table, chunk_bits=chunk_bits, align=align)
        args = device_args(c, GPU, "pinned")
        ids = request_ids(rng, c.num_rows, 500)
        got = ops.ibp_gather(*args, ids.cuda())
        want = ops.ibp_gather(*c.op_args(), ids)
        assert got.is_cuda
        assert same_bits(_as_rows(c, got.cpu()), _as_rows(c, want))
        assert same_bits(_as_rows(c, ops.ibp_decompress(*args).cpu()), table)


@pytest.mark.parametrize("method", ["raw", "paper"])
@pytest.mark.parametrize("payload", ["pinned", "device"])
def test_raw_rows_and_device_payload(method, payload) -> None:
    table = make_table(torch.float32, 1000, 128, "trained_like", seed=3)
    c = compress(table, method=method)
    got = ops.ibp_gather(*device_args(c, GPU, payload), torch.arange(999, -1, -1).cuda())
    assert same_bits(_as_rows(c, got.cpu()), table.flip(0))


def _pooled_both(c, ids, offsets, weights, dtype_code, pooling):
    args = device_args(c, GPU, "pinned")
    got = ops.lookup_pooled(
        *args,
        ids.cuda(),
        offsets.cuda(),
        None if weights is None else weights.cuda(),
        dtype_code,
        POOLING_CODES[pooling],
    )
    want = ops.lookup_pooled(
        *c.op_args(), ids, offsets, weights, dtype_code, POOLING_CODES[pooling]
    )
    return got.cpu(), want


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dim", [1, 16, 129])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk_bits", [16, 32, 64])
def test_pooled_equals_cpu(dtype, dim, pooling, weighted, chunk_bits) -> None:
    # Same fp32 roundings in the same order as the CPU: equal bit for bit (NaN payloads aside).
    table = make_table(dtype, 400, dim, "trained_like", seed=dim)
    c = compress(table, chunk_bits=chunk_bits)
    rng = np.random.default_rng(dim + chunk_bits)
    lengths = rng.integers(0, 40, 64)
    lengths[::7] = 0  # empty bags
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    ids = torch.from_numpy(rng.integers(0, c.num_rows, int(lengths.sum())))
    weights = torch.from_numpy(rng.random(ids.numel()).astype(np.float32)) if weighted else None
    got, want = _pooled_both(c, ids, offsets, weights, c.dtype_code, pooling)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("code_bits", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk_bits", [16, 32, 64])
@pytest.mark.parametrize("dim", [3, 33, 129])
def test_every_code_width_is_bit_exact(code_bits, chunk_bits, dim) -> None:
    # Each lane reads its own C-bit code and looks up its codebook: gather, decompress and
    # pooled SUM against the CPU for every C, tails included (odd dims with 64-bit chunks).
    table = make_table(torch.bfloat16, 300, dim, "trained_like", seed=dim + code_bits)
    c = compress(table, chunk_bits=chunk_bits, code_bits=code_bits)
    assert c.code_bits == code_bits
    args = device_args(c, GPU, "pinned")
    rng = np.random.default_rng(dim * 5 + code_bits)
    ids = request_ids(rng, c.num_rows, 400)
    got = ops.ibp_gather(*args, ids.cuda())
    assert same_bits(_as_rows(c, got.cpu()), _as_rows(c, ops.ibp_gather(*c.op_args(), ids)))
    assert same_bits(_as_rows(c, ops.ibp_decompress(*args).cpu()), table)
    offsets = torch.tensor([0, 100, 100, ids.numel()])
    got, want = _pooled_both(c, ids, offsets, None, c.dtype_code, "sum")
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_pooled_int8_rowwise_and_edge_values() -> None:
    rows = make_table(torch.uint8, 256, 68, "random_bits", seed=5)
    rows[:, :4] = torch.tensor([0x00, 0x3C, 0x00, 0x00], dtype=torch.uint8)  # scale 1, bias 0
    c = compress(rows, quant="int8_rowwise")
    ids = torch.arange(256).flip(0)
    offsets = torch.tensor([0, 1, 100, 256])
    got, want = _pooled_both(c, ids, offsets, None, INT8_ROWWISE_CODE, "mean")
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    edge = compress(make_table(torch.float32, 128, 33, "edge_values", seed=1))
    got, want = _pooled_both(edge, torch.arange(128), torch.tensor([0, 64, 128]), None, 0, "sum")
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_hot_row_overlay_is_accepted_and_changes_nothing() -> None:
    """The CPU lookups' decoded tier travels in the same op call; the kernels decode anyway."""
    table = make_table(torch.float32, 300, 33, "trained_like", seed=2)
    c = compress(table).with_hot_rows(torch.arange(0, 300, 3))
    assert c.hot is not None
    ids = torch.arange(300).flip(0)
    args = device_args(c, GPU, "pinned")
    hot = (c.hot.directory, c.hot.rows)
    rows = ops.ibp_gather(*args, ids.cuda(), *hot).cpu()
    assert same_bits(_as_rows(c, rows), table[ids])
    offsets = torch.tensor([0, 10, 300]).cuda()
    pooled = ops.lookup_pooled(*args, ids.cuda(), offsets, None, 0, 0, *hot).cpu()
    assert same_bits(pooled, c.lookup(ids, offsets.cpu()))


def test_bad_input_raises_like_cpu() -> None:
    c = compress(torch.randn(100, 16))
    args = device_args(c, GPU, "pinned")
    with pytest.raises(IndexError, match=r"index 100 at position 2 .* 100 rows"):
        ops.ibp_gather(*args, torch.tensor([0, 5, 100]).cuda())
    with pytest.raises(IndexError, match=r"index -1"):
        ops.lookup_pooled(*args, torch.tensor([-1]).cuda(), torch.tensor([0, 1]).cuda(), None, 0, 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        ops.lookup_pooled(
            *args, torch.tensor([1, 2, 3]).cuda(), torch.tensor([0, 2, 1, 3]).cuda(), None, 0, 0
        )
    with pytest.raises(ValueError, match="pinned"):
        ops.ibp_gather(*device_args(c, GPU, "host"), torch.tensor([0]).cuda())
    short = args._replace(bitval=args.bitval[:-1])  # no code width C gives V * (2^C - 1) - 1
    with pytest.raises(ValueError, match=r"bitval must have V \* \(2\^C - 1\) entries"):
        ops.ibp_gather(*short, torch.tensor([0]).cuda())
