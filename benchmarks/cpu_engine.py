# SPDX-License-Identifier: Apache-2.0
"""The CPU lookup engine against an fbgemm-style control loop, in one process, without torch.

    python -m benchmarks.cpu_engine [--gib 1] [--profile fp32|bf16r] [--alpha A] [--csrc DIR ...]
                                    [--out DIR]

Whole-process A/Bs of the engine swing by up to 2x on a shared host (BENCHMARKS.md), more than
most changes to it are worth. This harness takes the process out: it compiles ``csrc/``'s lookup
engine with g++ (``at::parallel_for`` replaced by a serial loop, the ISA flags of setup.py) into
``benchmarks/cpu/engine_harness.cpp``, which times, alternating in one process, the control (the
shape of fbgemm's ``EmbeddingSpMDM``, what torchrec's CPU forward runs), ``lookup_pooled_cpu`` on
the rows stored raw (read as ibpembed reads an all-raw table: on the lean path, without the
index), and on the same rows compressed. The tables are DLRM-profile fp32 [N, 128]
(``--profile bf16r``: bf16-rounded values), payloads on transparent huge pages as ibpembed's
are; the ids are ``benchmarks.data.zipf_batches`` (B=512, Zipf 1.05 or ``--alpha``, 0 for
uniform ids; pooling 1..100), one thread. Read the ratios to the control: they hold where the
host's absolute speed does not.

Give ``--csrc`` several times (e.g. a worktree of another commit) to time several engines, their
runs alternating round by round. Results: DIR/cpu_engine.json and DIR/cpu_engine.md. x86-64 with
AVX2 only (the control is AVX2 code).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import data
from benchmarks._harness import RESULTS, run_metadata, write_results
from benchmarks.codec import GIB, gather_block, raw_rows_view
from ibpembed import codec

ROOT = Path(__file__).resolve().parent.parent
HARNESS_DIR = Path(__file__).resolve().parent / "cpu"
DIM = 128
BATCH_SIZE = 512
# The engine's sources; the harness provides main() and the serial at::parallel_for.
ENGINE_SOURCES = (
    "codec/cpu_path.cpp",
    "codec/corrupt_table.cpp",
    "codec/row_kernels_ref.cpp",
    "codec/row_kernels_bmi2.cpp",
    "codec/row_kernels_avx512.cpp",
    "lookup/lookup_cpu.cpp",
    "lookup/accumulate_avx2.cpp",
    "lookup/accumulate_avx512.cpp",
)


def runs_here() -> bool:
    """Whether this host can run the harness: x86-64 with AVX2 (the control loop's ISA)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    cpuinfo = Path("/proc/cpuinfo")
    return not cpuinfo.is_file() or " avx2" in cpuinfo.read_text()


def setup_flags() -> tuple[list[str], dict[str, list[str]]]:
    """setup.py's CXX_FLAGS and per-file ISA flags, read from its source (importing it would run
    the build), so the harness compiles the engine exactly as the extension does."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    values = {
        target.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id in ("CXX_FLAGS", "ISA_SOURCES")
    }
    return values["CXX_FLAGS"], values["ISA_SOURCES"]


def build_harness(csrc: Path, work: Path, compiler: str = "g++") -> Path:
    """Compiles csrc's engine and the harness into work/engine_harness; returns the binary."""
    cxx_flags, isa_sources = setup_flags()
    source = work / "csrc"
    shutil.copytree(csrc, source)
    shutil.copy(HARNESS_DIR / "serial_parallel.h", source / "ops" / "parallel.h")
    flags = [*cxx_flags, f"-I{source / 'include'}"]

    def compile_one(rel: str) -> Path:
        obj = work / (rel.replace("/", "_") + ".o")
        isa = isa_sources.get(f"csrc/{rel}", [])
        subprocess.run(
            [compiler, *flags, *isa, "-c", str(source / rel), "-o", str(obj)], check=True
        )
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, ENGINE_SOURCES))
    binary = work / "engine_harness"
    subprocess.run(
        [
            compiler,
            *flags,
            "-mavx2",
            str(HARNESS_DIR / "engine_harness.cpp"),
            *map(str, objects),
            "-o",
            str(binary),
        ],
        check=True,
    )
    return binary


def _write_table(table: codec.CompressedTable, directory: Path) -> None:
    directory.mkdir(parents=True)
    for name in ("payload", "block_base", "row_units", "bitmask", "mask", "bitval"):
        getattr(table, name).numpy().tofile(directory / f"{name}.bin")
    meta = (
        table.num_rows,
        table.row_bytes,
        table.unit_bytes,
        table.chunk_bits,
        table.mask.numel(),
        table.code_bits,
    )
    (directory / "meta.txt").write_text(" ".join(map(str, meta)) + "\n")


