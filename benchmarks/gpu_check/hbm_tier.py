# SPDX-License-Identifier: Apache-2.0
"""Phase ``hbm_tier``: the HBM tier (ibpembed.engine.hbm_tier) under Zipf traffic. One 512-byte
fp32 table of TABLE_GIB registered in place; for Zipf 0.8, 1.05 and 1.2 ids, tiers of 0, 1, 5
and 20 % of raw bytes holding the hottest rows (the exact top of the Zipf ranks: the policy's
ideal), decoded and compressed; every case checked bit for bit against the CPU ops, then timed
(wall clock and CUDA events) against the raw zero-copy gather of the same rows and the pinned
H2D copy of the batch's bytes:

  ibp_tier    ibp_gather_hbm: tier rows from HBM, the rest zero-copy, one launch
  ibp_none    the same gather without a tier (the 0 % budget)
  raw_none    the zero-copy gather of the same rows stored raw
  h2d_batch   one pinned H2D copy of the batch's n x R bytes

On a CPU (--dry-run) the tiers are built at toy size and the tiered gather runs in the SIMT
emulator (tools/simt) against the CPU op; nothing is timed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from benchmarks.gpu_check.common import GIB, Checks, log, same_bits
from benchmarks.gpu_check.device import Pinned
from benchmarks.gpu_check.tables import BigTable, build_big, id_stream, zipf_rows
from benchmarks.gpu_check.timing import timed

if TYPE_CHECKING:  # the package imports ibpembed only once a phase runs (it may build it first)
    from ibpembed.codec import CompressedTable
    from ibpembed.engine.hbm_tier import TierArrays

ROW_BYTES = 512
TABLE_GIB = 2.0  # raw bytes of the table (the timing phases use --table-gib)
ZIPF = (0.8, 1.05, 1.2)
BUDGETS = (0.0, 0.01, 0.05, 0.20)  # share of raw bytes
FORMS = ("decoded", "compressed")
BATCH = 16384
DRY_BATCH = 256


def compressed_table(big: BigTable, *, placed: bool = False) -> CompressedTable:
    """The big table as a CompressedTable: its host arguments (what a tier is built from), or
    with ``placed`` its GPU ones (the payload's alias, small tensors on the GPU) that the kernels
    read."""
    from ibpembed.codec import CompressedTable

    args = big.comp if placed else big.comp_cpu
    return CompressedTable(
        payload=args.payload,
        block_base=args.block_base,
        row_units=args.row_units,
        bitmask=args.bitmask,
        mask=args.mask,
        bitval=args.bitval,
        chunk_bits=args.chunk_bits,
        num_rows=args.num_rows,
        dim=args.row_bytes // 4,
        dtype=torch.float32,
        unit_bytes=args.unit_bytes,
    )


def tier_rows(table: CompressedTable, form: str, share: float) -> np.ndarray:
    """The hottest rows a tier of ``share`` x raw bytes holds (Zipf ranks 0, 1, ...)."""
    from ibpembed.engine.hbm_tier import tier_capacity

    capacity = tier_capacity(table, form, int(share * table.raw_bytes))
    return zipf_rows(np.arange(capacity, dtype=np.int64), table.num_rows)


def phase_hbm_tier(args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    import ibpembed
    from ibpembed.engine.hbm_tier import DeviceTier, TierCounters, build_tier, gather

    total = int((TABLE_GIB if gpu else 0.002) * GIB)
    pinned = Pinned(gpu, args.pin)
    t0 = time.perf_counter()
    big = build_big(ibpembed, pinned, ROW_BYTES, total, args.profile, gpu)
    table = compressed_table(big)
    log(f"hbm_tier: {big.num_rows} rows of {ROW_BYTES} B built in {time.perf_counter() - t0:.1f} s")
    checks = Checks()
    emulated = None if gpu else _Emulated()
    dev = torch.device("cuda" if gpu else "cpu")
    n = BATCH if gpu else DRY_BATCH
    rng = np.random.default_rng(35)
    stage = torch.empty(n, ROW_BYTES, dtype=torch.uint8, pin_memory=gpu)
    dest = torch.empty(n, ROW_BYTES, dtype=torch.uint8, device=dev)
    placed = compressed_table(big, placed=True) if gpu else table
    results = []
    for alpha in ZIPF:
        ids = id_stream(rng, big.num_rows, n, f"zipf{alpha}")
        want = big.plain[ids]
        gids = ids.to(dev)
        base: dict[str, Any] = {}
        if gpu:
            base = {
                "ibp_none": timed(lambda g=gids: ops().ibp_gather(*big.comp, g), gpu),
                "raw_none": timed(lambda g=gids: ops().ibp_gather(*big.raw, g), gpu),
                "h2d_batch": timed(lambda: dest.copy_(stage, non_blocking=True), gpu),
            }
        for share in BUDGETS[1:]:
            for form in FORMS:
                rows = tier_rows(table, form, share)
                built = time.perf_counter()
                arrays = build_tier(table, torch.from_numpy(rows), form)
                build_s = time.perf_counter() - built
                counters = TierCounters(dev)
                tier = DeviceTier(table, arrays.to(dev), counters)
                name = f"zipf{alpha} {share:.0%} {form}"
                if gpu:
                    got = gather(placed, gids, tier).view(torch.uint8).cpu()
                    checks.record(same_bits(got.view(n, -1), want), f"hbm tier {name}")
                    counters.device_counts.zero_()
                    t = timed(lambda g=gids, tier=tier: gather(placed, g, tier), gpu)
                    hits, misses = (int(v) for v in counters.device_counts.tolist())
                else:
                    assert emulated is not None
                    got, hits, misses = emulated.gather(table, ids, arrays)
                    checks.record(same_bits(got, want), f"hbm tier {name} (emulated)")
                    t = None
                row = {
                    "row_bytes": ROW_BYTES,
                    "batch": n,
                    "ids": f"zipf{alpha}",
                    "budget": share,
                    "form": form,
                    "tier_rows": arrays.num_slots,
                    "tier_bytes": arrays.nbytes,
                    "build_s": round(build_s, 3),
                    "hit_share": hits / max(hits + misses, 1),
                    "raw_bytes": n * ROW_BYTES,
                    "seconds": {},
                    "event_seconds": {},
                }
                for key, timing in ({"ibp_tier": t} | base).items():
                    if timing is not None:
                        row["seconds"][key] = timing.wall_s
                        if timing.event_s is not None:
                            row["event_seconds"][key] = timing.event_s
                results.append(row)
                log(f"  {name}: {arrays.num_slots} rows, {row['hit_share']:.1%} of reads hit")
    pinned.release()
    return {
        "row_bytes": ROW_BYTES,
        "table_rows": big.num_rows,
        "checks": {"passed": checks.passed, "failures": checks.failures or []},
        "hbm_tier": results,
    }


def ops() -> Any:
    return torch.ops.ibpembed


class _Emulated:
    """The tiered gather in the SIMT emulator (the dry run's stand-in for the GPU)."""

    def __init__(self) -> None:
        from tools.simt.harness import EmulatedKernels, build

        self._dir = tempfile.TemporaryDirectory(prefix="gpu_check_simt.")
        self.kernels = EmulatedKernels(build(Path(self._dir.name)))

    def gather(
        self, table: CompressedTable, ids: torch.Tensor, arrays: TierArrays
    ) -> tuple[torch.Tensor, int, int]:
        from tools.simt.harness import Tier

        counts = torch.zeros(2, dtype=torch.int64)
        tier = Tier.of(arrays, counts)
        rows, error = self.kernels.gather(table, ids, tier=tier)
        if error:
            raise RuntimeError(f"emulated tiered gather reported error bits {error}")
        return rows, int(counts[0]), int(counts[1])
