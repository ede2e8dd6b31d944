# SPDX-License-Identifier: Apache-2.0
"""gpu_check's report as BENCHMARKS.md's GPU section and headline rows (benchmarks/report.py
calls these when a gpu_check.json is among the results). Reads the JSON only: no torch."""

from __future__ import annotations

from typing import Any

HEADLINE_BATCH = 65536
COLUMNS = (
    "ibp_none",
    "ibp_line",
    "ibp_copy",
    "raw_none",
    "uva",
    "torch_uva",
    "h2d_batch",
    "cpu_h2d",
)
TARGETS = {
    "compressed_vs_raw": "compressed gather >= 0.95 x sector ratio x raw gather (>= 16k ids)",
    "line_aware_vs_raw_512": "line-aware compressed gather >= raw gather at 512 B (>= 16k ids)",
    "raw_vs_h2d": "raw gather of 512 B rows >= 60 % of pinned H2D (64k ids)",
    "pooled_vs_cpu": "pooled SUM faster than CPU index_select + H2D",
    "pooled_1k_call": "pooled call of 1k ids <= 20 us (errors deferred, wall clock)",
}


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _machine_line(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    smi = m.get("nvidia_smi") or {}
    link = (
        f"PCIe Gen{smi.get('pcie.link.gen.max', '?')} x{smi.get('pcie.link.width.max', '?')}"
        if smi
        else "PCIe link not read"
    )
    return (
        f"GPU run: **{m.get('gpu', 'no GPU')}** (driver {smi.get('driver_version', '?')}, {link}, "
        f"CUDA {m.get('cuda', '?')}, torch {m.get('torch', '?')}); host kernel "
        f"{m.get('kernel', '?')}, THP `{m.get('thp_enabled', '?')}`; {m.get('date', '?')}; "
        f"`{data.get('command', 'python -m benchmarks.gpu_check')}`."
    )


def _phase_lines(phases: dict[str, Any]) -> list[str]:
    lines = ["| phase | outcome | seconds |", "|---|---|---:|"]
    for key, p in phases.items():
        if "skipped" in p:
            outcome = f"skipped: {p['skipped']}"
        elif p.get("fault") or p.get("error"):
            outcome = f"FAILED: {str(p.get('fault') or p.get('error'))[:120]}"
        elif p.get("failures") or (p.get("checks") or {}).get("failures"):
            failures = p.get("failures") or p["checks"]["failures"]
            outcome = f"FAILED {len(failures)} checks"
        else:
            passed = p.get("passed", (p.get("checks") or {}).get("passed"))
            outcome = "passed" + (f" ({passed} checks)" if passed is not None else "")
        lines.append(f"| {key} | {outcome} | {p.get('child_wall_s', '—')} |")
    return lines


def _memory_lines(phases: dict[str, Any]) -> list[str]:
    mib = 2**20
    lines = []
    pre = phases.get("preflight", {})
    for mode in ("shared", "private"):
        m = pre.get(mode)
        if m and "anonymous_added" in m:
            lines.append(
                f"- {mode} mapping of {m['bytes'] / 2**30:.1f} GiB registered read-only: "
                f"RssAnon +{m['anonymous_added'] / mib:.1f} MiB (registration {m['register_s']} s)"
            )
    served = phases.get("served", {})
    if "anonymous_bytes_to_place" in served:
        lines.append(
            f"- served table set: RssAnon +{served['anonymous_bytes_to_place'] / mib:.1f} MiB to "
            f"place {served['payload_file_bytes'] / mib:.1f} MiB of payload"
        )
    for key, p in phases.items():
        if "anonymous_bytes_added_by_registration" in p:
            lines.append(
                f"- {key}: {p['registered_bytes'] / 2**30:.1f} GiB registered, RssAnon "
                f"+{p['anonymous_bytes_added_by_registration'] / mib:.1f} MiB"
            )
    return lines


def _results_lines(rows: list[dict[str, Any]]) -> list[str]:
    head = ["R", "batch", "ids", *COLUMNS, "bytes×", "sectors×", "ibp/raw", "line/raw", "decode"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * 2 + "---|" + "---:|" * (len(head) - 3)]
    for row in rows:
        g = row.get("raw_equiv_gbps", {})
        ids = (
            row["ids"] if row.get("variant", "base") == "base" else f"{row['variant']} {row['ids']}"
        )
        cells = [str(row["row_bytes"]), str(row["batch"]), ids]
        cells += [_fmt(g.get(c)) for c in COLUMNS]
        cells += [
            _fmt(row.get("byte_ratio"), ".3f"),
            _fmt(row.get("sector_ratio"), ".3f"),
            _fmt(row.get("ibp_vs_raw"), ".3f"),
            _fmt(row.get("line_vs_raw"), ".3f"),
            _fmt(row.get("decode_cost"), ".3f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


HBM_COLUMNS = ("ibp_tier", "ibp_none", "raw_none", "h2d_batch")


def _gbps(row: dict[str, Any], method: str) -> float | None:
    """Raw-equivalent GB/s of one method of a row: CUDA-event time, else the wall clock."""
    t = row.get("event_seconds", {}).get(method) or row.get("seconds", {}).get(method)
    return row["raw_bytes"] / t / 1e9 if t else None


def _hbm_tier_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The hbm_tier phase: per Zipf exponent, budget and form, the tier's GB/s against the raw
    zero-copy gather and the pinned H2D copy of the same bytes (the tier's target: Zipf 1.05,
    5 % of raw, >= 2x raw zero-copy and >= 1x H2D)."""
    head = ["ids", "budget", "form", "rows", "hits", *HBM_COLUMNS, "tier/raw", "tier/h2d"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|" + "---:|" * (len(head) - 3)]
    for row in rows:
        g = {c: _gbps(row, c) for c in HBM_COLUMNS}
        tier, raw, h2d = g["ibp_tier"], g["raw_none"], g["h2d_batch"]
        cells = [row["ids"], f"{row['budget']:.0%}", row["form"], str(row["tier_rows"])]
        cells += [f"{row['hit_share']:.1%}", *(_fmt(g[c]) for c in HBM_COLUMNS)]
        cells.append(_fmt(tier / raw if tier and raw else None))
        cells.append(_fmt(tier / h2d if tier and h2d else None))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def section(data: dict[str, Any]) -> str:
    """The GPU section's body: the machine and command, phases, host memory, H2D, targets, and
    the GB/s table (raw-equivalent bytes over CUDA-event time)."""
    phases = data.get("phases", {})
    lines = [_machine_line(data), "", *_phase_lines(phases), ""]
    memory = _memory_lines(phases)
    if memory:
        lines += ["Host memory the registrations added (anonymous RSS):", "", *memory, ""]
    h2d = phases.get("h2d", {}).get("h2d_gbps")
    if h2d:
        lines += [
            f"Pinned H2D copy, 1 GiB: {_fmt(h2d.get('event'), '.1f')} GB/s by CUDA events "
            f"({_fmt(h2d.get('wall'), '.1f')} by the wall clock).",
            "",
        ]
    targets = data.get("targets") or {}
    if targets:
        lines += ["| target (measured, not asserted) | verdict | misses |", "|---|---|---|"]
        for name, t in targets.items():
            verdict = ("met" if t["met"] else "missed") if t.get("judged", 1) else "not judged"
            misses = ", ".join(t["misses"][:6]) + (" …" if len(t["misses"]) > 6 else "")
            lines.append(f"| {TARGETS.get(name, name)} | {verdict} | {misses or '—'} |")
        lines.append("")
    rows = data.get("results") or []
    if rows:
        lines += [
            "GB/s of raw-equivalent bytes (n × R over each call's CUDA-event time; CPU methods by "
            "the wall clock). `decode` is ibp_none's time over ibp_copy's: the decode's cost "
            "over moving the same slots.",
            "",
            *_results_lines(rows),
            "",
        ]
    tier_rows = phases.get("hbm_tier", {}).get("hbm_tier") or []
    if tier_rows:
        lines += [
            "HBM tier (`--hbm-tier`), one 512 B table, the hottest rows of each Zipf exponent in"
            " a tier of a share of raw bytes: GB/s of raw-equivalent bytes, `hits` the share of"
            " row reads the tier served. Target: Zipf 1.05 at 5 % >= 2x raw zero-copy and"
            " >= 1x pinned H2D.",
            "",
            *_hbm_tier_lines(tier_rows),
            "",
        ]
    if data.get("failed_phases"):
        lines.append(f"Failed phases: {', '.join(data['failed_phases'])}.")
    return "\n".join(lines).strip()


def headline_rows(data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Compressed against raw zero-copy gather at 512 B x 64k uniform ids, by kernel time."""
    for row in data.get("results") or []:
        if (
            row.get("variant", "base") == "base"
            and row["row_bytes"] == 512
            and row["batch"] == HEADLINE_BATCH
            and row["ids"] == "uniform"
            and "ibp_none" in row.get("raw_equiv_gbps", {})
        ):
            g = row["raw_equiv_gbps"]
            gpu = data.get("machine", {}).get("gpu", "GPU")
            return [
                (
                    f"zero-copy GPU gather, compressed vs raw rows (512 B, 64k ids, {gpu})",
                    f"{g['ibp_none']:.1f} GB/s",
                    f"{g['raw_none']:.1f} GB/s",
                    f"{g['ibp_none'] / g['raw_none']:.2f}×",
                )
            ]
    return []
