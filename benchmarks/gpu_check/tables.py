# SPDX-License-Identifier: Apache-2.0
"""The big tables the timing phases read: GiBs of rows registered in place, made at memcpy cost
by repeating one compressed tile (synthetic DLRM-profile rows, or a slice of a real embedding
table: real_table.py), the same rows stored raw for the same kernels, and the id streams."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from benchmarks.gpu_check.common import BAG_SIZE, Checks, has_baseline, same_bits, sort_min_ids
from benchmarks.gpu_check.device import Pinned
from benchmarks.gpu_check.real_table import real_table

if TYPE_CHECKING:  # the package imports ibpembed only once a phase runs (it may build it first)
    from ibpembed.codec import TableArgs

TILE_BYTES = 64 << 20  # big tables are copies of one compressed tile of this many raw bytes
FIT_SAMPLE_ROWS = 65536


@dataclass
class BigTable:
    row_bytes: int
    num_rows: int
    plain: torch.Tensor  # [N, row_bytes] uint8, pinned: the uva/cpu baselines' table
    comp_cpu: TableArgs  # op arguments, everything on the host (the CPU ops' view)
    comp: TableArgs  # op arguments for the CUDA ops (payload pinned, small parts on the GPU)
    raw_cpu: TableArgs  # the same rows stored raw, on the host
    raw: TableArgs  # ... and placed for the same kernels
    unit_bytes: int
    compressed_payload_bytes: int
    ratio_stored: float  # raw bytes / (payload + index + bitmask + masks)
    source: str  # where the tile's rows come from
    plain_alias: torch.Tensor | None  # the plain rows' device alias (registered), else None
    anonymous_added: int  # RssAnon the registrations added
    # The same rows in gpu_layout.line_aware's layout (slots moved to 32-byte boundaries where
    # that saves lines), host and placed; None for the real table.
    line_cpu: TableArgs | None = None
    line: TableArgs | None = None


def tiled(c, tile_rows: int, reps: int, pinned: Pinned) -> tuple[torch.Tensor, tuple, int]:
    """Table ``c``'s first ``tile_rows`` rows (whole blocks) repeated ``reps`` times at memcpy
    cost: the payload buffer (written, not yet registered), the small tensors, and one tile's
    payload bytes. Tiling keeps the layout exact: block i of copy r starts at tile base + r *
    used."""
    blocks_per_tile = tile_rows // 32
    used = int(c.block_base[blocks_per_tile])
    payload = pinned.empty(reps * used + 16)
    payload[: reps * used].view(reps, used).copy_(c.payload[:used].expand(reps, used))
    payload[reps * used :].zero_()
    shifts = torch.arange(reps, dtype=torch.int64).mul_(used).unsqueeze(1)
    block_base = torch.cat(
        [
            (c.block_base[:blocks_per_tile].unsqueeze(0) + shifts).flatten(),
            torch.tensor([reps * used]),
        ]
    )
    small = (
        block_base,
        c.row_units[:tile_rows].repeat(reps),
        c.bitmask[:blocks_per_tile].repeat(reps),
        c.mask,
        c.bitval,
    )
    return payload, small, used


def build_big(
    ibpembed,
    pinned: Pinned,
    row_bytes: int,
    total_bytes: int,
    profile: str,
    gpu: bool,
    real: bool = False,
) -> BigTable:
    """~total_bytes of rows, one compressed tile repeated at memcpy cost: fp32 DLRM-profile rows
    of ``row_bytes`` (``profile="dlrm-bf16"``: rounded to bf16 values, the low 16 bits zero), or
    with ``real`` the real table of :mod:`real_table` as it was packed (its own row size)."""
    from benchmarks import data

    if real:
        from ibpembed.tables import format as tf

        path = real_table()
        c = tf.read_table(path, verify=True).table
        tile_rows = c.num_rows // 32 * 32  # whole blocks: the tiling repeats blocks
        tile = c.gather(torch.arange(tile_rows))
        row_bytes = c.row_bytes
        source = f"{path.name}: {tile_rows} real rows of {c.dim} {c.dtype}"
    else:
        dim = row_bytes // 4
        tile_rows = max(32, min(TILE_BYTES, total_bytes) // row_bytes // 32 * 32)
        tile = data.dlrm_table(tile_rows, dim, seed=row_bytes)
        if profile == "dlrm-bf16":
            tile = data.bf16_rounded(tile)
        c = ibpembed.compress(tile, sample_rows=FIT_SAMPLE_ROWS)
        source = f"synthetic {profile}"
    reps = max(1, total_bytes // (tile_rows * row_bytes))
    n = tile_rows * reps
    payload, small, used = tiled(c, tile_rows, reps, pinned)
    block_base = small[0]
    ints = (c.chunk_bits, row_bytes, c.unit_bytes, n)
    line_payload, line_small = None, None
    if not real:  # the synthetic tile is whole blocks: c is the tile itself
        from ibpembed.tables.gpu_layout import line_aware

        line_payload, line_small, _ = tiled(line_aware(c), tile_rows, reps, pinned)
    plain_buf = pinned.empty(n * row_bytes + 16)
    plain_buf[n * row_bytes :].zero_()
    plain = plain_buf[: n * row_bytes].view(n, row_bytes)
    plain.view(reps, tile_rows * row_bytes).copy_(
        tile.contiguous().view(torch.uint8).reshape(1, -1).expand(reps, -1)
    )
    anonymous_before = pinned.anonymous_added
    pinned.place(payload)  # registered once written: the pins hold these pages
    pinned.place(plain_buf)
    if line_payload is not None:
        pinned.place(line_payload)
    # Raw layout over the very same bytes: every slot is the row itself (unit 8 divides it).
    unit = ibpembed.codec.slot_unit_bytes(row_bytes, 8)
    blocks = n // 32
    raw_small = (
        torch.arange(blocks + 1, dtype=torch.int64).mul_(32 * row_bytes),
        torch.full((n,), row_bytes // unit, dtype=torch.uint8),
        torch.zeros(blocks, dtype=torch.int32),
        torch.zeros_like(c.mask),
        torch.zeros_like(c.bitval),
    )
    raw_ints = (c.chunk_bits, row_bytes, unit, n)
    to_gpu = (lambda ts: tuple(t.cuda() for t in ts)) if gpu else (lambda ts: ts)
    metadata = 8 * (c.mask.numel() + c.bitval.numel())  # masks and codebooks, as c counts them
    stored = reps * used + 16 + block_base.numel() * 8 + n + blocks * 4 + metadata
    alias = pinned.on_device(plain_buf)
    args = ibpembed.codec.TableArgs
    return BigTable(
        row_bytes=row_bytes,
        num_rows=n,
        plain=plain,
        comp_cpu=args(payload, *small, *ints),
        comp=args(pinned.on_device(payload), *to_gpu(small), *ints),
        raw_cpu=args(plain_buf, *raw_small, *raw_ints),
        raw=args(alias, *to_gpu(raw_small), *raw_ints),
        unit_bytes=c.unit_bytes,
        compressed_payload_bytes=reps * used,
        ratio_stored=n * row_bytes / stored,
        source=source,
        plain_alias=alias[: n * row_bytes].view(n, row_bytes) if alias.is_cuda else None,
        anonymous_added=pinned.anonymous_added - anonymous_before,
        line_cpu=None if line_small is None else args(line_payload, *line_small, *ints),
        line=None
        if line_small is None
        else args(pinned.on_device(line_payload), *to_gpu(line_small), *ints),
    )


def zipf_ids(rng: np.random.Generator, num_rows: int, size: int, alpha: float) -> np.ndarray:
    """Zipf(alpha) ranks by inverse CDF of the continuous power law, scattered over the table by
    an affine bijection (hot rows are not neighbours in a real table)."""
    u = rng.random(size)
    if alpha == 1.0:
        ranks = np.exp(u * math.log(num_rows + 1.0)) - 1.0
    else:
        a = 1.0 - alpha
        ranks = (((num_rows + 1.0) ** a - 1.0) * u + 1.0) ** (1.0 / a) - 1.0
    ranks = np.clip(np.floor(ranks), 0, num_rows - 1).astype(np.int64)
    return zipf_rows(ranks, num_rows)


def zipf_rows(ranks: np.ndarray, num_rows: int) -> np.ndarray:
    """The rows of Zipf ranks (0: the most frequent) in :func:`zipf_ids`' tables."""
    mult = 2654435761
    while math.gcd(mult, num_rows) != 1:
        mult += 2
    return (ranks * mult + 12345) % num_rows


