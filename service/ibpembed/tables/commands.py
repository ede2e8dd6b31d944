# SPDX-License-Identifier: Apache-2.0
"""What ``ibpembed pack | inspect | verify`` do, once :mod:`ibpembed.tables.cli` has parsed
their flags (exit codes: see there)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ibpembed.codec import FitOptions
from ibpembed.layout import DTYPE_CODES, INT8_ROWWISE_CODE
from ibpembed.tables import format as tf
from ibpembed.tables import importers, manifest, pack
from ibpembed.tables import writer as tw
from ibpembed.tables.shards import pack_shards, shard_addresses
from ibpembed.tables.tier_budget import TableSize, TierBudget

EXIT_OK = 0
EXIT_FAULT = 1
EXIT_USAGE = 2


def _message(error: Exception) -> str:
    """An error in one line; an OSError as ``<file>: <reason>``, without Python's ``[Errno N]``
    and quotes."""
    if not isinstance(error, OSError) or not error.strerror:
        return str(error)
    reason = error.strerror[:1].lower() + error.strerror[1:]
    if error.filename is None:
        return reason
    names = error.filename if error.filename2 is None else f"{error.filename} -> {error.filename2}"
    return f"{names}: {reason}"


def _fail(command: str, error: Exception) -> int:
    print(f"ibpembed {command}: error: {_message(error)}", file=sys.stderr)
    return EXIT_FAULT


def _usage(command: str, message: str) -> int:
    """A usage error argparse cannot see (it spans flags): argparse's message and status."""
    print(f"ibpembed {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


# -- pack ------------------------------------------------------------------------------------


def _progress_factory(enabled: bool) -> Callable[[importers.TableSource], Callable[[int], None]]:
    def make(source: importers.TableSource) -> Callable[[int], None]:
        bar = tqdm(
            total=source.weight.shape[0],
            desc=source.name,
            unit="row",
            unit_scale=True,
            disable=not enabled,
            leave=False,
            file=sys.stderr,
        )

        def step(rows: int) -> None:
            bar.update(rows)
            if bar.n >= bar.total:
                bar.close()

        return step

    return make


def _report_row(p: tw.PackedTable) -> dict[str, Any]:
    return {
        "table": p.name,
        "rows": p.num_rows,
        "dim": p.dim,
        "dtype": p.quant or p.dtype,
        "chunk_bits": p.chunk_bits,
        "code_bits": p.code_bits,
        "raw_bytes": p.raw_bytes,
        "stored_bytes": p.stored_bytes,
        "savings": round(p.savings, 4),
        "seconds": round(p.seconds, 3),
        "file": p.path.name,
    }


def _print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    for row in [list(columns), *cells]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _pack_usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``pack``'s flags taken together, checked before any source is read
    or any shard written; None when nothing is."""
    if args.shards is None and args.shard_address is not None:
        return "argument --shard-address: needs --shards"
    if args.shards is not None and args.shard_address is not None:
        try:
            shard_addresses(args.shard_address, args.shards)
        except ValueError as exc:
            return f"argument --shard-address: {exc}"
    if args.method in ("paper", "raw") and args.code_bits not in (None, 1):
        return (
            f"argument --code-bits: method '{args.method}' has no codebooks "
            f"(it takes --code-bits 1 only), got {args.code_bits}"
        )
    tables = args.table or []
    for name in tables:
        if tables.count(name) > 1:
            return f"argument --table: table '{name}' is named twice"
    mapped: dict[str, str] = {}
    for feature, table in args.feature:
        if mapped.setdefault(feature, table) != table:
            return (
                f"argument --feature: feature '{feature}' is mapped to both "
                f"'{mapped[feature]}' and '{table}'"
            )
    return None


def run_pack(args: argparse.Namespace) -> int:
    usage_error = _pack_usage_error(args)
    if usage_error is not None:
        return _usage("pack", usage_error)
    try:
        # The selection applies first: other entries of a checkpoint are never checked.
        table_set = importers.load_sources(args.sources, tables=args.table)
        extra = dict(args.feature)
        if extra:
            table_set = importers.TableSet(table_set.tables, extra)
        pack_args: dict[str, Any] = {
            "fit": FitOptions(
                method=args.method,
                sample_rows=args.sample_rows or None,
                seed=args.seed,
                align=args.align,
                chunk_bits=args.chunk_bits,
                code_bits=args.code_bits,
            ),
            "progress": _progress_factory(not args.no_progress),
            "merge": args.merge,
            "for_gpu": args.for_gpu,
        }
        # (shard index or None for an unsharded set, the tables written)
        shards: list[tuple[int | None, list[tw.PackedTable]]]
        if args.shards is None:
            shards = [(None, pack.pack_table_set(args.output, table_set, **pack_args))]
        else:
            written = pack_shards(
                args.output,
                table_set,
                args.shards,
                address_template=args.shard_address,
                **pack_args,
            )
            shards = [(r.index, r.tables) for r in written]
    except (ValueError, OSError) as exc:  # SourceError, TableSetError, TableFileError are these
        return _fail("pack", exc)
    rows = [
        _report_row(p) if k is None else {"shard": k, **_report_row(p)}
        for k, reports in shards
        for p in reports
    ]
    if args.json:
        print(json.dumps({"output": str(args.output), "tables": rows}, indent=1))
    else:
        for row in rows:
            row["savings"] = f"{100 * row['savings']:.1f}%"
            row["seconds"] = f"{row['seconds']:.2f}"
        columns = ("table", "rows", "dim", "dtype", "chunk_bits", "code_bits", "savings", "seconds")
        _print_table(rows, columns if args.shards is None else ("shard", *columns))
        if args.shards is None:
            print(f"wrote {len(rows)} table(s) to {args.output}")
        else:
            print(f"wrote {len(rows)} table file(s) in {args.shards} shards to {args.output}")
    return EXIT_OK


# -- inspect ---------------------------------------------------------------------------------


def describe_file(path: Path) -> dict[str, Any]:
    """Header, sections and metadata of a table file, read without decoding a row: every
    checksum but the payload's is checked (hashing the payload reads every byte: verify's job),
    and the meta section must be a JSON object with a name (and a well-formed ``gpu_layout``,
    whose reason is printed)."""
    return _description(tf.read_layout(path))


def _description(layout: tf.FileLayout) -> dict[str, Any]:
    header, meta = layout.header, layout.meta
    gpu = meta.get("gpu_layout")
    if gpu is not None and not (isinstance(gpu, dict) and isinstance(gpu.get("reason"), str)):
        raise tf.TableFileError(
            layout.path, "meta", f"'gpu_layout' must be an object with a 'reason', got {gpu!r}"
        )
    return {
        "file": str(layout.path),
        "header": {
            **vars(header),
            "sections_xxh3": f"{header.sections_xxh3:016x}",
            "header_xxh3": f"{header.header_xxh3:016x}",
        },
        "sections": [
            {"kind": s.kind.label, "offset": s.offset, "length": s.length, "xxh3": f"{s.xxh3:016x}"}
            for s in layout.sections
        ],
        "meta": dict(meta),
    }


def _describe_set(directory: Path, found: manifest.Manifest) -> list[dict[str, Any]]:
    """Every table file of a set, each checked against its manifest entry as a load checks it
    (header checksum, name, shape, dtype, row range)."""
    descriptions = []
    for name, entry in found.tables.items():
        layout = tf.read_layout(_set_file(directory, name, entry))
        manifest.check_entry(directory / manifest.MANIFEST, name, entry, layout)
        descriptions.append(_description(layout))
    return descriptions


def _set_file(directory: Path, name: str, entry: manifest.ManifestEntry) -> Path:
    """The file of a set's table; a missing one is named as a load names it."""
    path = directory / entry.file
    if not path.is_file():
        raise manifest.TableSetError(
            f"{directory / manifest.MANIFEST}: table '{name}': file {path} is missing"
        )
    return path


