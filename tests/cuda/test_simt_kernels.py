# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels' device code, executed on the CPU by a SIMT emulator, against the CPU ops.

csrc/cuda/gather_kernel.cuh and pooled_kernel.cuh (the code nvcc compiles) are built with g++
against tools/simt/simt.h, which runs every thread of a block as a host thread and supplies
the warp collectives, cp.async and shared memory (see its header for what it checks: converged
collectives, copies that land only when waited for, poisoned shared memory, in-bounds staging).
The cases mirror test_cuda_ops.py at sizes the emulator runs in seconds; test_cuda_ops.py stays
the check on a real GPU (timing, memory model, zero-copy over PCIe: nothing emulated shows them).
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ibpembed import CompressedTable, compress
from ibpembed.codec import CompressedTableSet
from ibpembed.layout import INT8_ROWWISE_CODE, POOLING_CODES
from tests.codec.tables import DTYPES, FLOAT_DTYPES, make_table, same_bits
from tests.cuda import request_ids
from tools.simt.harness import CXX, EmulatedKernels, EmulationError, Grid, build

pytestmark = pytest.mark.skipif(
    shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX}) to build the SIMT emulator"
)

# kernels.h ErrorBits
ERR_INDEX, ERR_OFFSETS, ERR_TABLE = 1, 2, 4
GRIDS = (Grid(1, 1), Grid(2, 2), Grid(3, 4, async_copies=False))


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> EmulatedKernels:
    return EmulatedKernels(build(tmp_path_factory.mktemp("simt")))


def _rows(c: CompressedTable, raw: torch.Tensor) -> torch.Tensor:
    return raw.view(c.dtype).view(raw.shape[0], c.dim)


def _cpu_rows(c: CompressedTable, ids: torch.Tensor) -> torch.Tensor:
    return c.gather(ids).contiguous().view(torch.uint8).view(ids.numel(), c.row_bytes)


# -- the emulator itself ------------------------------------------------------------------------


def test_emulator_catches_what_it_claims(kernels: EmulatedKernels) -> None:
    assert kernels.selftest(0) == (0, "")  # shuffles, ballot, reduction and scan give the sums
    for case in (1, 2):  # lanes in different collectives; lanes gone while others shuffle
        result, failure = kernels.selftest(case)
        assert result == -1 and "divergent" in failure, failure
    assert kernels.selftest(3) == (0xCD, "")  # read before the wait: shared memory's poison
    assert kernels.selftest(4) == (84, "")  # after it: the copied byte
    result, failure = kernels.selftest(5)
    assert result == -1 and "outside every device buffer" in failure
    result, failure = kernels.selftest(6)
    assert result == -1 and "deadlock" in failure


# -- gather and decompress ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_bits", [16, 32, 64])
@pytest.mark.parametrize("kind", ["random_bits", "edge_values", "trained_like"])
def test_gather_is_bit_exact(kernels, dtype, chunk_bits, kind) -> None:
    dim = {16: 33, 32: 3, 64: 129}[chunk_bits]  # tails of every width, D = 1..129 across dtypes
    table = make_table(dtype, 120, dim, kind, seed=dim + chunk_bits)
    c = compress(table, chunk_bits=chunk_bits, align=8)
    ids = request_ids(np.random.default_rng(chunk_bits), c.num_rows, 60, hot_copies=40)
    rows, error = kernels.gather(c, ids, GRIDS[chunk_bits % 3])
    assert error == 0
    assert torch.equal(rows, _cpu_rows(c, ids))


@pytest.mark.parametrize("code_bits", [1, 2, 3, 4])
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_every_code_width_and_grid(kernels, code_bits, grid) -> None:
    table = make_table(torch.bfloat16, 200, 65, "trained_like", seed=code_bits)
    c = compress(table, chunk_bits=32, code_bits=code_bits, align=1)
    assert c.code_bits == code_bits
    rows, error = kernels.gather(c, None, grid)  # decompress: ids = 0 .. N - 1, no perm
    assert error == 0
    assert same_bits(_rows(c, rows), table)


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_unsorted_gather_is_bit_exact(kernels, grid) -> None:
    # The op's path for small gathers: ids as the request has them, no perm. Adjacent repeats
    # still form runs (decoded once); repeats apart are decoded again.
    table = make_table(torch.float32, 150, 40, "trained_like", seed=11)
    c = compress(table, chunk_bits=32, align=8)
    ids = request_ids(np.random.default_rng(5), c.num_rows, 80, hot_copies=40)
    ids = torch.cat([ids, torch.full((37,), 17), torch.tensor([3, 3, 149, 0, 0])])
    rows, error = kernels.gather(c, ids, grid, sort=False)
    assert error == 0
    assert torch.equal(rows, _cpu_rows(c, ids))


