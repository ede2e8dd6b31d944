# SPDX-License-Identifier: Apache-2.0
"""Run the campaigns at their documented sizes, then render README.md's *Current figures*.

    python -m reliability                     # every campaign (make reliability), then the table
    python -m reliability --only fuzz_rpc     # some; the others keep their committed results
    python -m reliability --render-only       # the table from the results already committed

Each campaign runs in its own process with ``--json``; its report, plus a ``"run"`` record of
where and when, becomes ``reliability/results/<name>.json`` (committed). A failing campaign
keeps its results file (its failures are in it) and makes this command exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reliability.report import CAMPAIGNS, README, RESULTS, render_readme

REPO = Path(__file__).resolve().parent.parent


def _machine() -> str:
    model = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        model = names[0] if names else model
    return f"{model}, {os.cpu_count()} CPUs"


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()  # fmt: skip

    try:
        # A run's own results and the README it renders do not make the code dirty.
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                    ":(exclude)reliability/results", ":(exclude)reliability/README.md")  # fmt: skip
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_campaign(name: str, args: Sequence[str], out: Path) -> dict[str, Any]:
    """``python -m reliability.<name> ARGS --json ...``; its report with a ``run`` record."""
    print(f"== python -m reliability.{name} {' '.join(args)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        start = time.monotonic()
        code = subprocess.run(
            [sys.executable, "-m", f"reliability.{name}", *args, "--json", str(report_path)],
            cwd=REPO,
            check=False,
        ).returncode
        seconds = time.monotonic() - start
        report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    # The campaign's own command names the temporary report path: the documented one is kept.
    report["command"] = " ".join([f"python -m reliability.{name}", *args])
    report["run"] = {
        "machine": _machine(),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "seconds": round(seconds, 1),
        "exit_code": code,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CAMPAIGNS], default=None)
    parser.add_argument("--render-only", action="store_true", help="render, run nothing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--readme", type=Path, default=README, help="README to render into")
    args = parser.parse_args(argv)
    failed = []
    if not args.render_only:
        for campaign in CAMPAIGNS:
            if args.only is None or campaign.name in args.only:
                report = run_campaign(campaign.name, campaign.args, args.out)
                if report["run"]["exit_code"] != 0:
                    failed.append(campaign.name)
    args.readme.write_text(render_readme(args.readme.read_text(), args.out))
    print(f"wrote {args.readme}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
