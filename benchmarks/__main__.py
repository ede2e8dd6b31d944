# SPDX-License-Identifier: Apache-2.0
"""Run every benchmark, then render BENCHMARKS.md from the results they wrote.

    python -m benchmarks                      # everything, full sizes (about 20 min on 2 cores)
    python -m benchmarks --quick              # smoke sizes (about 4 min), to benchmarks/.cache/
    python -m benchmarks --only codec tables  # some benchmarks; the others keep their last results
    python -m benchmarks --render-only        # BENCHMARKS.md from the results already on disk

Each benchmark runs in its own process (a crash or an out-of-memory kill loses one section, not
the run) and writes ``<name>.json`` + ``<name>.md`` into the results directory
(benchmarks/results/ by default, committed); the report is rendered from those files alone.
The layout, and how a benchmark adds its files: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks._harness import QUICK_RESULTS, REPO, RESULTS, run_metadata
from benchmarks.report import RUN_LOG, SECTIONS, read_log, render

REPORT = REPO / "BENCHMARKS.md"


def run_one(name: str, args: Sequence[str], out: Path) -> dict:
    """``python -m benchmarks.<name> ... --out OUT``; its exit code and wall time."""
    # The default results directory goes unsaid, so each section's command reads as typed.
    where = [] if out.resolve() == RESULTS.resolve() else ["--out", str(out)]
    argv = [sys.executable, "-m", f"benchmarks.{name}", *args, *where]
    print(f"== {' '.join(argv[1:])}", flush=True)
    start = time.monotonic()
    code = subprocess.run(argv, cwd=REPO, check=False).returncode
    return {"exit_code": code, "seconds": round(time.monotonic() - start, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke sizes (not results)")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in SECTIONS], default=None)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"results directory (default {RESULTS.relative_to(REPO)}/, committed; "
        f"with --quick {QUICK_RESULTS.relative_to(REPO)}/)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        help="Markdown file to write (default BENCHMARKS.md; with --quick, in --out)",
    )
    parser.add_argument("--render-only", action="store_true", help="render, run nothing")
    args = parser.parse_args(argv)
    # Smoke sizes are not results: they never overwrite the committed ones or the page.
    if args.out is None:
        args.out = QUICK_RESULTS if args.quick else RESULTS
    if args.report is None:
        args.report = args.out / "BENCHMARKS.md" if args.quick else REPORT
    args.out.mkdir(parents=True, exist_ok=True)
    log = read_log(args.out)
    failed = []
    if not args.render_only:
        for section in SECTIONS:
            if args.only is not None and section.name not in args.only:
                continue
            if section.args is None:  # measured elsewhere (a GPU machine); rendered if present
                continue
            outcome = run_one(section.name, section.quick_args if args.quick else section.args,
                              args.out)  # fmt: skip
            log[section.name] = {**outcome, "quick": args.quick}
            if outcome["exit_code"] != 0:
                failed.append(section.name)
        given = sys.argv[1:] if argv is None else list(argv)
        log["_run"] = run_metadata(" ".join(["python -m benchmarks", *given]))
        (args.out / RUN_LOG).write_text(json.dumps(log, indent=2) + "\n")
    args.report.write_text(render(args.out, log))
    print(f"wrote {args.report}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
