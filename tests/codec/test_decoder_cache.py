# SPDX-License-Identifier: Apache-2.0
"""Row decoders are cached per thread and table metadata (DecoderCache, docs/codec.md): a cached
decoder must never decode another table's rows, even one whose metadata sits at the same
addresses, and a thread reading more tables than the cache holds still decodes every one."""

from __future__ import annotations

import pytest
import torch

from ibpembed import _C, compress, cpu_path
from ibpembed._ops import ops
from ibpembed.codec import CompressedTable, available_cpu_paths, pattern_lookup

# Each decoder: the avx512 path's codebook decoder with each pattern lookup (each instantiation
# has its own per-thread cache); the lookup does not matter to the other paths.
PATHS = [
    pytest.param(
        (p, lookup),
        id=f"{p}-{lookup}" if p == "avx512" else p,
        marks=pytest.mark.skipif(p not in available_cpu_paths(), reason=f"no {p}"),
    )
    for p, lookup in (
        ("ref", "gather"),
        ("bmi2", "gather"),
        ("avx512", "gather"),
        ("avx512", "tables"),
    )
]


@pytest.fixture
def path(request):
    before, lookup_before = cpu_path(), pattern_lookup()
    name, lookup = request.param
    _C.set_cpu_path(name)
    _C.set_pattern_lookup(lookup)
    yield name
    _C.set_cpu_path(before)
    _C.set_pattern_lookup(lookup_before)


def _gather(table: CompressedTable, ids: torch.Tensor, mask, bitval) -> torch.Tensor:
    return ops.ibp_gather(*table.op_args()._replace(mask=mask, bitval=bitval), ids)


def _pooled(table: CompressedTable, ids: torch.Tensor, mask, bitval) -> torch.Tensor:
    offsets = torch.tensor([0, ids.numel() // 2, ids.numel()])
    args = table.op_args()._replace(mask=mask, bitval=bitval)
    return ops.lookup_pooled(*args, ids, offsets, None, table.dtype_code, 0, None, None)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize(("chunk_bits", "code_bits"), [(16, 1), (32, 1), (64, 1), (16, 3), (32, 3)])
def test_a_decoder_follows_the_metadata_bytes_not_their_address(path, chunk_bits, code_bits):
    """Two tables of one layout share one mask buffer and one codebook buffer in turn, as a
    reload that frees a table and allocates the next at the same addresses would: each call
    must decode with the metadata the buffers hold then."""
    gen = torch.Generator().manual_seed(chunk_bits * 10 + code_bits)
    first = torch.randn(600, 24, generator=gen) * 0.05
    second = torch.randn(600, 24, generator=gen) * 3.0 + 1.0
    a = compress(first, chunk_bits=chunk_bits, code_bits=code_bits)
    b = compress(second, chunk_bits=chunk_bits, code_bits=code_bits)
    assert not (torch.equal(a.mask, b.mask) and torch.equal(a.bitval, b.bitval))
    assert a.compressed_rows > 0 and b.compressed_rows > 0
    mask, bitval = a.mask.clone(), a.bitval.clone()
    ids = torch.randint(0, 600, (300,), generator=gen)
    for table, rows in ((a, first), (b, second), (a, first)):
        mask.copy_(table.mask)  # same addresses, other bytes
        bitval.copy_(table.bitval)
        got = _gather(table, ids, mask, bitval).view(torch.float32)
        assert torch.equal(got.view(torch.int32), rows[ids].view(torch.int32))
        want = table.lookup(ids, torch.tensor([0, 150, 300]))
        assert torch.equal(_pooled(table, ids, mask, bitval), want)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_more_tables_than_a_thread_caches(path):
    """70 tables (the cache holds 64), read round robin twice: every decoder leaves the cache
    and is built again, and every row comes back."""
    gen = torch.Generator().manual_seed(7)
    sources = [torch.randn(64, 8, generator=gen) * (0.01 * (1 + i)) for i in range(70)]
    tables = [compress(s, chunk_bits=32, code_bits=1 + i % 3) for i, s in enumerate(sources)]
    ids = torch.randint(0, 64, (40,), generator=gen)
    for _ in range(2):
        for table, rows in zip(tables, sources, strict=True):
            assert torch.equal(table.gather(ids).view(torch.int32), rows[ids].view(torch.int32))


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_wide_tables_leave_the_cache_by_their_metadata_bytes(path):
    """Rows of 4,096 fp32 chunks with C = 4 codebooks carry 0.5 MiB of metadata each: a thread
    keeps fewer of them than of narrow tables (a 4 MiB budget); 12 read round robin twice all
    decode."""
    gen = torch.Generator().manual_seed(11)
    sources = [torch.randn(16, 4096, generator=gen) * (0.02 * (1 + i)) for i in range(12)]
    tables = [compress(s, chunk_bits=32, code_bits=4) for s in sources]
    ids = torch.tensor([3, 0, 15, 3, 7])
    for _ in range(2):
        for table, rows in zip(tables, sources, strict=True):
            assert torch.equal(table.gather(ids).view(torch.int32), rows[ids].view(torch.int32))
