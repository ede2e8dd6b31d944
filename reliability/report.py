# SPDX-License-Identifier: Apache-2.0
"""reliability/README.md's *Current figures*, rendered from the committed campaign results.

Each campaign's results file, ``reliability/results/<name>.json``, is the report the campaign
writes with ``--json`` plus a ``"run"`` record (machine, commit, date, seconds, exit code) that
``python -m reliability`` adds. The table between the README's two markers is rendered from
those files alone; ``reliability/tests/test_report.py`` checks that the committed README equals
a render of the committed results.

To add a campaign: a :class:`Campaign` in ``CAMPAIGNS`` (its documented arguments, and a
function from its report to the table's *cases* and *result* cells), then
``python -m reliability --only <name>`` writes its results file and re-renders the table.
Importing this module needs no torch: rendering runs anywhere.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
README = ROOT / "README.md"
BEGIN = "<!-- current figures: rendered by `python -m reliability` from reliability/results/ -->"
END = "<!-- end of current figures -->"

Report = dict[str, Any]


def _failures(report: Report) -> int:
    return len(report.get("failures", []))


def _codec_cells(r: Report) -> tuple[str, str]:
    return (
        f"{r['cases']:,} tables, {r['rows'] / 1e6:.1f} M rows",
        f"{r['mismatches']} mismatches",
    )


def _cuda_cells(r: Report) -> tuple[str, str]:
    return (
        f"{r['cases']:,} tables: {r['rows_gathered']:,} rows gathered, "
        f"{r['rows_decompressed']:,} decompressed, {r['bags_pooled']:,} bags "
        f"({r['ids_pooled']:,} ids) pooled",
        f"{_failures(r)} failures (mismatches, error words, emulator stops)",
    )


def _rpc_cells(r: Report) -> tuple[str, str]:
    v = r["verdict"]
    seen = sorted({f"{u['category']} → {u['code']}" for u in r.get("unexpected", [])})
    which = f" ({', '.join(seen)})" if seen else ""
    return (
        f"{r['cases']:,} calls and streams",
        f"{v['unexpected']} replies outside the allowed codes{which}; "
        f"RSS {v['rss_growth']:+.1%}; "
        f"descriptors {v['fds_after_warmup']} → {v['fds_end']}",
    )


def _soak_cells(r: Report) -> tuple[str, str]:
    v = r["verdict"]
    calls = v["requests_ok"] + sum(v["errors"].values())
    codes = ", ".join(sorted(v["errors"])) or "nothing"
    unexpected = sum(v["unexpected_errors"].values())
    return (
        f"{r['settings']['duration']:.0f} s in {len(r['windows'])} windows, {calls:,} calls",
        f"{'only ' + codes + ' besides OK' if not unexpected else f'{unexpected} unexpected'}; "
        f"RSS {v['rss_growth']:+.1%}; descriptors {v['fds_idle_before']} → "
        f"{v['fds_idle_after']}; p99 last/first {v['p99_ratio']:.2f}×",
    )


def _faults_cells(r: Report) -> tuple[str, str]:
    live = r["reload_under_load"]
    parts = [
        f"{r['kill_pack']['trials']} pack kills",
        f"{r['kill_reload']['trials']} reload kills",
        f"{live['versions_published']} live publications ({live['corrupt_sets_published']} "
        "corrupt)",
        f"{r['sigterm_under_load']['trials']} SIGTERMs",
        f"{r['vanishing_client']['clients_killed']} vanishing clients",
        f"{len(r['disk_full']['runs'])} disk limits",
    ]
    faults = [v for v in r.values() if isinstance(v, dict) and "failures" in v]
    failed = sum(_failures(v) for v in faults)
    return (
        f"{len(faults)} faults: " + ", ".join(parts),
        "all handled" if not failed else f"{failed} failures",
    )


def _security_cells(r: Report) -> tuple[str, str]:
    wrong = [name for name in r["tokens"] if name != "right token"]
    methods = len(r["tokens"]["right token"])
    cases = (
        f"{len(wrong)} wrong authorizations × {methods} methods, TLS, mTLS, probes, reflection,"
        " logs"
    )
    result = "all as documented" if not _failures(r) else f"{_failures(r)} failures"
    if "request_sizes" in r:  # the isolation and overload probes
        cases += (
            "; another process's shm (with and without auth), region quotas, 8 stalled streams,"
            " 16 refused 60 MiB requests, a million features, a truncated table file (polled,"
            " and racing lookups unpolled), a deep manifest, int64 counts, an oversize input region"
        )
        fresh = r["stalled_streams"]["fresh client lookups (20)"].get("OK", 0)
        before, peak = r["request_sizes"]["RSS before / peak over 16 refused 60 MiB requests, MiB"]
        result += (
            f"; a fresh client {fresh}/20 OK beside the stalled streams; RSS {before} → {peak} MiB"
            " over the refused requests"
        )
    return cases, result


@dataclass(frozen=True)
class Campaign:
    name: str  # reliability.<name>, results/<name>.json
    title: str  # the README section it links to
    args: tuple[str, ...]  # the documented run
    cells: Callable[[Report], tuple[str, str]]  # its report -> (cases, result)

    @property
    def command(self) -> str:
        return " ".join(["python -m reliability." + self.name, *self.args])

    @property
    def anchor(self) -> str:
        return re.sub(r"[^a-z0-9 -]", "", self.title.lower()).replace(" ", "-")


CAMPAIGNS = (
    Campaign("fuzz_codec", "Codec fuzz", ("--cases", "1000000", "--jobs", "2", "--seed", "23"),
             _codec_cells),
    Campaign("fuzz_cuda_kernels", "CUDA kernel fuzz (emulated)",
             ("--seconds", "600", "--seed", "1"), _cuda_cells),
    Campaign("fuzz_rpc", "RPC fuzz", ("--cases", "50000", "--seed", "17"), _rpc_cells),
    Campaign("soak", "Soak", (), _soak_cells),
    Campaign("faults", "Faults", ("--trials", "10"), _faults_cells),
    Campaign("security", "Security", (), _security_cells),
)  # fmt: skip


def load(results: Path = RESULTS) -> dict[str, Report]:
    """Every campaign's committed results file found in ``results``."""
    found = {}
    for campaign in CAMPAIGNS:
        path = results / f"{campaign.name}.json"
        if path.is_file():
            found[campaign.name] = json.loads(path.read_text())
    return found


