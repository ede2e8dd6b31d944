# SPDX-License-Identifier: Apache-2.0
"""BENCHMARKS.md, rendered from the results directory alone.

The report is one setup block (machine, date, commit, command, and per section the run that
produced it), a headline table of ratios against the peers doing the same work, then one
section per question: the question, the benchmark's own tables, and a few sentences on what the
figures mean. The sentences here carry no numbers; every number comes from a results file.

Where the results live and how a benchmark adds its file and its headline rows:
benchmarks/README.md ("Committed results: the layout").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_check import markdown as gpu_markdown

Results = dict[str, dict[str, Any]]
RUN_LOG = "run.json"
# measure, ibpembed, peer, ratio: one row of the headline table (the section link is added).
HeadlineRow = tuple[str, str, str, str]
# The headline is a summary, not a second copy of the sections: a new row replaces a weaker one.
HEADLINE_ROWS = 8


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else "—"


def _codec_headline(codec: dict[str, Any]) -> list[HeadlineRow]:
    rows: list[HeadlineRow] = []
    tables = {t["name"]: t for t in codec.get("tables", [])}
    for name in ("dlrm_d128_fp32", "dlrm_d128_bf16"):
        t = tables.get(name)
        if t is None:
            continue
        bound = f"; {_pct(t['bound'])} bound" if t.get("bound") is not None else ""
        rows.append(
            (
                f"host bytes saved, {name} ({t['dtype']}, {t['source']})",
                _pct(t["ours"]),
                f"paper's fit {_pct(t['paper'])}, zstd-3 {_pct(t['zstd3'])}{bound}",
                f"{t['ratio']:.2f}× the paper's" if t.get("ratio") else "—",
            )
        )
    gather = next((g for g in codec.get("gather", []) if g["profile"] == "fp32"), None)
    rates = gather["mlookups_per_s"].get("1") if gather else None
    if rates:
        where = f"pooled SUM, fp32 table of {gather['table_gib']:.2f} GiB, 1 thread"
        # The tier's row is the hot_tier section's.
        ours = rates["ibpembed compressed"]
        if "torchrec EBC" in rates:
            peer = rates["torchrec EBC"]
            rows.append(
                (
                    f"lookups/s, compressed vs torchrec EBC ({where})",
                    f"{ours:.1f} M/s",
                    f"{peer:.1f} M/s",
                    _ratio(ours, peer),
                )
            )
    return rows


def _service_headline(service: dict[str, Any]) -> list[HeadlineRow]:
    rows: list[HeadlineRow] = []
    by = {(r["path"], r["batch"], r["load"]): r for r in service["results"]}
    health, b1 = by.get(("health", 0, "one")), by.get(("tcp_fp32", 1, "one"))
    # The benchmark's own ratio of the unrounded p50s, as its targets table shows it.
    ratio = service.get("targets", {}).get("b1_p50_vs_health_p50", {}).get("value")
    if health and b1 and ratio is not None:
        rows.append(
            (
                "round trip p50, B=1 x 26 features over gRPC vs a health check (the floor)",
                f"{b1['p50_ms']:.2f} ms",
                f"{health['p50_ms']:.2f} ms",
                f"{ratio:.2f}×",
            )
        )
    inproc, served = (
        by.get(("in_process", 512, "saturation")),
        by.get(("tcp_fp32", 512, "saturation")),
    )
    if served and inproc:
        rows.append(
            (
                "QPS at saturation, gRPC fp32 outputs vs the engine in process (B=512 x 26)",
                f"{served['qps']:.0f}",
                f"{inproc['qps']:.0f}",
                _ratio(served["qps"], inproc["qps"]),
            )
        )
    return rows


def _torchrec_headline(torchrec: dict[str, Any]) -> list[HeadlineRow]:
    by = {r["module"]: r for r in torchrec["synthetic"] if r["model"] == "full fp32"}
    ours, peer = by.get("ibpembed compressed"), by.get("torchrec EBC fp32")
    if not (ours and peer):
        return []
    return [
        (
            f"EBC forward, compressed vs torchrec fp32 (DLRM-profile fp32 tables, host bytes "
            f"{ours['bytes'] / peer['bytes']:.0%})",
            f"{ours['ms']:.2f} ms",
            f"{peer['ms']:.2f} ms",
            f"{peer['ms'] / ours['ms']:.2f}× the speed",
        )
    ]


def _tier_headline(tier: dict[str, Any]) -> list[HeadlineRow]:
    """Zipf 1.05 fp32: the largest tier whose table fits in raw rows' host bytes, against
    torchrec's EBC (what a team runs today), with its ratio to ibpembed's raw rows beside."""
    rows: list[HeadlineRow] = []
    for r in tier["results"]:
        if r["alpha"] != 1.05 or r["dtype"] != "fp32":
            continue
        rates, host = r["mlookups_per_s"], r["host_bytes"]
        raw = host["ibpembed raw rows"]
        fits = [k for k in rates if k.startswith("ibpembed compressed") and host[k] <= raw]
        if not fits:
            continue
        best = max(fits, key=lambda k: host[k])
        peer = "torchrec EBC" if "torchrec EBC" in rates else "ibpembed raw rows"
        vs_raw = rates[best] / rates["ibpembed raw rows"]
        rows.append(
            (
                f"lookups/s, {best.removeprefix('ibpembed ')} vs {peer.removeprefix('ibpembed ')} "
                f"(Zipf 1.05, fp32, host bytes {host[best] / raw:.0%} of raw rows'; "
                f"{vs_raw:.2f}× ibpembed's raw rows)",
                f"{rates[best]:.1f} M/s",
                f"{rates[peer]:.1f} M/s",
                _ratio(rates[best], rates[peer]),
            )
        )
    return rows


@dataclass(frozen=True)
class Section:
    name: str  # benchmarks.<name> writes <name>.json and <name>.md
    title: str
    question: str
    meaning: str
    args: tuple[str, ...] | None  # full run; None: measured on another machine
    quick_args: tuple[str, ...] = ("--quick",)
    # The section's rows in the headline table, from its results file.
    headline: Callable[[dict[str, Any]], list[HeadlineRow]] | None = None
    # The headline's measure while the section has no results (a GPU-only section, say).
    unmeasured: str | None = None


SECTIONS = (
    Section(
        "codec",
        "Codec: savings, decode, pooled lookups",
        "How much host memory does IBP save on realistic tables, against the paper's fit, "
        "general-purpose compressors and the entropy bound, and what does a CPU lookup of "
        "compressed rows cost against raw rows, torchrec, `F.embedding_bag` and fbgemm?",
        "Savings on dense fp32 tables sit close to the exponent-entropy bound: fp32 mantissas are "
        "noise, so only sign and exponent bits compress, and bf16 or bf16-rounded tables save "
        "far more. On a CPU a compressed fp32 lookup cannot beat raw rows: a compressed slot "
        "spans about as many 64-byte lines as the raw row, so the lookup reads no fewer lines "
        "and decodes on top ([why](docs/notes/2026-11-30-compressed-fp32-vs-raw-rows.md)); "
        "a decoded tier of the hot rows closes part of the gap. The PCIe table is where "
        "compression pays: a GPU gather reads 32-byte sectors, and fewer of them.",
        (),
        headline=_codec_headline,
    ),
    Section(
        "cpu_engine",
        "The lookup engine against an fbgemm-style loop",
        "Without torch and Python in the way, how close is the lookup engine to the loop "
        "torchrec's CPU forward runs, on raw and on compressed rows?",
        "The three loops run in one process on the same huge-page rows and ids, round by round, "
        "and must agree bit for bit. Raw rows are read as ibpembed reads an all-raw table: its "
        "payload is a tier of every row, pooled on the lean path without the index; compressed "
        "rows go through the index and the decoder.",
        (),
        ("--gib", "0.05", "--rounds", "1", "--reps", "1", "--batches", "2"),
    ),
    Section(
        "engine_paths",
        "Engine paths: decode-once vs fused, with and without a decoded tier",
        "Which kernel path should a request take, and does the engine's rule pick the faster?",
        "The engine decodes repeated ids once only where a request repeats enough of them; "
        "otherwise the fused gather-and-pool kernel wins. Hot-row copies help when the hot set "
        "is read often enough to stay in cache.",
        (),
    ),
    Section(
        "hot_tier",
        "Hot tier: lookups/s against host bytes",
        "With a decoded tier of the most looked-up rows, sized in bytes, how fast are compressed "
        "lookups against raw rows, torchrec, `F.embedding_bag` and fbgemm, and for how many "
        "host bytes?",
        "Tier rows and raw rows take the lean path: a pre-pass resolves each id to its tier row "
        "through a rank directory, and those rows are pooled in one loop that prefetches a fixed "
        "distance ahead; only the misses go through the index and the decoder. Under Zipf "
        "traffic a tier of a few percent of the raw bytes serves most lookups, and the misses, "
        "decoded from DRAM, take about half of the time: a cold 512-byte fp32 row costs about "
        "110 ns for its index and the copy of its slot into an L1 stage, then about 90 ns to "
        "decode, one after the other ([why](docs/notes/2026-12-02-cold-rows-staged.md)). So a "
        "10 % tier with 88 % hits runs at about hits-at-raw-speed plus "
        "misses-at-the-uniform-compressed-rate; under uniform ids only a tier of every row "
        "helps ([the lean path](docs/codec.md#the-decoded-tier)). These ratios depend on the "
        "host's memory: where DRAM keeps up with raw rows, the decode is the whole cost of a "
        "compressed lookup and every ratio to raw rows is lower ([on a host with fast memory]"
        "(docs/notes/2026-12-02-fast-memory-host.md)). "
        "A tier's host bytes include the policy's own state (its id buffer, sketch and target "
        "sets, 32-80 bytes per tier row), which the budget pays for. The policy's hit ratios "
        "sit within about 3 points of the exact top rows of the same number at 1 % and 2 "
        "points from 5 % up: its count-min sketch is halved every 30 tier rows' worth of "
        "ids, and with TinyLFU's usual 10 the same tiers served 2-3 points fewer lookups "
        "(`engine/tier.py`). A savings-sized bf16 tier (24 % of the raw bytes) serves more "
        "than a 10 % one and runs no faster.",
        (),
        headline=_tier_headline,
    ),
    Section(
        "tables",
        "Table files: pack and load",
        "How long do tables take to pack and to load, against `torch.load` of the same weights?",
        "A table file is mapped, not read: loading costs a header check and an index, and the "
        "first lookup pays the page faults that `torch.load` pays up front.",
        (),
        ("--gib", "0.01", "--tables", "2", "--repeats", "1"),
    ),
    Section(
        "service",
        "Service: gRPC against the engine in-process",
        "What does the serving layer cost against calling the engine in the same process: one "
        "request at a time and at saturation, over TCP with fp32 and bf16 outputs and over "
        "same-host shared memory?",
        "At B=1 the floor is grpc.aio itself (the health check); a lookup adds the decode, one "
        "kernel call for every table and the encode, run on the event loop for small requests. "
        "At large batches the response's bytes dominate: bf16 outputs halve them and shared "
        "memory takes them off the socket, but the server still copies them into the region, "
        "and on this machine the client shares the server's two cores, so the wall-clock ratios "
        "understate a server on its own cores (the CPU column is the better estimate; "
        "[where the time goes](docs/serving.md)).",
        (),
        headline=_service_headline,
    ),
    Section(
        "sharding",
        "Sharding: row shards against one server",
        "What does splitting each table's rows over several servers cost a client?",
        "On one shared machine shards compete for the same cores, so this measures the "
        "client's split and merge and the extra round trips, not what separate hosts would add.",
        (),
    ),
    Section(
        "metrics_overhead",
        "Metrics overhead",
        "What do Prometheus metrics cost a serving process?",
        "Servers with metrics on and off alternate in rounds on the same load; the hook "
        "estimate is the metrics code's own cost per request, timed in process.",
        (),
    ),
    Section(
        "torchrec_module",
        "torchrec: the compressed EBC against torchrec's EBCs",
        "Swapped into a torchrec model, how fast and how exact is the compressed "
        "`EmbeddingBagCollection` against torchrec's fp32 and INT8 EBCs?",
        "The compressed EBC is lossless (rows bit-exact, sums within fp32 rounding of the "
        "same order), INT8 is not; its forward is slower than torchrec's fp32 EBC on a CPU for "
        "the reason the codec section gives.",
        (),
        headline=_torchrec_headline,
    ),
    Section(
        "integrations",
        "Triton and a remote torchrec EBC",
        "Served through Triton's Python backend, or looked up from a torchrec model through "
        "`RemoteEmbeddingBagCollection`, what does a lookup cost against `ibpembed serve` and "
        "against the same tables in process?",
        "Every path answers the same requests with the same bits before it is timed, one "
        "request at a time. Triton adds its HTTP front end and a process hop to the Python "
        "backend stub (the ensemble trap: embeddings moving between processes); the remote EBC "
        "adds one gRPC round trip per forward to the in-process module.",
        (),
    ),
    Section(
        "gpu_check",
        "GPU: zero-copy gather over PCIe",
        "On a GPU, how fast is the zero-copy gather of compressed rows against raw rows, "
        "`index_select` + copy and the pinned H2D bandwidth?",
        "Measured only on a GPU machine by `scripts/gpu_run.sh` (`python -m benchmarks.gpu_check`; "
        "docs/cuda.md); its gpu_check.json is rendered here when one is among the results.",
        None,
        headline=gpu_markdown.headline_rows,
        unmeasured="zero-copy GPU gather, compressed vs raw rows",
    ),
)


def load(out: Path) -> tuple[Results, dict[str, str]]:
    """Every section's JSON and Markdown found in ``out``."""
    results: Results = {}
    markdown: dict[str, str] = {}
    for section in SECTIONS:
        data, text = out / f"{section.name}.json", out / f"{section.name}.md"
        if data.is_file():
            results[section.name] = json.loads(data.read_text())
        if text.is_file():
            markdown[section.name] = text.read_text()
    return results, markdown