def _dtype_label(code: int) -> str:
    """A header's dtype code as reports name it: the dtype, or ``int8_rowwise``."""
    by_code = {c: d for d, c in DTYPE_CODES.items()}
    return "int8_rowwise" if code == INT8_ROWWISE_CODE else tf.dtype_name(by_code[code])


def summarize(desc: dict[str, Any]) -> dict[str, Any]:
    """One table's size line for ``inspect``: rows, dtype name, raw bytes (rows x row bytes),
    stored bytes (every section but the metadata: what a server holds) and the savings."""
    header = desc["header"]
    raw = header["num_rows"] * header["row_bytes"]
    stored = sum(s["length"] for s in desc["sections"] if s["kind"] != "meta")
    return {
        "table": desc["meta"]["name"],
        "rows": header["num_rows"],
        "dim": header["dim"],
        "dtype": _dtype_label(header["dtype_code"]),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "savings": 1 - stored / raw,
    }


def _add_tier(summaries: list[dict[str, Any]], budget: TierBudget) -> None:
    """Each table's hot tier under ``budget`` as the server's policy spends it (``tier_bytes``
    of decoded rows, ``policy_bytes`` of admission state) and its savings net of both."""
    from ibpembed.engine.tier import policy_state_bytes  # the engine's torch import, only here

    sizes = {
        s["table"]: TableSize(s["rows"], s["raw_bytes"] // max(s["rows"], 1), s["stored_bytes"])
        for s in summaries
    }
    plans = budget.plan(sizes, policy_state_bytes)
    for s in summaries:
        plan = plans[s["table"]]
        s["tier_bytes"], s["policy_bytes"] = plan.bytes, plan.state_bytes
        held = s["stored_bytes"] + plan.total_bytes
        s["net_savings"] = 1 - held / s["raw_bytes"] if s["raw_bytes"] else 0.0


def _summary_rows(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-table lines and a total, formatted for :func:`_print_table`."""
    raw = sum(s["raw_bytes"] for s in summaries)
    stored = sum(s["stored_bytes"] for s in summaries)
    total = {
        "table": "total",
        "rows": sum(s["rows"] for s in summaries),
        "dim": "",
        "dtype": "",
        "raw_bytes": raw,
        "stored_bytes": stored,
        "savings": 1 - stored / raw if raw else 0.0,
    }
    if summaries and "tier_bytes" in summaries[0]:
        tier = sum(s["tier_bytes"] for s in summaries)
        state = sum(s["policy_bytes"] for s in summaries)
        held = stored + tier + state
        total |= {
            "tier_bytes": tier,
            "policy_bytes": state,
            "net_savings": 1 - held / raw if raw else 0.0,
        }
    counts = ("raw_bytes", "stored_bytes", "tier_bytes", "policy_bytes")
    shares = ("savings", "net_savings")
    return [
        s
        | {k: f"{s[k]:,}" for k in counts if k in s}
        | {k: f"{100 * s[k]:.1f}%" for k in shares if k in s}
        for s in [*summaries, total]
    ]


def _print_description(desc: dict[str, Any]) -> None:
    print(f"{desc['file']}")
    for key, value in desc["header"].items():
        if key == "dtype_code":
            print(f"  {'dtype':<16} {_dtype_label(value)} (code {value})")
        else:
            print(f"  {key:<16} {value}")
    print("  sections:")
    for s in desc["sections"]:
        print(
            f"    {s['kind']:<11} offset {s['offset']:>12}  length {s['length']:>12}  "
            f"xxh3 {s['xxh3']}"
        )
    gpu = desc["meta"].get("gpu_layout")
    if gpu:
        print(f"  gpu layout: {gpu['reason']}")
    print(f"  meta: {json.dumps(desc['meta'], sort_keys=True)}")


def run_inspect(args: argparse.Namespace) -> int:
    try:
        if args.path.is_dir():
            found = manifest.read_manifest(args.path)
            result: dict[str, Any] = {
                "manifest": json.loads(found.to_json()),
                "tables": _describe_set(args.path, found),
            }
        else:
            result = {"tables": [describe_file(args.path)]}
    except (ValueError, OSError) as exc:
        return _fail("inspect", exc)
    summaries = [summarize(desc) for desc in result["tables"]]
    columns: tuple[str, ...]  # the tier's columns may be added
    columns = ("table", "rows", "dim", "dtype", "raw_bytes", "stored_bytes", "savings")
    if args.hot_tier is not None:
        _add_tier(summaries, args.hot_tier)
        columns = (*columns, "tier_bytes", "policy_bytes", "net_savings")
    if args.json:
        print(json.dumps({**result, "summary": summaries}, indent=1))
        return EXIT_OK
    if "manifest" in result:
        version = result["manifest"].get("table_set_version", "unnumbered")
        print(f"table set {args.path}: {len(result['tables'])} table(s), version {version}")
        for feature, table in sorted(result["manifest"]["features"].items()):
            print(f"  feature {feature} -> {table}")
    for desc in result["tables"]:
        _print_description(desc)
    print()
    _print_table(_summary_rows(summaries), columns)
    return EXIT_OK


# -- verify ----------------------------------------------------------------------------------


def run_verify(args: argparse.Namespace) -> int:
    try:
        if args.path.is_dir():
            found = manifest.read_manifest(args.path)
            targets: list[tuple[str | None, Path, manifest.ManifestEntry | None]] = [
                (name, args.path / e.file, e) for name, e in found.tables.items()
            ]
        elif args.path.exists():
            targets = [(None, args.path, None)]
        else:  # no table to report on: an error line, as inspect gives
            raise ValueError(f"{args.path}: no such file or directory")
    except (ValueError, OSError) as exc:
        if args.json:
            error = _message(exc)
            print(json.dumps({"path": str(args.path), "ok": False, "error": error, "tables": []}))
        return _fail("verify", exc)
    results: list[dict[str, Any]] = []
    for name, path, entry in targets:
        # A set's table has both a name and an entry, a lone file neither.
        try:
            if name is not None and entry is not None:
                _set_file(args.path, name, entry)
            loaded = tf.verify_file(path)
            # The checks a load makes: checksum, name, shape, row range.
            if name is not None and entry is not None:
                manifest.check_entry(args.path / manifest.MANIFEST, name, entry, loaded)
        except (ValueError, OSError) as exc:
            error = _message(exc)
            results.append({"table": name, "file": str(path), "ok": False, "error": error})
            if not args.json:  # on stdout with the OK lines: the exit status tells a failure
                print(f"FAIL {error}", flush=True)
            continue
        rows, dim = loaded.header.num_rows, loaded.header.dim
        results.append(
            {"table": loaded.name, "file": str(path), "ok": True, "rows": rows, "dim": dim}
        )
        if not args.json:  # one line per table as it is checked: the progress of a long verify
            print(f"OK   {path}  {loaded.name}  [{rows}, {dim}]", flush=True)
    ok = all(r["ok"] for r in results)
    if args.json:
        print(json.dumps({"path": str(args.path), "ok": ok, "tables": results}, indent=1))
    return EXIT_OK if ok else EXIT_FAULT
