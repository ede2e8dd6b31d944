# SPDX-License-Identifier: Apache-2.0
"""The driver: every phase in a child process of its own, against one deadline, merged into one
report rewritten after each phase; and the entry point of a phase's child.

Each child writes its JSON into a folder under benchmarks/.cache; after every phase the driver
rewrites the merged report (``--out``) and a tarball of the phase files beside it, so the
output folder holds a few files however many phases ran (a GPU run returns at most 8)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.common import CACHE, ROOT, is_cuda_fault, log, staging
from benchmarks.gpu_check.machine import machine
from benchmarks.gpu_check.sanitizer import run_sanitizer
from benchmarks.gpu_check.summary import print_table, sort_rule, summarise

# Seconds each phase is expected to take on the GPU machine (docs/cuda.md has the estimates; used
# only to skip a phase that cannot finish before the deadline); children are killed there anyway.
EXPECTED_S = {
    "build": 120,
    "preflight": 25,
    "correctness": 60,
    "served": 20,
    "h2d": 10,
    "hbm_tier": 60,
    "timing": 60,
    "sanitizer": 45,
}
# The row size the raw-vs-H2D target is defined at goes first.
TIMING_ORDER = (512, 64, 1024, 256)
DRIVER_PHASES = (
    "build",
    "preflight",
    "correctness",
    "served",
    "h2d",
    "hbm_tier",
    "timing",
    "sanitizer",
)


def phases_tarball(out: Path) -> Path:
    return out.with_name(f"{out.stem}_phases.tar.gz")


class Driver:
    """Runs the phases in child processes against one deadline, merging every phase's JSON
    into one report that is rewritten after each phase."""

    def __init__(self, args: argparse.Namespace, out: Path, gpu: bool) -> None:
        self.args = args
        self.out = out
        self.gpu = gpu
        self.deadline = time.monotonic() + args.deadline_s
        self.extra: list[str] = []  # options every later phase gets (--pin copy, --load-extension)
        self.child: subprocess.Popen | None = None
        self.only = set(args.only.split(",")) if args.only else set(DRIVER_PHASES)
        unknown = self.only - set(DRIVER_PHASES)
        if unknown:
            raise SystemExit(f"--only: unknown phases {sorted(unknown)}; of {DRIVER_PHASES}")
        CACHE.mkdir(parents=True, exist_ok=True)
        self.phase_dir = Path(tempfile.mkdtemp(prefix="gpu_check_phases.", dir=CACHE))
        self.report: dict[str, Any] = {
            "machine": machine(gpu),
            "command": " ".join(["python -m benchmarks.gpu_check", *sys.argv[1:]]),
            "deadline_s": args.deadline_s,
            "profile": args.profile,
            "phases": {},
        }

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=2))
        with tarfile.open(phases_tarball(self.out), "w:gz") as tar:
            for path in sorted(self.phase_dir.glob("*.json")):
                tar.add(path, arcname=f"phases/{path.name}")

    def record(self, key: str, result: dict[str, Any]) -> None:
        self.report["phases"][key] = result
        self.save()

    def common(self) -> list[str]:
        a = self.args
        flags = ["--table-gib", str(a.table_gib), "--zipf", a.zipf, "--profile", a.profile]
        flags += ["--dry-run"] if a.dry_run else []
        flags += ["--inject-fault", a.inject_fault] if a.inject_fault else []
        return [*flags, *self.extra]

    def run(
        self,
        key: str,
        phase: str,
        options: list[str] | None = None,
        *,
        env: dict[str, str] | None = None,
        wrapper: list[str] | None = None,
        limit_s: float | None = None,
    ) -> dict[str, Any]:
        """Runs one phase as a child (under ``wrapper``, e.g. compute-sanitizer) unless the
        deadline leaves too little time; records and returns its result."""
        expected = EXPECTED_S[phase] * (0.05 if self.args.dry_run else 1.0)
        left = self.left_s()
        if left < expected / 2:
            result: dict[str, Any] = {
                "skipped": f"deadline: {left:.0f} s left, ~{expected} s needed"
            }
            log(f"== {key}: skipped ({result['skipped']})")
            self.record(key, result)
            return result
        path = self.phase_dir / f"{key}.json"
        path.unlink(missing_ok=True)
        command = [
            *(wrapper or []),
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--phase",
            phase,
            "--phase-out",
            str(path),
            *self.common(),
            *(options or []),
        ]
        log(f"== {key} ({left:.0f} s left)")
        start = time.perf_counter()
        # A session of its own, so that a timeout ends the whole tree (compute-sanitizer's
        # Python child too, which would otherwise keep the GPU).
        proc = self.child = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, **(env or {})}, start_new_session=True
        )
        rc: int | None
        try:
            rc = proc.wait(timeout=max(1.0, min(left, limit_s or left)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        self.child = None
        result = json.loads(path.read_text()) if path.exists() else {}
        result["rc"] = rc
        result["child_wall_s"] = round(time.perf_counter() - start, 1)
        if rc is None:
            result.setdefault("error", "killed at its time limit")
        elif not path.exists():
            result["fault"] = f"the phase died (exit {rc}) before writing its result"
        self.record(key, result)
        return result

    def stop(self, signum: int, frame: object) -> None:
        """SIGTERM (an outer `timeout`): end the running phase's process tree, which has a
        session of its own, then write what was measured (``drive`` catches the exit)."""
        if self.child is not None:
            os.killpg(self.child.pid, signal.SIGKILL)
        raise SystemExit(f"stopped by signal {signum}")

    def drive(self) -> int:
        previous = signal.signal(signal.SIGTERM, self.stop)
        try:
            self.drive_phases()
        except SystemExit as exc:
            self.report["stopped"] = str(exc)
            log(f"driver: {exc}; writing what was measured")
        finally:
            signal.signal(signal.SIGTERM, previous)
        return self.finish()

    def drive_phases(self) -> None:
        a = self.args
        if "build" in self.only:
            if a.skip_build:
                self.record("build", {"skipped": "--skip-build"})
            else:
                built = self.run("build", "build")
                if built.get("fallback"):
                    self.extra.append("--load-extension")
        if "preflight" in self.only:
            pre = self.run("preflight", "preflight")
            if not pre.get("register"):
                log("preflight: registration in place failed; pinned copies from here on")
                self.extra += ["--pin", "copy"]
        if "correctness" in self.only:
            correct = self.run("correctness", "correctness", ["--staging", "async"])
            if phase_failed(correct):
                log("correctness failed: again with synchronous staging (plain loads, no cp.async)")
                self.run("correctness_sync", "correctness", ["--staging", "sync"])
        if "served" in self.only:
            self.run("served", "served")
        if "h2d" in self.only:
            self.run("h2d", "h2d")
        # What the deadline cuts first comes last: the 512-byte timing (the row size the
        # compressed-vs-raw and H2D targets are judged at), then the HBM tier (its only
        # measurement), then the rest of the row sweep, the real table, the huge-page A/B, and
        # the sanitizer.
        first, *rest = TIMING_ORDER
        if "timing" in self.only:
            self.run(f"timing_{first}", "timing", ["--rows", str(first)])
        if "hbm_tier" in self.only:
            self.run("hbm_tier", "hbm_tier")
        if "timing" in self.only:
            for r in rest:
                self.run(f"timing_{r}", "timing", ["--rows", str(r)])
            self.run("timing_real", "timing", ["--rows", "0"])
            # The huge-page A/B: c10 then backs large host allocations with 2 MB pages.
            self.run(
                "timing_512_thp",
                "timing",
                ["--rows", "512", "--variant", "thp"],
                env={"THP_MEM_ALLOC_ENABLE": "1"},
            )
        if "sanitizer" in self.only:
            run_sanitizer(self)

    def finish(self) -> int:
        phases = self.report["phases"]
        rows = [row for p in phases.values() for row in p.get("results", [])]
        h2d = phases.get("h2d", {}).get("h2d_gbps")
        base = [row for row in rows if row.get("variant", "base") == "base"]
        self.report["targets"] = summarise(base, h2d)
        self.report["sort_rule"] = sort_rule(base)
        # The other rows get their GB/s columns too (the targets are the base rows').
        summarise([row for row in rows if row.get("variant", "base") != "base"], h2d)
        self.report["results"] = rows
        print_table(rows, h2d)
        log("\ntargets (measured, not asserted):" + ("" if self.report["targets"] else " none"))
        for name, result in self.report["targets"].items():
            misses = ", ".join(result["misses"])
            verdict = "met" if result["met"] else f"MISSED at {misses}"
            log(f"  {name}: {verdict if result['judged'] else 'not judged'}")
        # A correctness failure stays a failure when the sync-staging rerun passes: that rerun
        # only says where to look (cp.async or the decode).
        bad = [key for key, p in phases.items() if phase_failed(p)]
        self.report["failed_phases"] = bad
        self.save()
        shutil.rmtree(self.phase_dir, ignore_errors=True)  # the tarball holds them now
        tarball = phases_tarball(self.out).name
        log(f"\nwrote {self.out} and {tarball}; failed phases: {bad or 'none'}")
        return 1 if bad else 0


def phase_failed(result: dict[str, Any]) -> bool:
    checks = result.get("checks") or {}
    # A child's non-zero exit counts too: compute-sanitizer's --error-exitcode says so.
    return bool(
        result.get("fault")
        or result.get("error")
        or result.get("failures")
        or checks.get("failures")
        or result.get("rc") not in (None, 0)
    )


def run_phase(args: argparse.Namespace) -> int:
    """Runs one phase in this process and writes its JSON to --phase-out (also after a CUDA
    fault, with ``fault`` set); exit 0 when it passed."""
    gpu = not args.dry_run
    result: dict[str, Any] = {"phase": args.phase, "pin": args.pin}
    start = time.perf_counter()
    try:
        if args.inject_fault == args.phase:
            raise RuntimeError(f"CUDA error: illegal memory access (--inject-fault {args.phase})")
        if args.phase == "build":
            from benchmarks.gpu_check.build import phase_build

            result |= phase_build(gpu)
        else:
            result |= run_checks(args, gpu)
    except Exception as exc:
        result["fault" if is_cuda_fault(exc) else "error"] = repr(exc)[-4000:]
        log(f"phase {args.phase}: {exc!r}")
    result["wall_s"] = round(time.perf_counter() - start, 1)
    args.phase_out.parent.mkdir(parents=True, exist_ok=True)
    args.phase_out.write_text(json.dumps(result, indent=2))
    return 1 if phase_failed(result) else 0


def run_checks(args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    """Every phase but the build, with ibpembed imported (the extension loaded first when the
    build fell back to ``cpp_extension.load``)."""
    from benchmarks.gpu_check.build import load_baseline, load_extension
    from benchmarks.gpu_check.common import import_ibpembed

    if args.load_extension:
        load_extension()
    ibpembed, _ops = import_ibpembed()
    ops = _ops.ops
    dev = torch.device("cuda" if gpu else "cpu")
    if gpu and load_baseline() is not None:
        log("UVA baseline unavailable: its timings are skipped")
    if args.phase == "preflight":
        from benchmarks.gpu_check.preflight import phase_preflight

        return phase_preflight(gpu)
    if args.phase == "correctness":
        from benchmarks.gpu_check.correctness import check_correctness

        wheres = ("registered", "pinned", "device") if args.pin == "register" else ()
        with staging(args.staging):
            return check_correctness(
                ibpembed, ops, dev, tiny=args.tiny, wheres=wheres or ("pinned", "device")
            )
    if args.phase == "served":
        from benchmarks.gpu_check.served import check_served

        return check_served(dev)
    if args.phase == "h2d":
        from benchmarks.gpu_check.device import Pinned
        from benchmarks.gpu_check.h2d import h2d_bandwidth

        pinned = Pinned(gpu, args.pin)
        gbps = h2d_bandwidth(pinned, gpu)
        pinned.release()
        return {"h2d_gbps": gbps}
    if args.phase == "hbm_tier":
        from benchmarks.gpu_check.hbm_tier import phase_hbm_tier

        return phase_hbm_tier(args, gpu)
    from benchmarks.gpu_check.timing import phase_timing

    return phase_timing(ibpembed, ops, args, gpu)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import gpu_check

    parser = argparse.ArgumentParser(description=(gpu_check.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path ($OUT/gpu_check.json)")
    parser.add_argument("--table-gib", type=float, default=8.0, help="raw GiB per row size")
    parser.add_argument("--zipf", default="1.2", help="comma-separated Zipf exponents")
    parser.add_argument(
        "--profile", choices=("dlrm", "dlrm-bf16"), default="dlrm", help="values of the big tables"
    )
    parser.add_argument("--dry-run", action="store_true", help="no GPU: toy sizes, CPU only")
    parser.add_argument(
        "--deadline-s", type=float, default=480.0, help="stop starting phases past this"
    )
    parser.add_argument("--skip-build", action="store_true", help="use the extension built last")
    parser.add_argument(
        "--only",
        default=None,
        help=f"comma-separated phases to run, of {','.join(DRIVER_PHASES)} (default: all)",
    )
    # One phase in this process (what the driver runs in its children).
    parser.add_argument("--phase", choices=tuple(EXPECTED_S), help=argparse.SUPPRESS)
    parser.add_argument("--phase-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="base", help=argparse.SUPPRESS)
    parser.add_argument(
        "--staging", choices=("async", "sync"), default="async", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--pin", choices=("register", "copy"), default="register", help=argparse.SUPPRESS
    )
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load-extension", action="store_true", help=argparse.SUPPRESS)
    # Makes that phase fail as a CUDA fault does: how --dry-run reaches the fallback branches.
    parser.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    gpu = not args.dry_run
    if gpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check the script on a CPU")
    if args.phase is not None:
        if args.phase == "sanitizer":  # the tiny correctness cases, under compute-sanitizer
            args.phase, args.tiny = "correctness", True
        return run_phase(args)
    out = args.out or Path(os.environ.get("OUT", CACHE)) / "gpu_check.json"
    return Driver(args, out, gpu).drive()