# -- the headline table -------------------------------------------------------------------------
def headline_rows(results: Results) -> list[list[str]]:
    """Every section's headline rows, in section order, each with its section's link."""
    rows = []
    for section in SECTIONS:
        data = results.get(section.name)
        if data is not None and section.headline is not None:
            made = section.headline(data)
        elif data is None and section.unmeasured is not None:
            made = [(section.unmeasured, "not measured", "", "")]
        else:
            made = []
        rows += [[*row, f"[{section.name}](#{section.name})"] for row in made]
    return rows


def _headline(results: Results) -> list[str]:
    lines = [
        "| measure | ibpembed | peer | ratio | section |",
        "|---|---:|---:|---:|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in headline_rows(results)]
    return lines


# -- sections -----------------------------------------------------------------------------------
# A benchmark's own first line names when and at which commit it ran: the setup block says that
# once for the report, so the sections carry only what they measured and how.
_RUN_STAMP = re.compile(
    r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(?::\d{2})?(?:\+00:00| UTC|Z)?(?:, )?"
    r"|commit [0-9a-f]{7,}(?:\+dirty)?(?:, )?"
)


def _body(markdown: str) -> str:
    """A benchmark's own Markdown, its headings nested under the section's, without run stamps."""
    markdown = _RUN_STAMP.sub("", markdown).replace("()", "")
    lines = []
    for line in markdown.strip().splitlines():
        if line.startswith("## "):
            continue
        if line.startswith("#"):
            line = "#" + line
        lines.append(line)
    body = "\n".join(lines).strip()
    first, _, rest = body.partition("\n\n")
    if first.startswith("Machine:"):  # said once, in the setup block
        body = rest.strip()
    return body


def _day(stamp: str) -> str:
    """A run's date without its time of day (the report states figures, not a run log)."""
    return stamp[:10] if len(stamp) > 10 and stamp[4] == "-" and stamp[7] == "-" else stamp


def _setup(log: dict[str, Any], results: Results) -> list[str]:
    run = log.get("_run", {})
    lines = [
        f"- **Machine**: {run.get('machine', 'unknown')}; Python {run.get('python', '?')}, "
        f"torch {run.get('torch', '?')}.",
        f"- **Date**: {_day(run.get('date', 'unknown'))}; **commit** `{run.get('commit', '?')}`; "
        f"**command** `{run.get('command', 'python -m benchmarks')}`.",
        *([f"- **Results files**: {run['note']}"] if run.get("note") else []),
        "- Ratios are measured side by side in one process or one run: absolute numbers on a "
        "shared machine drift between runs, ratios much less.",
        "",
        "| section | command | commit, date | load average |",
        "|---|---|---|---:|",
    ]
    for section in SECTIONS:
        data = results.get(section.name)
        if data is None:
            continue
        entry = log.get(section.name, {})
        command = data.get("command", f"python -m benchmarks.{section.name}").strip()
        load = data.get("load_average")
        if isinstance(load, list):
            load = max(load)
        load_text = f"{load:.1f}" if isinstance(load, (int, float)) else "—"
        quick = " (quick: not results)" if entry.get("quick") else ""
        # A section rerun alone, or measured on another machine, says so on its own row.
        machine = data.get("machine")
        if machine and run.get("machine") and machine != run["machine"]:
            quick += f" on {machine}"
        when = ", ".join(
            _day(str(data[key])) for key in ("commit", "revision", "date") if data.get(key)
        )
        lines.append(
            f"| [{section.name}](#{section.name}) | `{command}`{quick} | {when or '—'} | "
            f"{load_text} |"
        )
    return lines


def read_log(out: Path) -> dict[str, Any]:
    """The runner's log in ``out``: the last run's metadata and each section's exit and time."""
    path = out / RUN_LOG
    return json.loads(path.read_text()) if path.is_file() else {}


def render(out: Path, log: dict[str, Any] | None = None) -> str:
    """The report for the results in ``out`` (and the runner's log there, unless given)."""
    log = read_log(out) if log is None else log
    results, markdown = load(out)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks` from the results it wrote to benchmarks/results/ "
        "(committed; a test checks this page against them): do not edit by hand. How each "
        "benchmark works and what it prints: [benchmarks/README.md](benchmarks/README.md). "
        "Known misses and limits: "
        "[docs/known-issues.md](docs/known-issues.md).",
        "",
        "## Setup",
        "",
        *_setup(log, results),
        "",
        "## Headline",
        "",
        *_headline(results),
        "",
    ]
    for section in SECTIONS:
        lines += [f'<a id="{section.name}"></a>', "", f"## {section.title}", ""]
        lines += [f"*{section.question}*", ""]
        if section.name in markdown:
            lines += [_body(markdown[section.name]), ""]
        elif section.name == "gpu_check" and section.name in results:
            lines += [gpu_markdown.section(results[section.name]), ""]
        else:
            run = "`python -m benchmarks.gpu_check` on a GPU" if section.args is None else (
                f"`python -m benchmarks --only {section.name}`"
            )  # fmt: skip
            lines += [f"Not measured in this run ({run} produces it).", ""]
        lines += [section.meaning, ""]
    return "\n".join(lines).rstrip() + "\n"