@pytest.mark.parametrize("method", ["raw", "paper"])
def test_raw_rows(kernels, method) -> None:
    table = make_table(torch.float32, 100, 36, "trained_like", seed=3)
    c = compress(table, method=method)
    ids = torch.arange(99, -1, -1)
    rows, error = kernels.gather(c, ids, Grid(2, 3))
    assert error == 0
    assert same_bits(_rows(c, rows), table.flip(0))


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 70),
    dim=st.integers(1, 80),
    chunk_bits=st.sampled_from([16, 32, 64]),
    code_bits=st.sampled_from([None, 1, 4]),
    align=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_property(kernels, dtype, rows, dim, chunk_bits, code_bits, align, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (rows, dim * torch.empty(0, dtype=dtype).element_size()),
                         dtype=torch.uint8, generator=g)  # fmt: skip
    # Half the rows share every element's high byte: the fit finds invariant bits, those rows
    # compress and the others stay raw, so both kinds of row meet in one gather.
    bits.view(rows, dim, -1)[: rows // 2, :, -1] = 0x3F
    table = bits.view(dtype).view(rows, dim)
    c = compress(table, chunk_bits=chunk_bits, code_bits=code_bits, align=align)
    ids = torch.randint(0, rows, (min(3 * rows, 90),), generator=g)
    out, error = kernels.gather(c, ids, Grid(2, 2))
    assert error == 0
    assert torch.equal(out, _cpu_rows(c, ids))


# -- pooled lookups -----------------------------------------------------------------------------


def _bags(rng: np.random.Generator, num_rows: int, bags: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = rng.integers(0, 9, bags)
    lengths[::5] = 0  # empty bags
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    return torch.from_numpy(rng.integers(0, num_rows, int(lengths.sum()))), offsets


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dim", [1, 16, 129])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_equals_cpu_bit_for_bit(kernels, dtype, dim, pooling, weighted) -> None:
    # The kernel rounds every multiply and add in the CPU's order: equal bit for bit.
    table = make_table(dtype, 150, dim, "trained_like", seed=dim)
    chunk_bits = {1: 16, 16: 32, 129: 64}[dim]
    c = compress(table, chunk_bits=chunk_bits)
    rng = np.random.default_rng(dim + weighted)
    ids, offsets = _bags(rng, c.num_rows, 24)
    weights = torch.from_numpy(rng.random(ids.numel()).astype(np.float32)) if weighted else None
    got, error = kernels.pooled(
        c, ids, offsets, weights, c.dtype_code, POOLING_CODES[pooling], Grid(2, 2)
    )
    assert error == 0
    want = c.lookup(ids, offsets, weights, pooling)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_pooled_int8_rowwise_and_edge_values(kernels) -> None:
    rows = make_table(torch.uint8, 64, 68, "random_bits", seed=5)
    rows[:, :4] = torch.tensor([0x00, 0x3C, 0x00, 0x00], dtype=torch.uint8)  # scale 1, bias 0
    c = compress(rows, quant="int8_rowwise")
    ids, offsets = torch.arange(64).flip(0), torch.tensor([0, 1, 30, 64])
    got, error = kernels.pooled(c, ids, offsets, None, INT8_ROWWISE_CODE, POOLING_CODES["mean"])
    assert error == 0
    torch.testing.assert_close(got, c.lookup(ids, offsets, pooling="mean"), rtol=0, atol=0)

    edge = compress(make_table(torch.float32, 64, 33, "edge_values", seed=1))
    ids, offsets = torch.arange(64), torch.tensor([0, 32, 64])
    got, error = kernels.pooled(edge, ids, offsets, None, 0, POOLING_CODES["sum"], Grid(1, 2))
    assert error == 0
    torch.testing.assert_close(got, edge.lookup(ids, offsets), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_long_bags_are_staged_ahead_and_stay_bit_exact(kernels, grid) -> None:
    # Bags longer than the staging ring (4 rows in flight): the ring refills within a bag and
    # across bags, and the sums keep the CPU's order.
    table = make_table(torch.float32, 200, 48, "trained_like", seed=21)
    c = compress(table, chunk_bits=32, align=8)
    rng = np.random.default_rng(21)
    lengths = np.array([1, 37, 0, 5, 64, 2, 0, 11])
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    ids = torch.from_numpy(rng.integers(0, c.num_rows, int(lengths.sum())))
    weights = torch.from_numpy(rng.random(ids.numel()).astype(np.float32))
    for pooling in ("sum", "mean"):
        got, error = kernels.pooled(c, ids, offsets, weights, 0, POOLING_CODES[pooling], grid)
        assert error == 0
        want = c.lookup(ids, offsets, weights, pooling)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_a_repeated_id_is_decoded_once_and_pooled_bit_exact(kernels, grid) -> None:
    # Runs of one id (a hot id), within a bag and across bag boundaries, a repeat right after a
    # raw row and after an out-of-ring distance: reusing the decoded row changes no bit.
    table = make_table(torch.bfloat16, 120, 40, "trained_like", seed=8)
    table[7] = torch.randn(40).to(torch.bfloat16) * 1e30  # very likely stored raw
    c = compress(table, chunk_bits=16, align=4)
    ids = torch.tensor([5, 5, 5, 5, 5, 5, 9, 7, 7, 5, 5, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 0, 0])
    offsets = torch.tensor([0, 2, 9, 10, 10, 16, 23])
    weights = torch.linspace(0.1, 2.0, ids.numel())
    for w in (None, weights):
        got, error = kernels.pooled(c, ids, offsets, w, c.dtype_code, POOLING_CODES["sum"], grid)
        assert error == 0
        want = c.lookup(ids, offsets, w, "sum")
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _table_set_case(seed: int) -> tuple[list, list, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three tables of one chunk width (fp32, bf16, fbgemm row-wise int8) and five parts over one
    batch: a table read by two parts, a part of no bags, empty bags, repeats across parts."""
    fp32 = compress(make_table(torch.float32, 90, 24, "trained_like", seed=seed), chunk_bits=16)
    bf16 = compress(make_table(torch.bfloat16, 70, 33, "trained_like", seed=seed + 1),
                    chunk_bits=16)  # fmt: skip
    rows = make_table(torch.uint8, 60, 36, "random_bits", seed=seed + 2)
    rows[:, :4] = torch.tensor([0x00, 0x3C, 0x00, 0x00], dtype=torch.uint8)  # scale 1, bias 0
    int8 = compress(rows, quant="int8_rowwise", chunk_bits=16)
    tables = [(fp32, fp32.dtype_code), (bf16, bf16.dtype_code), (int8, INT8_ROWWISE_CODE)]
    rng = np.random.default_rng(seed)
    # (table, first bag, bags): bags 0-5 fp32, 6-9 bf16, 10-10 none, 10-13 int8, 13-16 fp32 again
    parts = [(0, 0, 6), (1, 6, 4), (2, 10, 0), (2, 10, 3), (0, 13, 3)]
    lengths = rng.integers(0, 9, 16)
    lengths[[2, 7, 14]] = 0
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    ids = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    for t, first, count in parts:
        begin, end = int(offsets[first]), int(offsets[first + count])
        ids[begin:end] = torch.from_numpy(rng.integers(0, tables[t][0].num_rows, end - begin))
    weights = torch.from_numpy(rng.random(ids.numel()).astype(np.float32))
    return tables, parts, ids, offsets, weights


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_one_launch_pools_every_table_as_the_cpu_table_set(kernels, grid, pooling) -> None:
    tables, parts, ids, offsets, weights = _table_set_case(seed=3)
    table_set = CompressedTableSet([c for c, _ in tables])
    table_bags = torch.tensor(parts, dtype=torch.int64)
    for w in (None, weights):
        got, error = kernels.pooled_tables(
            tables, parts, ids, offsets, w, POOLING_CODES[pooling], grid
        )
        assert error == 0
        want, _ = table_set.lookup(table_bags, ids, offsets, w, pooling)
        for g, expected in zip(got, want, strict=True):
            torch.testing.assert_close(g, expected, rtol=0, atol=0, equal_nan=True)


def test_one_launch_reports_an_id_out_of_its_tables_range(kernels) -> None:
    tables, parts, ids, offsets, _ = _table_set_case(seed=4)
    begin = int(offsets[parts[1][1]])  # the bf16 part's first id: past its 70 rows,
    ids[begin] = 80  # though within the fp32 table's 90
    _, error = kernels.pooled_tables(tables, parts, ids, offsets, None, POOLING_CODES["sum"])
    assert error == ERR_INDEX


# -- bad input: reported in the error word, nothing read out of bounds --------------------------


def test_bad_ids_and_offsets_set_error_bits(kernels) -> None:
    c = compress(make_table(torch.float32, 50, 16, "trained_like", seed=0))
    rows, error = kernels.gather(c, torch.tensor([0, 5, 50, -1]))
    assert error == ERR_INDEX
    assert torch.equal(rows[:2], _cpu_rows(c, torch.tensor([0, 5])))  # valid ids still served
    _, error = kernels.pooled(c, torch.tensor([1, 99]), torch.tensor([0, 1, 2]), None, 0, 0)
    assert error == ERR_INDEX
    _, error = kernels.pooled(c, torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3]), None, 0, 0)
    assert error & ERR_OFFSETS


def test_corrupt_index_is_reported_not_read(kernels) -> None:
    c = compress(make_table(torch.float32, 64, 32, "trained_like", seed=4), chunk_bits=32)
    # Block 1's slots moved past the payload's end: the warps must refuse to stage them (the
    # emulator fails the launch on any cp.async outside the payload).
    bad = c.block_base.clone()
    bad[1] = c.payload.numel() + 4096
    broken = dataclasses.replace(c, block_base=bad)
    rows, error = kernels.gather(broken, torch.arange(64))
    assert error & ERR_TABLE
    assert torch.equal(rows[:32], _cpu_rows(c, torch.arange(32)))  # block 0 is intact
    # A mask bit outside the chunk width: found by the table check of block 0's first warp.
    mask = c.mask.clone()
    mask[0] |= 1 << 40
    bad_mask = dataclasses.replace(c, mask=mask)
    _, error = kernels.pooled(bad_mask, torch.tensor([3]), torch.tensor([0, 1]), None, 0, 0)
    assert error & ERR_TABLE


def test_an_index_near_2_63_is_reported_not_read(kernels) -> None:
    c = compress(make_table(torch.float32, 64, 50, "trained_like", seed=4), method="raw", align=1)
    # A block base whose window end wraps past 2^63 back into the payload's range.
    bad = c.block_base.clone()
    bad[1] = (1 << 63) - 1 - 50
    rows, error = kernels.gather(dataclasses.replace(c, block_base=bad), torch.arange(64))
    assert error & ERR_TABLE
    assert torch.equal(rows[:32], _cpu_rows(c, torch.arange(32)))
    # An index end whose pad wraps: the table check reports it (the slots are all in range).
    bad = c.block_base.clone()
    bad[-1] = (1 << 63) - 1 - 5
    _, error = kernels.gather(dataclasses.replace(c, block_base=bad), torch.arange(64))
    assert error & ERR_TABLE


def test_unsupported_grid_is_refused(kernels) -> None:
    # A launch the emulator cannot run (no whole warp) is an error, never a half-run result.
    c = compress(make_table(torch.float32, 8, 4, "trained_like", seed=0))
    with pytest.raises(EmulationError, match="multiple of 32"):
        kernels.gather(c, torch.arange(4), Grid(1, 0))


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_copy_without_decode_moves_each_slot_verbatim(kernels, grid) -> None:
    # IBPEMBED_CUDA_DECODE=copy, gpu_check's "ideal transfer" baseline: the same slots cross the
    # bus as in the gather, a compressed one lands undecoded at the front of its output row and a
    # raw row lands whole.
    table = make_table(torch.float32, 200, 40, "trained_like", seed=13)
    table[::9] = torch.from_numpy(np.random.default_rng(1).standard_normal((23, 40)) * 1e30).float()
    c = compress(table, chunk_bits=32, align=8)
    ids = request_ids(np.random.default_rng(2), c.num_rows, 150)
    rows, error = kernels.gather(c, ids, grid, decode=False)
    assert error == 0
    units = c.row_units.to(torch.int64) * c.unit_bytes
    compressed = 0
    for i, r in enumerate(ids.tolist()):
        first = r - r % 32
        offset = int(c.block_base[r // 32]) + int(units[first:r].sum())
        size = min(int(units[r]), c.row_bytes)
        slot = c.payload[offset : offset + size]
        if int(c.bitmask[r // 32]) >> (r % 32) & 1:
            compressed += 1
            assert torch.equal(rows[i, :size], slot), f"row {r}"
        else:
            assert torch.equal(rows[i], table[r].view(torch.uint8)), f"raw row {r}"
    assert 0 < compressed < ids.numel()  # both kinds of row were moved


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize(("dtype", "dim"), [(torch.float32, 128), (torch.bfloat16, 72)])
def test_a_line_aware_layout_reads_bit_exact(kernels, grid, dtype, dim) -> None:
    # gpu_layout.line_aware: slots moved to 32-byte boundaries, the slot before each move
    # padded with zeros. The kernels read it as the CPU ops do, gather and pooled.
    from ibpembed.tables.gpu_layout import line_aware

    compact = compress(make_table(dtype, 300, dim, "trained_like", seed=dim), align=8)
    c = line_aware(compact)
    assert int(c.block_base[-1]) > int(compact.block_base[-1])  # some slots were moved
    ids = request_ids(np.random.default_rng(dim), c.num_rows, 200)
    rows, error = kernels.gather(c, ids, grid)
    assert error == 0
    assert torch.equal(rows, _cpu_rows(c, ids))
    rng = np.random.default_rng(dim + 1)
    bag_ids, offsets = _bags(rng, c.num_rows, 20)
    got, error = kernels.pooled(c, bag_ids, offsets, None, c.dtype_code, POOLING_CODES["sum"], grid)
    assert error == 0
    want = c.lookup(bag_ids, offsets, None, "sum")
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_blocks_are_sized_to_the_work(kernels) -> None:
    # H200: 132 SMs; a plan of 8-warp blocks, 3 resident per SM.
    sms, resident = 132, 3 * 132
    assert kernels.launch_shape(8, resident, sms, 64) == (1, 64)  # a 1k-id call, 64 bags
    assert kernels.launch_shape(8, resident, sms, 300) == (2, 150)
    assert kernels.launch_shape(8, resident, sms, 1024) == (4, 256)
    assert kernels.launch_shape(8, resident, sms, 8 * sms) == (8, sms)  # enough work: full blocks
    assert kernels.launch_shape(8, resident, sms, 1 << 20) == (8, resident)  # grid stride
    assert kernels.launch_shape(1, 10, sms, 5) == (1, 5)
    assert kernels.launch_shape(8, resident, sms, 0) == (1, 1)


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_two_tables_pooling_the_same_bags_resolve_their_own_rows(kernels, grid) -> None:
    # The lanes resolve a bag's rows per part: the same ids positions read through another
    # table must be resolved again, against that table's index.
    a = compress(make_table(torch.float32, 80, 24, "trained_like", seed=31), chunk_bits=16)
    b = compress(make_table(torch.bfloat16, 90, 40, "trained_like", seed=32), chunk_bits=16)
    tables = [(a, a.dtype_code), (b, b.dtype_code)]
    lengths = np.array([40, 3, 0, 33])
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 80, int(lengths.sum())))
    parts = [(0, 0, 4), (1, 0, 4), (0, 1, 2)]
    got, error = kernels.pooled_tables(
        tables, parts, ids, offsets, None, POOLING_CODES["sum"], grid
    )
    assert error == 0
    want, _ = CompressedTableSet([a, b]).lookup(
        torch.tensor(parts, dtype=torch.int64), ids, offsets, None, "sum"
    )
    for g, expected in zip(got, want, strict=True):
        torch.testing.assert_close(g, expected, rtol=0, atol=0, equal_nan=True)