def id_stream(rng, num_rows: int, size: int, dist: str) -> torch.Tensor:
    if dist == "uniform":
        return torch.from_numpy(rng.integers(0, num_rows, size))
    return torch.from_numpy(zipf_ids(rng, num_rows, size, float(dist.removeprefix("zipf"))))


def check_big(ops, big: BigTable, gpu: bool, checks: Checks, rng) -> None:
    """The tiled tables decode to the plain rows (CPU ops), and the CUDA ops agree (GPU)."""
    ids = id_stream(rng, big.num_rows, 4096, "uniform")
    ids[-1] = big.num_rows - 1  # the last row sits past 4 GiB of payload: 64-bit offsets
    want = big.plain[ids]
    r = big.row_bytes
    checks.record(same_bits(ops.ibp_gather(*big.comp_cpu, ids), want), f"tiled R={r} (CPU)")
    checks.record(same_bits(ops.ibp_gather(*big.raw_cpu, ids), want), f"raw layout R={r} (CPU)")
    if big.line_cpu is not None:
        line = ops.ibp_gather(*big.line_cpu, ids)
        checks.record(same_bits(line, want), f"line-aware layout R={r} (CPU)")
    if not gpu:
        return
    gids = ids.cuda()
    checks.record(same_bits(ops.ibp_gather(*big.comp, gids).cpu(), want), f"big gather R={r}")
    checks.record(same_bits(ops.ibp_gather(*big.raw, gids).cpu(), want), f"big raw gather R={r}")
    if big.line is not None:
        line = ops.ibp_gather(*big.line, gids).cpu()
        checks.record(same_bits(line, want), f"big line-aware gather R={r}")
    with sort_min_ids(0):  # the sorted path, whatever the default rule picks at 4096 ids
        sorted_rows = ops.ibp_gather(*big.comp, gids).cpu()
    checks.record(same_bits(sorted_rows, want), f"big sorted gather R={r}")
    if has_baseline():
        uva = torch.ops.ibpembed_bench.uva_gather(big.plain, gids).cpu()
        checks.record(same_bits(uva, want), f"uva baseline R={r}")
    if big.plain_alias is not None:
        torch_uva = torch.index_select(big.plain_alias, 0, gids).cpu()
        checks.record(same_bits(torch_uva, want), f"torch_uva baseline R={r}")
    offsets = torch.arange(0, ids.numel() + 1, BAG_SIZE)
    cpu_sum = ops.lookup_pooled(*big.comp_cpu, ids, offsets, None, 0, 0)
    gpu_sum = ops.lookup_pooled(*big.comp, gids, offsets.cuda(), None, 0, 0).cpu()
    checks.record(torch.equal(cpu_sum, gpu_sum), f"big pooled sum R={r}")
