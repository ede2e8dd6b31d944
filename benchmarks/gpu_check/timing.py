# SPDX-License-Identifier: Apache-2.0
"""Phase ``timing``, one child per row size (and one for the real table): >= --table-gib GiB of
tables registered in place, batches of 1k..64k ids, uniform and Zipf ids, every method timed by
the wall clock (synchronised) and by CUDA events (the GPU's own span of the call):

  ibp_none          compressed zero-copy gather (torch.ops.ibpembed.ibp_gather, default sort rule)
  ibp_none_sync     the same with IBPEMBED_CUDA_STAGING=sync: does cp.async staging pay?
  ibp_none_sorted / ibp_none_nosort  ids always / never sorted: the sort rule's A/B
  ibp_line          ibp_none over the same rows in gpu_layout.line_aware's layout (pack --for-gpu)
  ibp_copy          the same kernel with IBPEMBED_CUDA_DECODE=copy: the same slots over PCIe,
                    copied undecoded (the "ideal transfer": ibp_none against it is the decode)
  ibp_sum           compressed pooled lookup, SUM over bags of 16 ids (lookup_pooled)
  ibp_sum_deferred  the same with errors deferred, as the engine runs it (no sync per call)
  raw_none / raw_sum  the same kernels on the same rows stored raw (bitmask all clear)
  uva               plain UVA gather: warp per row, 16-byte loads, no staging (benchmarks/cuda)
  torch_uva         torch.index_select of the registered rows' device alias (a UVA gather by torch)
  h2d_batch         one pinned H2D copy of the batch's n x R bytes (no gather)
  cpu_h2d           CPU index_select into a pinned buffer + one H2D copy (ids already on the host)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_check.common import (
    BAG_SIZE,
    BATCHES,
    DECODE_ENV,
    GIB,
    SECTOR_BYTES,
    Checks,
    deferred_errors,
    env,
    has_baseline,
    log,
    sort_min_ids,
    staging,
    sync,
)
from benchmarks.gpu_check.device import Pinned
from benchmarks.gpu_check.tables import BigTable, build_big, check_big, id_stream


@dataclass
class Timing:
    wall_s: float  # median wall time of a synchronised call
    event_s: float | None  # median CUDA-event time of the same calls (None on the CPU)


def timed(fn: Callable[[], object], gpu: bool, budget_s: float = 0.25) -> Timing:
    """fn() after warm-up, 3..20 runs within ~budget_s: the median wall time (each call
    synchronised) and, on a GPU, the median time between CUDA events recorded on the current
    stream around it (the GPU's span of the call, without the host's wait for it)."""
    for _ in range(2):
        fn()
    sync(gpu)
    walls: list[float] = []
    events: list[float] = []
    begin = time.perf_counter()
    while len(walls) < 3 or (len(walls) < 20 and time.perf_counter() - begin < budget_s):
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        if gpu:
            end.record()
        sync(gpu)
        walls.append(time.perf_counter() - t0)
        if gpu:
            events.append(start.elapsed_time(end) / 1e3)
    return Timing(statistics.median(walls), statistics.median(events) if events else None)


def slot_sectors(big: BigTable, ids: torch.Tensor, layout: tuple | None = None) -> int:
    """32-byte sectors the compressed slots of rows ``ids`` touch (format.h's offsets), in the
    compact layout or ``layout`` (host op arguments of the same rows, e.g. ``big.line_cpu``):
    what the kernel copies, a padded slot's padding included."""
    _, block_base, row_units = (layout or big.comp_cpu)[:3]
    sizes = row_units.view(-1, 32)[ids // 32].to(torch.int64) * big.unit_bytes  # [k, 32]
    before = torch.cumsum(sizes, 1) - sizes
    pick = (ids % 32).unsqueeze(1)
    offsets = block_base[ids // 32] + before.gather(1, pick).squeeze(1)
    size = sizes.gather(1, pick).squeeze(1)
    return int(((offsets % SECTOR_BYTES + size + SECTOR_BYTES - 1) // SECTOR_BYTES).sum())


def time_table(
    ops, big: BigTable, dists: list[str], batches: tuple[int, ...], gpu: bool, rng
) -> list[dict[str, Any]]:
    rows = []
    r = big.row_bytes
    stage = torch.empty(max(batches), r, dtype=torch.uint8, pin_memory=gpu)
    dev = torch.empty(max(batches), r, dtype=torch.uint8, device="cuda" if gpu else "cpu")
    units = big.comp_cpu[2]
    for dist in dists:
        for n in batches:
            ids = id_stream(rng, big.num_rows, n, dist)
            offsets = torch.arange(0, n + 1, BAG_SIZE)

            def cpu_h2d(ids=ids, n=n):
                torch.index_select(big.plain, 0, ids, out=stage[:n])
                dev[:n].copy_(stage[:n], non_blocking=True)

            def h2d_batch(n=n):
                dev[:n].copy_(stage[:n], non_blocking=True)

            times = {"cpu_h2d": timed(cpu_h2d, gpu), "h2d_batch": timed(h2d_batch, gpu)}
            if gpu:
                times |= gpu_times(ops, big, ids.cuda(), offsets.cuda())
            # Bytes over PCIe: the gather reads each distinct row about once (dedupe runs, cut
            # every 32 copies); the pooled kernel re-reads repeats, so under Zipf ids this
            # undercounts its wire bytes.
            unique = torch.unique(ids)
            rows.append(
                {
                    "row_bytes": r,
                    "batch": n,
                    "ids": dist,
                    "seconds": {k: t.wall_s for k, t in times.items()},
                    "event_seconds": {
                        k: t.event_s for k, t in times.items() if t.event_s is not None
                    },
                    "raw_bytes": n * r,
                    "unique_ids": unique.numel(),
                    "raw_wire_bytes": unique.numel() * r,
                    "ibp_wire_bytes": int(units[unique].sum(dtype=torch.int64)) * big.unit_bytes,
                    # Raw rows lie at multiples of row_bytes, itself a multiple of 32.
                    "raw_wire_sectors": unique.numel() * (r // SECTOR_BYTES),
                    "ibp_wire_sectors": slot_sectors(big, unique),
                    "line_wire_sectors": None
                    if big.line_cpu is None
                    else slot_sectors(big, unique, big.line_cpu),
                }
            )
    return rows


def gpu_times(
    ops, big: BigTable, ids: torch.Tensor, offsets: torch.Tensor, gpu: bool = True
) -> dict[str, Timing]:
    """The GPU methods on one batch (ids and offsets on the GPU). With ``gpu=False`` the same
    calls on the CPU ops (what the tests run: their times mean nothing, and the CPU ops ignore
    the switches)."""
    gather = lambda: ops.ibp_gather(*big.comp, ids)  # noqa: E731
    pooled = lambda: ops.lookup_pooled(*big.comp, ids, offsets, None, 0, 0)  # noqa: E731
    with staging("sync"):
        sync_staging = timed(gather, gpu)
    with sort_min_ids(0):
        sorted_ids = timed(gather, gpu)
    with sort_min_ids(1 << 62):
        unsorted_ids = timed(gather, gpu)
    with env(DECODE_ENV, "copy"):
        copied = timed(gather, gpu)
    with deferred_errors(gpu):
        deferred = timed(pooled, gpu)
    times = {
        "ibp_none": timed(gather, gpu),
        "ibp_none_sync": sync_staging,
        "ibp_none_sorted": sorted_ids,
        "ibp_none_nosort": unsorted_ids,
        "ibp_copy": copied,
        "raw_none": timed(lambda: ops.ibp_gather(*big.raw, ids), gpu),
        "ibp_sum": timed(pooled, gpu),
        "ibp_sum_deferred": deferred,
        "raw_sum": timed(lambda: ops.lookup_pooled(*big.raw, ids, offsets, None, 0, 0), gpu),
    }
    if big.line is not None:
        line = big.line
        times["ibp_line"] = timed(lambda: ops.ibp_gather(*line, ids), gpu)
    if has_baseline():
        uva = torch.ops.ibpembed_bench.uva_gather
        times["uva"] = timed(lambda: uva(big.plain, ids), gpu)
    if big.plain_alias is not None:
        alias = big.plain_alias
        times["torch_uva"] = timed(lambda: torch.index_select(alias, 0, ids), gpu)
    return times


def phase_timing(ibpembed, ops, args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    """One row size (``--rows``; 0: the real table at its own row size): the big tables built
    (registered in place, or pinned copies when ``--pin copy``), checked, and every method
    timed."""
    total = int((0.01 if not gpu else args.table_gib) * GIB)
    pinned = Pinned(gpu, args.pin)
    checks = Checks()
    real = args.rows == 0
    rng = np.random.default_rng(args.rows)
    t0 = time.perf_counter()
    big = build_big(ibpembed, pinned, args.rows, total, args.profile, gpu, real=real)
    built_s = time.perf_counter() - t0
    log(
        f"R={big.row_bytes} ({big.source}): {big.num_rows} rows, "
        f"{big.num_rows * big.row_bytes / GIB:.2f} GiB raw, payload "
        f"{big.compressed_payload_bytes / GIB:.2f} GiB, stored ratio {big.ratio_stored:.3f}, "
        f"registration added {big.anonymous_added / 2**20:.1f} MiB RssAnon "
        f"(built in {built_s:.1f} s)"
    )
    check_big(ops, big, gpu, checks, rng)
    dists = ["uniform", *(f"zipf{a}" for a in args.zipf.split(","))]
    if args.variant == "thp":  # the huge-page A/B: uniform ids, where TLB reach matters most
        dists = ["uniform"]
    rows = time_table(ops, big, dists, BATCHES if gpu else BATCHES[:2], gpu, rng)
    variant = "real" if real else args.variant
    for row in rows:
        row["variant"] = variant
    return {
        "row_bytes": big.row_bytes,
        "variant": variant,
        "source": big.source,
        "pin": args.pin,
        "built_s": round(built_s, 1),
        "registered_bytes": pinned.registered_bytes,
        "anonymous_bytes_added_by_registration": big.anonymous_added,
        "checks": {"passed": checks.passed, "failures": checks.failures or []},
        "results": rows,
    }
