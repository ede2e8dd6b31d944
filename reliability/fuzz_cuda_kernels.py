# SPDX-License-Identifier: Apache-2.0
"""Fuzz of the CUDA kernels' device code, run on the CPU by the SIMT emulator of tools/simt.

    python -m reliability.fuzz_cuda_kernels --seconds 600 --seed 1 --json out.json

Each case draws a small table from the codec fuzz's generators (reliability.fuzz_codec: dtype,
value distribution, row count and width), compresses it with a random chunk width, code width and
slot alignment, and runs through the emulated kernels on a random grid (1-3 blocks of 1-4 warps,
asynchronous or synchronous staging):

- the gather kernel on random ids with repeats (now and then one id past a warp's run cap), and
  the whole-table decompress, both against the CPU op bit for bit;
- for float rows and fbgemm row-wise int8 rows, the pooled kernel on random bags (empty ones
  included), weighted or not, SUM or MEAN, against the CPU op bit for bit (NaN equal to NaN).

A mismatch, a non-zero error word on valid input, or an emulator failure (divergent collectives,
deadlock, a copy out of bounds) is reported with its case seed (`--case SEED` replays one) and
makes the exit status 1. One process: the emulator already runs a block's threads side by side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ibpembed import compress
from ibpembed.layout import INT8_ROWWISE_CODE, POOLING_CODES
from reliability import fuzz_codec as fc
from tools.simt.harness import EmulatedKernels, EmulationError, Grid, build

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
# The codec fuzz's widths up to 513 elements: wider rows only cost emulation time here.
DIMS = tuple(d for d in fc.DIMS if d <= 513)
ALIGNS = (None, *fc.ALIGNS)


@dataclass
class Stats:
    cases: int = 0
    rows_gathered: int = 0
    rows_decompressed: int = 0
    bags_pooled: int = 0
    ids_pooled: int = 0
    by_code_bits: dict[str, int] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)


def _pooled_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    same = got.view(torch.int32) == want.view(torch.int32)
    return bool((same | (got.isnan() & want.isnan())).all())


def run_case(kernels: EmulatedKernels, seed: int, stats: Stats) -> list[str]:
    """One case from `seed`; returns what went wrong (empty: nothing)."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[rng.integers(len(DTYPES))]
    kind = fc.KINDS[rng.integers(len(fc.KINDS))]
    rows, dim = fc.table_rows(rng), int(DIMS[rng.integers(len(DIMS))])
    table = fc.as_table(fc.make_values(rng, kind, dtype, rows, dim), dtype)
    quant = "int8_rowwise" if kind == "int8_rowwise" and dtype == torch.uint8 and dim > 4 else None
    c = compress(
        table,
        chunk_bits=int(rng.choice(fc.CHUNK_BITS)),
        code_bits=int(rng.choice(fc.CODE_BITS, p=fc.CODE_BITS_P)),
        align=ALIGNS[rng.integers(len(ALIGNS))],
        quant=quant,
        seed=seed % 1000,
    )
    grid = Grid(int(rng.integers(1, 4)), int(rng.integers(1, 5)), bool(rng.random() < 0.7))
    problems: list[str] = []
    where = f"case {seed}: {dtype} {kind} {rows}x{dim} W={c.chunk_bits} C={c.code_bits} {grid}"

    ids = rng.integers(0, rows, int(rng.integers(1, 64)))
    if rng.random() < 0.2:
        ids = np.concatenate([ids, np.full(40, rng.integers(rows))])  # past the run cap
    ids = torch.from_numpy(ids)
    got, error = kernels.gather(c, ids, grid)
    want = c.gather(ids).contiguous().view(torch.uint8).view(ids.numel(), c.row_bytes)
    if error or not torch.equal(got, want):
        problems.append(f"{where}: gather differs (error word {error})")
    whole, error = kernels.gather(c, None, grid)
    if error or not torch.equal(whole, table.view(torch.uint8).view(rows, c.row_bytes)):
        problems.append(f"{where}: decompress differs (error word {error})")
    stats.rows_gathered += ids.numel()
    stats.rows_decompressed += rows

    dtype_code = INT8_ROWWISE_CODE if quant else (c.dtype_code if dtype != torch.uint8 else None)
    if dtype_code is not None:
        lengths = rng.integers(0, 7, int(rng.integers(1, 12)))
        lengths[rng.random(lengths.size) < 0.2] = 0
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
        bag_ids = torch.from_numpy(rng.integers(0, rows, int(lengths.sum())))
        weights = None
        if rng.random() < 0.5:
            weights = torch.from_numpy(rng.uniform(-2, 2, bag_ids.numel()).astype(np.float32))
        pooling = ("sum", "mean")[rng.integers(2)]
        got, error = kernels.pooled(
            c, bag_ids, offsets, weights, dtype_code, POOLING_CODES[pooling], grid
        )
        want = c.lookup(bag_ids, offsets, weights, pooling)
        if error or not _pooled_equal(got, want):
            problems.append(f"{where}: pooled {pooling} differs (error word {error})")
        stats.bags_pooled += lengths.size
        stats.ids_pooled += bag_ids.numel()
    key = str(c.code_bits)
    stats.by_code_bits[key] = stats.by_code_bits.get(key, 0) + 1
    stats.cases += 1
    return problems


def case_seeds(args: argparse.Namespace) -> Iterator[int]:
    """The seeds of the cases to run: the one replayed, or one per case until --cases or
    --seconds runs out."""
    if args.case is not None:
        yield args.case
        return
    deadline = time.perf_counter() + args.seconds
    for index in itertools.count():
        done = index >= args.cases if args.cases is not None else time.perf_counter() >= deadline
        if done:
            return
        yield args.seed * 1_000_003 + index


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0, help="run this long")
    p.add_argument("--cases", type=int, help="stop after this many cases (instead of --seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, help="replay the case with this seed (from a report)")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as build_dir:
        started = time.perf_counter()
        kernels = EmulatedKernels(build(Path(build_dir)))
        build_s = time.perf_counter() - started
        stats = Stats()
        for seed in case_seeds(args):
            try:
                problems = run_case(kernels, seed, stats)
            except EmulationError as e:
                problems = [f"case {seed}: emulator stopped the launch: {e}"]
            stats.failures += [{"seed": seed, "problem": m} for m in problems]
            for m in problems:
                print(m, flush=True)
        seconds = time.perf_counter() - started
    summary = {
        "command": " ".join(["python -m reliability.fuzz_cuda_kernels", *(argv or sys.argv[1:])]),
        "emulator_build_s": round(build_s, 1),
        "seconds": round(seconds, 1),
        **asdict(stats),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=2))
    print(f"{len(stats.failures)} failures")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