def write_inputs(
    directory: Path, gib: float, profile: str, batches: int, seed: int, alpha: float
) -> dict:
    """The raw and compressed tables and the lookup stream, as the harness reads them."""
    rows = max(int(gib * GIB) // (DIM * 4), 1)
    block = gather_block(rows, DIM, profile, seed)
    raw = codec.compress(data.tiled_table(block, rows), method="raw")
    gc.collect()
    compressed = codec.compress(raw_rows_view(raw))
    _write_table(raw, directory / "raw")
    _write_table(compressed, directory / "compressed")
    stream = data.zipf_batches(
        rows, num_batches=batches, batch_size=BATCH_SIZE, alpha=alpha, seed=seed
    )
    ids = torch.cat([b.ids for b in stream])
    offsets = [0]
    for batch in stream:
        offsets.extend((batch.offsets[1:] + offsets[-1]).tolist())
    ids.numpy().tofile(directory / "ids.bin")
    torch.tensor(offsets, dtype=torch.int64).numpy().tofile(directory / "offsets.bin")
    return {
        "rows": rows,
        "table_gib": rows * DIM * 4 / GIB,
        "savings": compressed.savings,
        "chunk_bits": compressed.chunk_bits,
        "code_bits": compressed.code_bits,
        "lookups": int(ids.numel()),
        "alpha": alpha,
    }


def run_rounds(
    binaries: dict[str, Path], inputs: Path, rounds: int, reps: int
) -> dict[str, list[dict]]:
    """Each binary times one round at a time, the binaries alternating. Raises if a run fails or
    its engine's pooled sums differ from the control's."""
    timings: dict[str, list[dict]] = {name: [] for name in binaries}
    for _ in range(rounds):
        for name, binary in binaries.items():
            done = subprocess.run(
                [str(binary), str(inputs), "1", str(reps), str(BATCH_SIZE)],
                capture_output=True,
                text=True,
                check=False,
            )
            lines = [json.loads(line) for line in done.stdout.splitlines()]
            if done.returncode != 0 or not lines or not lines[-1].get("agree"):
                raise RuntimeError(
                    f"{name}: harness failed ({done.returncode}): {done.stdout}{done.stderr}"
                )
            timings[name].append(lines[0])
    return timings


def summarize(timings: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for name, rounds in timings.items():
        per_round = {
            key: [r[f"{key}_ns"] for r in rounds] for key in ("control", "raw", "compressed")
        }
        summary[name] = {
            **{f"{key}_ns": values for key, values in per_round.items()},
            "raw_vs_control": statistics.median(
                c / r for c, r in zip(per_round["control"], per_round["raw"], strict=True)
            ),
            "compressed_vs_control": statistics.median(
                c / k for c, k in zip(per_round["control"], per_round["compressed"], strict=True)
            ),
            "compressed_vs_raw": statistics.median(
                r / k for r, k in zip(per_round["raw"], per_round["compressed"], strict=True)
            ),
        }
    return summary


def _ids_name(alpha: float) -> str:
    return "uniform" if alpha == 0 else f"Zipf {alpha:g}"


def markdown(report: dict) -> str:
    t = report["table"]
    lines = [
        f"`{report['command']}` ({report['date']}, commit {report['commit']}, "
        f"{report['machine']}, CPU path {report['cpu_path']}): {t['rows']:,} x {DIM} "
        f"{report['profile']} rows ({t['table_gib']:.2f} GiB; compressed saves "
        f"{100 * t['savings']:.1f} %, W={t['chunk_bits']}, C={t['code_bits']}), "
        f"{t['lookups']:,} {_ids_name(t.get('alpha', 1.05))} lookups per pass, B={BATCH_SIZE}, "
        "one thread; best of "
        f"{report['reps']} passes per round, {report['rounds']} rounds. ns per lookup (range over "
        "rounds); ratios are medians of per-round ratios, above 1 = faster than the other.",
        "",
        "| engine source | control ns | raw ns | compressed ns | raw vs control | "
        "compressed vs control | compressed vs raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in report["results"].items():
        spans = [
            f"{min(s[k]):.1f}-{max(s[k]):.1f}" for k in ("control_ns", "raw_ns", "compressed_ns")
        ]
        lines.append(
            f"| {name} | {' | '.join(spans)} | {s['raw_vs_control']:.2f}x | "
            f"{s['compressed_vs_control']:.2f}x | {s['compressed_vs_raw']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def _label(tree: Path) -> str:
    """A csrc tree's name in the report: relative to this checkout when inside it."""
    resolved = tree.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="table size (default 1 GiB)")
    parser.add_argument("--profile", choices=("fp32", "bf16r"), default="fp32")
    parser.add_argument("--batches", type=int, default=24, help="B=512 batches per pass")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="passes per round (best kept)")
    parser.add_argument(
        "--csrc",
        type=Path,
        action="append",
        help="a csrc/ tree to build (repeatable; default: this checkout's)",
    )
    parser.add_argument(
        "--alpha", type=float, default=1.05, help="Zipf exponent of the ids (0: uniform)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not runs_here():
        print(
            "benchmarks.cpu_engine: needs x86-64 with AVX2 (the control loop's ISA)",
            file=sys.stderr,
        )
        return 2
    trees = args.csrc or [ROOT / "csrc"]
    with tempfile.TemporaryDirectory(prefix="ibpembed-cpu-engine-") as tmp:
        work = Path(tmp)
        binaries = {}
        for k, tree in enumerate(trees):
            build = work / f"build{k}"
            build.mkdir()
            binaries[_label(tree)] = build_harness(tree.resolve(), build)
        table = write_inputs(
            work / "inputs", args.gib, args.profile, args.batches, args.seed, args.alpha
        )
        timings = run_rounds(binaries, work / "inputs", args.rounds, args.reps)
    report = {
        **run_metadata(" ".join(["python -m benchmarks.cpu_engine", *(argv or sys.argv[1:])])),
        "cpu_path": codec.cpu_path(),
        "profile": args.profile,
        "rounds": args.rounds,
        "reps": args.reps,
        "table": table,
        "results": summarize(timings),
    }
    text = markdown(report)
    write_results(args.out, "cpu_engine", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
