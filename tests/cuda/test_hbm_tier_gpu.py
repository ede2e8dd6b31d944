# SPDX-License-Identifier: Apache-2.0
"""The HBM tier on a GPU: the tiered CUDA ops against the CPU ops (both forms), the device
counters, a served engine with --hbm-tier across a row update, and the request's one pinned
upload. They skip with the reason where torch sees no GPU or ibpembed._C has no CUDA kernels
(the same kernels run in the SIMT emulator in test_simt_hbm_tier.py everywhere)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ibpembed import compress
from ibpembed.codec import CompressedTableSet
from ibpembed.engine import FeatureQuery, LookupEngine
from ibpembed.engine.cuda import CudaStreams
from ibpembed.engine.hbm_tier import (
    FORMS,
    DeviceTier,
    TierCounters,
    TieredTableSet,
    build_tier,
    gather,
)
from ibpembed.tables.placement import place_table
from ibpembed.tables.store import TableStore
from tests.codec.tables import make_table, same_bits
from tests.cuda import cuda_kernels_missing, request_ids

_REASON = cuda_kernels_missing()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _tier(table, rows: torch.Tensor, form: str) -> DeviceTier:
    device = torch.device("cuda")
    return DeviceTier(table, build_tier(table, rows, form).to(device), TierCounters(device))


@pytest.mark.parametrize("form", FORMS)
def test_tiered_gather_and_pooled_equal_the_cpu_ops(form) -> None:
    c = compress(make_table(torch.float32, 5000, 64, "trained_like", seed=3), align=1)
    placed = place_table(c, torch.device("cuda"))
    tier = _tier(placed, torch.arange(0, 5000, 3), form)
    ids = request_ids(np.random.default_rng(0), c.num_rows, 6000)  # sorted on the GPU (>= 4096)
    got = gather(placed, ids.cuda(), tier).cpu()
    assert same_bits(got, c.gather(ids))
    hits, misses = tier.counters.device_counts.tolist()
    assert hits > 0 and misses > 0
    offsets = torch.arange(0, ids.numel() + 1, 16)
    offsets[-1] = ids.numel()
    tiered = TieredTableSet(CompressedTableSet([placed]), [tier])
    bags = torch.tensor([[0, 0, offsets.numel() - 1]])
    values, _ = tiered.lookup(bags, ids.cuda(), offsets.cuda(), None, "mean")
    torch.testing.assert_close(
        values[0].cpu(), c.lookup(ids, offsets, pooling="mean"), rtol=0, atol=0
    )


def test_a_tier_set_is_refused_for_a_table_set_it_was_not_built_for() -> None:
    """A residency map is sized for its own table: the op refuses a TierSet built against
    another TableSet of the same size instead of reading past the map."""
    small = place_table(compress(make_table(torch.float32, 100, 16, "trained_like", seed=1)),
                        torch.device("cuda"))  # fmt: skip
    large = place_table(compress(make_table(torch.float32, 5000, 16, "trained_like", seed=2)),
                        torch.device("cuda"))  # fmt: skip
    tiered = TieredTableSet(
        CompressedTableSet([small]), [_tier(small, torch.arange(50), "decoded")]
    )
    other = CompressedTableSet([large])
    ids = torch.tensor([4999], device="cuda")
    offsets = torch.tensor([0, 1], device="cuda")
    with pytest.raises(ValueError, match="another TableSet"):
        torch.ops.ibpembed.lookup_pooled_tables_hbm(
            other._handle, tiered._handle, ids, offsets, torch.tensor([[0, 0, 1]]), None, 0
        )


def test_a_tier_set_is_read_whole_once_uploaded_and_takes_no_tier_after() -> None:
    """A publication's tiers reach the GPU in one upload: a set is not read before it, takes
    no add after it, and the op checks each tier's tensors as it is added."""
    table = place_table(compress(make_table(torch.float32, 300, 16, "trained_like", seed=4)),
                        torch.device("cuda"))  # fmt: skip
    table_set = CompressedTableSet([table, table])
    tier = _tier(table, torch.arange(0, 300, 2), "decoded")
    a = tier.arrays
    handle = torch.classes.ibpembed.TierSet()
    with pytest.raises(ValueError, match="two int64 words per 64 rows"):
        handle.add(table_set._handle, a.directory[:-2], None, a.payload, a.num_slots,
                   tier.counters.device_counts)  # fmt: skip
    with pytest.raises(ValueError, match="decoded tier of"):
        handle.add(table_set._handle, a.directory, None, a.payload[:64], a.num_slots,
                   tier.counters.device_counts)  # fmt: skip
    handle.add(table_set._handle, a.directory, None, a.payload, a.num_slots,
               tier.counters.device_counts)  # fmt: skip
    handle.add(table_set._handle, None, None, None, 0, None)
    ids = torch.tensor([0, 1, 2, 3], device="cuda")
    offsets = torch.tensor([0, 2, 4], device="cuda")
    bags = torch.tensor([[0, 0, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="after upload"):
        torch.ops.ibpembed.lookup_pooled_tables_hbm(
            table_set._handle, handle, ids, offsets, bags, None, 0
        )
    handle.upload()
    with pytest.raises(ValueError, match="no tiers once uploaded"):
        handle.add(table_set._handle, None, None, None, 0, None)
    values, _ = torch.ops.ibpembed.lookup_pooled_tables_hbm(
        table_set._handle, handle, ids, offsets, bags, None, 0
    )
    want, _ = table_set.lookup(bags, ids, offsets)  # the same set read without tiers
    for got, expected in zip(values, want, strict=True):
        assert torch.equal(got, expected)
    assert tier.counters.device_counts.tolist() == [1, 1]  # rows 0 and 1: a hit and a miss


@pytest.mark.parametrize("pooling", ["none", "sum"])
def test_a_served_engine_reads_its_hbm_tier_and_never_a_stale_row(pooling) -> None:
    values = make_table(torch.float32, 2000, 32, "trained_like", seed=5)
    gpu_store = TableStore.from_tables({"t": compress(values)}, device="cuda")
    cpu_store = TableStore.from_tables({"t": compress(values)})
    gpu = LookupEngine(gpu_store, device="cuda", hbm_tier="20%")
    cpu = LookupEngine(cpu_store, device="cpu")
    ids = (np.random.default_rng(1).zipf(1.2, 4096) - 1) % 2000
    request = [FeatureQuery("t", ids, np.full(256, 16, dtype=np.int32))]

    def same() -> bool:
        a, b = gpu.run(request, pooling), cpu.run(request, pooling)
        return all(
            torch.equal(x.values.view(torch.uint8), y.values.view(torch.uint8))
            for x, y in zip(a.features, b.features, strict=True)
        )

    try:
        assert gpu.hbm is not None
        assert same()
        gpu.hbm.refresh()  # the policy has seen the request: a tier is published
        with gpu_store.acquire() as snap:
            tier = gpu.hbm.tiers.get("t", snap.tables["t"])
        assert tier is not None and tier.arrays.num_slots > 0
        assert same()
        tier.counters.poll()  # queues the copy the next poll returns
        torch.cuda.synchronize()
        hits, misses = tier.counters.poll()
        assert hits > 0 and misses > 0
        for store in (gpu_store, cpu_store):  # a hot row updated: the next batch has its bits
            store.update_rows("t", torch.tensor([int(ids[0])]), torch.full((1, 32), 7.0))
        assert same()
        gpu.hbm.step()  # the new version's tier, at once
        with gpu_store.acquire() as snap:
            assert gpu.hbm.tiers.get("t", snap.tables["t"]) is not None
        assert same()
    finally:
        gpu.close()
        cpu.close()


def test_one_pinned_upload_carries_ids_offsets_and_weights() -> None:
    streams = CudaStreams(torch.device("cuda"))
    ids = np.arange(5, dtype=np.int64)
    offsets = np.array([0, 2, 5], dtype=np.int64)
    weights = np.linspace(0, 1, 5, dtype=np.float32)
    with streams.request():
        up = streams.upload([ids, offsets, None, weights])
        torch.cuda.current_stream().synchronize()
    assert up[2] is None
    for got, want in zip([up[0], up[1], up[3]], [ids, offsets, weights], strict=True):
        assert got.is_cuda and np.array_equal(got.cpu().numpy(), want)
