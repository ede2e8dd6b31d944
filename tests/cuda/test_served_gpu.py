# SPDX-License-Identifier: Apache-2.0
"""The served GPU path end to end: a store placed for CUDA, an engine on CUDA, against the CPU
engine on the same table files, across a row update; and in-place registration of payloads.

GPU only (they skip with the reason elsewhere); the placement logic itself is tested without a
GPU in tests/tables/test_placement.py.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from ibpembed.engine import FeatureQuery, LookupEngine
from ibpembed.tables.store import TableStore
from tests.cuda import cuda_kernels_missing
from tests.tables.test_store import pack

_REASON = cuda_kernels_missing()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture
def table_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "set"
    pack(directory, 1)
    return directory


def request(rng: np.random.Generator, batch: int = 16) -> list[FeatureQuery]:
    lengths = rng.integers(0, 6, batch).astype(np.int32)
    user = rng.integers(0, 200, int(lengths.sum()))
    item_lengths = np.ones(batch, dtype=np.int32)
    return [
        FeatureQuery("user_hist", user, lengths),
        FeatureQuery("item_id", rng.integers(0, 100, batch), item_lengths),
    ]


def same_results(a, b) -> bool:
    return all(
        x.values.dtype == y.values.dtype
        and torch.equal(x.values.view(torch.uint8), y.values.view(torch.uint8))
        for x, y in zip(a.features, b.features, strict=True)
    )


@pytest.mark.parametrize("pooling", ["none", "sum", "mean"])
def test_cuda_engine_serves_what_the_cpu_engine_serves(table_dir: Path, pooling: str) -> None:
    gpu_store = TableStore.load(table_dir, device="cuda")
    cpu_store = TableStore.load(table_dir)
    gpu, cpu = LookupEngine(gpu_store, device="cuda"), LookupEngine(cpu_store, device="cpu")
    rng = np.random.default_rng(0)
    try:
        with gpu_store.acquire() as snap:
            kernel = snap.kernel_table("user")
            assert kernel.block_base.is_cuda and kernel.mask.is_cuda and kernel.bitmask.is_cuda
            assert kernel.payload.is_cuda  # the device alias of the mapped file, not a copy
            assert not snap.tables["user"].payload.is_cuda
        for _ in range(3):
            features = request(rng)
            assert same_results(gpu.run(features, pooling), cpu.run(features, pooling))
        for store in (gpu_store, cpu_store):
            store.update_rows("user", torch.tensor([3, 77]), torch.full((2, 8), -1.5))
        with gpu_store.acquire() as snap:
            assert snap.kernel_table("user") is not kernel  # fresh copies with the update
        features = request(rng, batch=64)
        assert same_results(gpu.run(features, pooling), cpu.run(features, pooling))
        # A second update appends to the same spill buffer: its registration must outlive the
        # first update's version once that is gone.
        for store in (gpu_store, cpu_store):
            store.update_rows("user", torch.tensor([5]), torch.full((1, 8), 2.5))
        del kernel
        gc.collect()
        features = request(rng, batch=64)
        assert same_results(gpu.run(features, pooling), cpu.run(features, pooling))
    finally:
        gpu.close()
        cpu.close()


def test_a_payload_past_its_registered_range_is_refused() -> None:
    from ibpembed import compress
    from ibpembed._ops import ops

    table = compress(torch.randn(300, 16))
    n = table.payload.numel()
    buffer = torch.zeros(n + (1 << 16), dtype=torch.uint8)
    buffer[:n] = table.payload
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(buffer.data_ptr(), n, 0)) == 0
    try:
        small = [t.cuda() for t in (table.block_base, table.row_units, table.bitmask)]
        masks = [table.mask.cuda(), table.bitval.cuda()]
        args = (table.chunk_bits, table.row_bytes, table.unit_bytes, table.num_rows)
        # Starts inside the registered range, ends past it: a first-byte check would pass it
        # and the kernels' reads past the range would fault.
        with pytest.raises(ValueError, match="pageable host memory"):
            ops.ibp_decompress(buffer, *small, *masks, *args)
        got = ops.ibp_decompress(buffer[:n], *small, *masks, *args)
        assert torch.equal(got.cpu(), ops.ibp_decompress(*table.op_args()))
    finally:
        cudart.cudaHostUnregister(buffer.data_ptr())


def test_host_mapped_alias_registers_in_place_once_and_reads_back() -> None:
    from ibpembed import _C

    buffer = torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8)
    alias = _C.host_mapped_alias(buffer, True, torch.cuda.current_device())
    assert alias.is_cuda and alias.numel() == buffer.numel()
    assert torch.equal(alias.cpu(), buffer)  # zero-copy reads of the host bytes
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        _C.host_mapped_alias(buffer, True, torch.cuda.current_device())  # already registered
    del alias
    again = _C.host_mapped_alias(buffer, False, torch.cuda.current_device())  # released: again
    assert torch.equal(again[-16:].cpu(), buffer[-16:])


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_a_gpu_table_set_pools_every_table_as_the_cpu_set(pooling: str) -> None:
    from ibpembed import compress
    from ibpembed.codec import CompressedTableSet
    from ibpembed.tables.placement import HostAliases, cuda_register, place_table

    rng = np.random.default_rng(1)
    tables = [
        compress(torch.randn(300, 24), chunk_bits=32),
        compress(torch.randn(200, 33).to(torch.bfloat16), chunk_bits=16),
        compress(torch.randn(100, 8), chunk_bits=32),
    ]
    dev = torch.device("cuda")
    aliases = HostAliases(cuda_register(dev))
    gpu_set = CompressedTableSet([place_table(t, dev, aliases) for t in tables])
    cpu_set = CompressedTableSet(tables)
    parts = torch.tensor([(0, 0, 10), (1, 10, 6), (2, 16, 0), (0, 16, 4)])
    lengths = rng.integers(0, 12, 20)
    lengths[10] = 5  # the bf16 part's first bag has ids
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    ids = torch.from_numpy(rng.integers(0, 100, int(lengths.sum())))  # in every table's range
    want, _ = cpu_set.lookup(parts, ids, offsets, None, pooling)
    got, seconds = gpu_set.lookup(parts, ids.to(dev), offsets.to(dev), None, pooling)
    assert len(seconds) == 4
    for g, w in zip(got, want, strict=True):
        assert g.is_cuda and torch.equal(g.cpu(), w)
    bad = ids.clone()
    bad[int(offsets[10])] = 250  # the bf16 part's first id, past its 200 rows
    with pytest.raises(IndexError, match=r"table_bags\[1\]"):
        gpu_set.lookup(parts, bad.to(dev), offsets.to(dev), None, pooling)


def test_deferred_errors_raise_at_the_check_and_then_clear() -> None:
    from ibpembed import _C, compress
    from ibpembed._ops import ops

    table = compress(torch.randn(100, 16))
    dev = torch.device("cuda")
    small = [t.to(dev) for t in (table.block_base, table.row_units, table.bitmask)]
    args = (
        table.payload.pin_memory(),
        *small,
        table.mask.to(dev),
        table.bitval.to(dev),
        table.chunk_bits,
        table.row_bytes,
        table.unit_bytes,
        table.num_rows,
    )
    _C.set_defer_cuda_errors(True)
    try:
        with pytest.raises(IndexError, match="index 100 at position 1"):
            ops.ibp_gather(*args, torch.tensor([0, 100], device=dev))
            _C.check_cuda_errors()
        rows = ops.ibp_gather(*args, torch.tensor([3, 4], device=dev))
        _C.check_cuda_errors()  # cleared: nothing left to raise
        assert torch.equal(rows.cpu(), ops.ibp_gather(*table.op_args(), torch.tensor([3, 4])))
    finally:
        _C.set_defer_cuda_errors(False)
    with pytest.raises(IndexError):  # synchronous again: raised by the call itself
        ops.ibp_gather(*args, torch.tensor([-1], device=dev))