def render_table(results: Path = RESULTS) -> str:
    """The *Current figures* block: one row per campaign, and where each row's run came from."""
    reports = load(results)
    lines = [
        "| campaign | command | cases | result | machine, commit, date |",
        "|---|---|---|---|---|",
    ]
    for c in CAMPAIGNS:
        link = f"[{c.title}](#{c.anchor})"
        report = reports.get(c.name)
        if report is None:
            lines.append(f"| {link} | `{c.command}` | not run | `python -m reliability --only "
                         f"{c.name}` produces it | |")  # fmt: skip
            continue
        run = report.get("run", {})
        # What ran, as the campaign recorded it (without where its report was written).
        command = re.sub(r" --json \S+", "", report.get("command", c.command))
        cases, result = c.cells(report)
        if run.get("exit_code", 0) != 0:
            result += f" (exit code {run['exit_code']})"
        where = ", ".join(str(run[k]) for k in ("machine", "commit", "date") if run.get(k))
        lines.append(f"| {link} | `{command}` | {cases} | {result} | {where or '—'} |")
    return "\n".join(lines)


def render_readme(text: str, results: Path = RESULTS) -> str:
    """``text`` (the README) with the block between the markers rendered anew."""
    head, found, rest = text.partition(BEGIN)
    if not found or END not in rest:
        raise ValueError(f"reliability/README.md has no {BEGIN!r} ... {END!r} block")
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{render_table(results)}\n\n{END}{tail}"
