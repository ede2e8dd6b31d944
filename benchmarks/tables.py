# SPDX-License-Identifier: Apache-2.0
"""Table-file benchmark: pack throughput and peak memory, load time vs ``torch.load``.

    python -m benchmarks.tables [--gib 2] [--tables 4] [--repeats 3] [--out DIR]

One run writes a raw state dict of ``--tables`` DLRM-profile fp32 tables (D=128, ``--gib`` GiB in
all) with ``torch.save``, packs it with the ``ibpembed pack`` CLI, and loads both, each load in a
fresh process so nothing is shared between them:

* **pack**: wall time and throughput (raw GiB/s), and the process's peak resident memory
  (``VmHWM``) relative to the table bytes; sampled ``/proc`` counters split it into anonymous
  memory and file-backed pages (the memory-mapped source, shared libraries). A pack of a
  one-row source gives the interpreter's own baseline (torch and the extension imported).
* **load**: ``torch.load`` of the state dict (read into memory: what serving raw tensors takes),
  ``torch.load(mmap=True)``, ``TableStore.load`` of the packed set (mmap; header, index and
  metadata checksums), the same with ``prefetch=True`` (the payload's reads queued in the
  background at load, what ``ibpembed serve`` does by default; the calls block while the
  device queue is full) and
  ``TableStore.load(verify=True)`` (every payload byte hashed too). Each
  also times its first lookup (one B=512 pooled batch per table), which for the mmap loads is
  where pages come in. Two cache states: *warm* (files in the page cache) and *cold* (the files'
  pages dropped with ``posix_fadvise(DONTNEED)`` first; the VM's host may still cache the disk).

Targets: loading a packed set ≥ 5× faster than ``torch.load`` of the raw tensors; pack
peak RSS ≤ 1.5× the table size. Results: DIR/tables.json and DIR/tables.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import data
from benchmarks._harness import RESULTS, run_metadata, write_results
from ibpembed import cpu_path

REPO = Path(__file__).resolve().parent.parent
IBPEMBED = [sys.executable, "-m", "ibpembed.cli"]
GIB = 1 << 30
DIM = 128
LOOKUP_BATCH = 512
LOOKUP_POOLING = 20
LOAD_KINDS = ("torch.load", "torch.load mmap", "ibpembed", "ibpembed prefetch", "ibpembed verify")
LOAD_TARGET = 5.0
PACK_RSS_TARGET = 1.5

# Runs in a fresh interpreter per load: imports are not timed, the load and first lookup are.
_LOADER = r"""
import json, os, sys, time
from pathlib import Path
import torch
from ibpembed.tables.store import TableStore
torch.set_num_threads(1)
kind, path, cold = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "cold"
batch, pooling = int(sys.argv[4]), int(sys.argv[5])
if cold:
    for f in ([p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
gen = torch.Generator().manual_seed(0)
offsets = torch.arange(0, batch * pooling + 1, pooling)
started = time.perf_counter()
if kind.startswith("torch.load"):
    tables = torch.load(path, weights_only=True, mmap=kind.endswith("mmap"))
    loaded = time.perf_counter()
    for t in tables.values():
        ids = torch.randint(0, t.shape[0], (batch * pooling,), generator=gen)
        torch.nn.functional.embedding_bag(ids, t, offsets[:-1], mode="sum")
else:
    store = TableStore.load(
        path, verify=kind.endswith("verify"), prefetch=kind.endswith("prefetch")
    )
    loaded = time.perf_counter()
    with store.acquire() as snap:
        for t in snap.tables.values():
            ids = torch.randint(0, t.num_rows, (batch * pooling,), generator=gen)
            t.lookup(ids, offsets)
done = time.perf_counter()
print(json.dumps({"load_s": loaded - started, "first_lookup_s": done - loaded}))
"""


def _status_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a live process, in KiB (empty once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(rest.split()[0])
    return fields


def _read_all(file: Any) -> str:
    file.seek(0)
    return file.read().decode()


# ``ibpembed pack`` reporting its own peak RSS at exit. NOTE(bench): ``ru_maxrss`` (wait4,
# getrusage) cannot be used: at exec Linux carries over the high-water mark of the forked copy
# of the parent, so a child of a process holding 2 GiB reports at least 2 GiB. VmHWM belongs
# to the process's own address space.
_PACK = r"""
import atexit, runpy, sys
def report():
    hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print("VmHWM_KIB", int(hwm.split()[1]), file=sys.stderr)
atexit.register(report)
sys.argv = ["ibpembed", *sys.argv[1:]]
runpy.run_module("ibpembed.cli", run_name="__main__")
"""


def run_pack(source: Path, out: Path) -> dict[str, Any]:
    """``ibpembed pack SOURCE -o OUT``: wall seconds, peak RSS and sampled peaks of anonymous
    and file-backed resident memory."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        started = time.perf_counter()
        argv = ["pack", str(source), "-o", str(out), "--no-progress", "--json"]
        proc = subprocess.Popen(
            [sys.executable, "-c", _PACK, *argv],
            cwd=REPO,
            stdout=stdout,
            stderr=stderr,
        )
        peaks = {"RssAnon": 0, "RssFile": 0}
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.02):
                for key, kib in _status_kib(proc.pid).items():
                    if key in peaks:
                        peaks[key] = max(peaks[key], kib)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc.wait()
        seconds = time.perf_counter() - started
        stop.set()
        sampler.join()
        output, errors = _read_all(stdout), _read_all(stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"ibpembed pack failed ({proc.returncode}): {errors[-2000:]}")
    hwm = [line for line in errors.splitlines() if line.startswith("VmHWM_KIB ")]
    return {
        "seconds": seconds,
        "peak_rss_bytes": int(hwm[-1].split()[1]) * 1024,
        "peak_anon_bytes": peaks["RssAnon"] * 1024,
        "peak_file_bytes": peaks["RssFile"] * 1024,
        "report": json.loads(output),
    }


def run_load(kind: str, path: Path, cold: bool) -> dict[str, float]:
    argv = [sys.executable, "-c", _LOADER, kind, str(path), "cold" if cold else "warm"]
    argv += [str(LOOKUP_BATCH), str(LOOKUP_POOLING)]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def write_state_dict(path: Path, num_tables: int, rows: int) -> int:
    """``torch.save`` of ``num_tables`` [rows, DIM] fp32 tables, fsynced (so that cold runs can
    drop its pages); returns the raw bytes."""
    tables = {f"t{i}": data.dlrm_table(rows, DIM, seed=i) for i in range(num_tables)}
    torch.save(tables, path)
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
    return sum(t.numel() * t.element_size() for t in tables.values())


def measure(args: argparse.Namespace, work: Path, command: str) -> dict[str, Any]:
    rows = int(args.gib * GIB) // (args.tables * DIM * 4)
    source, packed = work / "raw.pt", work / "packed"
    raw_bytes = write_state_dict(source, args.tables, rows)
    write_state_dict(work / "one_row.pt", 1, 1)
    baseline = run_pack(work / "one_row.pt", work / "one_row")
    pack = run_pack(source, packed)
    stored = sum(p.stat().st_size for p in packed.iterdir() if p.is_file())

    loads: dict[str, dict[str, list[dict[str, float]]]] = {
        state: {kind: [] for kind in LOAD_KINDS} for state in ("warm", "cold")
    }
    for rep in range(args.repeats):
        kinds = LOAD_KINDS if rep % 2 == 0 else tuple(reversed(LOAD_KINDS))
        for state in ("cold", "warm"):
            for kind in kinds:
                path = source if kind.startswith("torch") else packed
                if state == "warm":
                    run_load(kind, path, cold=False)  # brings the pages in; timed next
                loads[state][kind].append(run_load(kind, path, cold=state == "cold"))
    return {
        **run_metadata(command),
        "cpu_path": cpu_path(),
        "tables": args.tables,
        "rows_per_table": rows,
        "dim": DIM,
        "raw_bytes": raw_bytes,
        "source_file_bytes": source.stat().st_size,
        "packed_bytes": stored,
        "pack": pack,
        "pack_baseline": baseline,
        "loads": {
            state: {
                kind: {
                    "load_s": statistics.median(r["load_s"] for r in runs),
                    "first_lookup_s": statistics.median(r["first_lookup_s"] for r in runs),
                    "runs": runs,
                }
                for kind, runs in by_kind.items()
            }
            for state, by_kind in loads.items()
        },
    }


def render_markdown(r: dict[str, Any]) -> str:
    gib = r["raw_bytes"] / GIB
    pack, base = r["pack"], r["pack_baseline"]
    rss_ratio = pack["peak_rss_bytes"] / r["raw_bytes"]
    above_baseline = (pack["peak_rss_bytes"] - base["peak_rss_bytes"]) / r["raw_bytes"]
    lines = [
        f"`{r['command']}` ({r['date']}, commit {r['commit']}, {r['machine']}, "
        f"Python {r['python']}, torch {r['torch']}, CPU path {r['cpu_path']}): "
        f"{r['tables']} DLRM-profile fp32 tables of {r['rows_per_table']:,} × {r['dim']} "
        f"({gib:.2f} GiB raw; `torch.save` file {r['source_file_bytes'] / GIB:.2f} GiB; packed "
        f"set {r['packed_bytes'] / GIB:.2f} GiB). Loads in fresh processes, median of "
        f"{len(r['loads']['warm']['ibpembed']['runs'])}; first lookup: one B={LOOKUP_BATCH} "
        f"SUM batch of {LOOKUP_POOLING} uniform ids per sample per table, one thread.",
        "",
        "| pack | seconds | GiB/s (raw) | peak RSS | peak RSS / table bytes | anonymous peak "
        "| file-backed peak (source pages, libraries) | interpreter baseline "
        "| (peak − baseline) / table bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| `ibpembed pack raw.pt` | {pack['seconds']:.1f} | {gib / pack['seconds']:.2f} "
        f"| {pack['peak_rss_bytes'] / GIB:.2f} GiB | {rss_ratio:.2f}× "
        f"| {pack['peak_anon_bytes'] / GIB:.2f} GiB | {pack['peak_file_bytes'] / GIB:.2f} GiB "
        f"| {base['peak_rss_bytes'] / GIB:.2f} GiB | {above_baseline:.2f}× |",
        "",
        "| cache | load | load s | s/GiB | first lookup s | load vs torch.load |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for state in ("cold", "warm"):
        reference = r["loads"][state]["torch.load"]["load_s"]
        for kind in LOAD_KINDS:
            x = r["loads"][state][kind]
            label = {
                "torch.load": "`torch.load(raw.pt)`",
                "torch.load mmap": "`torch.load(raw.pt, mmap=True)`",
                "ibpembed": "`TableStore.load(packed)`",
                "ibpembed prefetch": "`TableStore.load(packed, prefetch=True)`",
                "ibpembed verify": "`TableStore.load(packed, verify=True)`",
            }[kind]
            lines.append(
                f"| {state} | {label} | {x['load_s']:.3f} | {x['load_s'] / gib:.3f} "
                f"| {x['first_lookup_s']:.3f} | {reference / x['load_s']:.1f}× |"
            )
    speedups = {
        state: r["loads"][state]["torch.load"]["load_s"] / r["loads"][state]["ibpembed"]["load_s"]
        for state in ("cold", "warm")
    }
    # Our load defers reading rows to the lookups: the first batch is part of what it costs.
    with_first = {
        state: sum(r["loads"][state]["torch.load"][k] for k in ("load_s", "first_lookup_s"))
        / sum(r["loads"][state]["ibpembed"][k] for k in ("load_s", "first_lookup_s"))
        for state in ("cold", "warm")
    }
    load_met = min(speedups.values()) >= LOAD_TARGET
    first_met = min(with_first.values()) >= LOAD_TARGET
    rss_met = rss_ratio <= PACK_RSS_TARGET
    lines += [
        "",
        f"Targets: load ≥ {LOAD_TARGET:g}× faster than `torch.load`: "
        f"{speedups['cold']:.1f}× cold, {speedups['warm']:.1f}× warm, "
        f"{'met' if load_met else 'missed'}; counting the first lookup too: "
        f"{with_first['cold']:.2f}× cold, {with_first['warm']:.1f}× warm, "
        f"{'met' if first_met else 'missed'}; pack peak RSS ≤ {PACK_RSS_TARGET:g}× the table "
        f"bytes: {rss_ratio:.2f}×, {'met' if rss_met else 'missed'}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="raw table bytes, GiB")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="loads per kind and cache state")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp)")
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        results = measure(args, Path(tmp), " ".join(["python -m benchmarks.tables", *given]))
    markdown = render_markdown(results)
    write_results(args.out, "tables", results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
