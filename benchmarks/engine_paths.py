# SPDX-License-Identifier: Apache-2.0
"""Engine pooled-lookup paths: decode-once (dedupe) vs fused, with and without a decoded tier.

    python -m benchmarks.engine_paths [--quick] [--out DIR]

``LookupEngine`` pools a table's ids either by deduplicating them (sort, decode each distinct
row once, ``embedding_bag``) or with the fused decode+pool kernel over every id (which decodes
repeated ids once as far as its per-call cache of decoded rows reaches); the default sorts only
tables with at least ``DEDUPE_MIN_IDS`` ids, and a table whose decoded tier served at least
half of the lookups that ranked them takes the fused kernel. This measures four engines side by
side (dedupe from 64 ids, fused, the default without and with copies), in one process, on the
same requests (CPU time per request, best of several alternating passes, one torch thread):

* **large**: one DLRM-profile fp32 table (D=128, 1 GiB by default), B=512 bags of 1..100 Zipf(1.05)
  ids, hot rows permuted: the tables ibpembed is for;
* **demo**: the 26 DLRM-DCNv2-profile demo tables (capped at 100k rows, most far smaller) at
  B=64 and B=512, DCNv2 pooling factors.

Copies are ranked by the engine's own policy on 8 earlier requests of the same traffic (1 % of
raw bytes). Before the timed passes every variant's sums over the timed requests are compared
once with the fused variant's, within ``reference.pooled_tolerance`` (the fp32 bound for two
summation orders): a case records ``agree`` per variant, and the run exits 1 when one differs.
Results: DIR/engine_paths.json and DIR/engine_paths.md.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from benchmarks import data
from benchmarks._harness import RESULTS, run_metadata, write_results
from ibpembed import reference
from ibpembed.codec import compress
from ibpembed.engine import DEDUPE_MIN_IDS, FeatureQuery, LookupEngine
from ibpembed.engine_defaults import DEFAULT_TIER
from ibpembed.server import demo
from ibpembed.server.wire import decode_request
from ibpembed.tables.store import TableStore
from ibpembed_client.workload import hotness_for, make_requests

WARMUP_REQUESTS = 8
VARIANTS = {  # name: (dedupe_max_unique_fraction, dedupe_min_ids, hot_tier)
    "dedupe (from 64 ids)": (0.5, 64, "off"),
    "fused": (0.0, DEDUPE_MIN_IDS, "off"),
    "engine default, no tier": (0.5, DEDUPE_MIN_IDS, "off"),
    "engine default + tier": (0.5, DEDUPE_MIN_IDS, DEFAULT_TIER),
}

REFERENCE_VARIANT = "fused"  # the others' results are compared with this one's

Request = list[FeatureQuery]


def engines(tables: dict) -> dict[str, LookupEngine]:
    out = {}
    for name, (fraction, min_ids, budget) in VARIANTS.items():
        store = TableStore.from_tables(tables)
        # No publication during the run: the tier comes from the explicit refresh in
        # measure(), which also stops the thread before its first publication (5 s in).
        out[name] = LookupEngine(
            store,
            max_workers=1,
            dedupe_max_unique_fraction=fraction,
            dedupe_min_ids=min_ids,
            hot_tier=budget,
            hot_tier_refresh_s=1e6,
        )
    return out


def sums(engine: LookupEngine, requests: list[Request]) -> list[list[torch.Tensor]]:
    """Each request's pooled SUM per feature, as ``engine`` computes it."""
    return [[f.values for f in engine.run(request, "sum").features] for request in requests]


def tolerances(store: TableStore, requests: list[Request]) -> list[list[torch.Tensor]]:
    """Per request and feature, the [B, D] bound on how far two fp32 sums of its bags may differ
    (``reference.pooled_tolerance``: sequential fp32 accumulation, two summation orders)."""
    out = []
    with store.acquire() as snap:
        for request in requests:
            bounds = []
            for query in request:
                _, table = snap.table_for_feature(query.name)
                rows = table.gather(torch.tensor(query.ids)).double().numpy()
                offsets = np.concatenate([[0], np.cumsum(query.lengths, dtype=np.int64)])
                positions = np.arange(query.ids.size)  # rows[i] is the row of the i-th id
                bound = reference.pooled_tolerance(rows, positions, offsets, query.weights, "sum")
                bounds.append(torch.from_numpy(bound))
            out.append(bounds)
    return out


def agreement(variants: dict[str, LookupEngine], requests: list[Request]) -> dict[str, bool]:
    """Whether each variant's sums over ``requests`` equal the fused variant's within the fp32
    summation-order tolerance (same shapes, every element)."""
    want = sums(variants[REFERENCE_VARIANT], requests)
    bounds = tolerances(variants[REFERENCE_VARIANT].store, requests)
    agree = {}
    for name, engine in variants.items():
        got = sums(engine, requests)
        agree[name] = all(
            g.shape == w.shape and bool(((g.double() - w.double()).abs() <= t).all())
            for got_r, want_r, bound_r in zip(got, want, bounds, strict=True)
            for g, w, t in zip(got_r, want_r, bound_r, strict=True)
        )
    return agree


def measure(tables: dict, warm: list[Request], timed: list[Request], passes: int) -> dict:
    """Best-of-``passes`` CPU ms per request of each variant, passes alternating (``ms``), and
    whether each variant's results agree with the fused variant's (``agree``, checked once
    before the timed passes, outside them)."""
    variants = engines(tables)
    try:
        for engine in variants.values():
            for request in warm:
                engine.run(request, "sum")
            if engine.tier is not None:
                engine.tier.refresh()
                engine.tier.close()  # no background admission on the timed requests
        agree = agreement(variants, timed)  # with the tiers in place, before any timing
        best = dict.fromkeys(variants, float("inf"))
        for p in range(passes):
            order = list(variants.items())
            for name, engine in order if p % 2 == 0 else reversed(order):
                start = time.process_time()
                for request in timed:
                    engine.run(request, "sum")
                best[name] = min(best[name], (time.process_time() - start) / len(timed) * 1e3)
        return {"ms": best, "agree": agree}
    finally:
        for engine in variants.values():
            engine.close()


def large_case(gib: float, passes: int) -> dict:
    rows = int(gib * (1 << 30)) // 512
    table = compress(data.tiled_table(data.dlrm_table(min(rows, 1 << 18), 128), rows))
    batches = data.zipf_batches(rows, num_batches=WARMUP_REQUESTS + 16, seed=0)
    requests = [
        [FeatureQuery("t", b.ids.numpy(), b.lengths.numpy().astype(np.int32))] for b in batches
    ]
    measured = measure({"t": table}, requests[:WARMUP_REQUESTS], requests[WARMUP_REQUESTS:], passes)
    return {"case": f"large: 1 table, {rows:,} x 128 fp32 ({gib:g} GiB)", "batch": 512, **measured}


def demo_case(batch: int, max_rows: int, passes: int) -> dict:
    tables = demo.build(max_rows=max_rows)
    features = demo.feature_names()
    rows = {f: tables[f].num_rows for f in features}

    # One stream (one seed: the same hot rows throughout), its first requests rank the tiers.
    stream = make_requests(rows, batch_size=batch, hotness=hotness_for(features, "dcnv2"),
                           alpha=1.05, pooling="sum", count=WARMUP_REQUESTS + 8)  # fmt: skip
    requests = [decode_request(r)[0] for r in stream]
    measured = measure(tables, requests[:WARMUP_REQUESTS], requests[WARMUP_REQUESTS:], passes)
    return {"case": f"demo: 26 tables, <= {max_rows:,} rows", "batch": batch, **measured}


def markdown(report: dict) -> str:
    lines = [
        f"{report['date']}, {report['machine']} (load average {report['load_average']:.1f}), "
        f"torch {report['torch']}, `{report['command']}`: CPU ms per request, best of "
        f"{report['passes']} alternating passes, one thread.",
        "",
        "| case | B | " + " | ".join(VARIANTS) + " | results agree |",
        "|---|---|" + "---|" * (len(VARIANTS) + 1),
    ]
    for r in report["results"]:
        cells = " | ".join(f"{r['ms'][v]:.2f}" for v in VARIANTS)
        differ = [v for v in VARIANTS if not r["agree"][v]]
        agree = "yes" if not differ else "NO: " + ", ".join(differ)
        lines.append(f"| {r['case']} | {r['batch']} | {cells} | {agree} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small tables, few passes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    passes = 2 if args.quick else 6
    results = [large_case(1 / 64 if args.quick else 1.0, passes)]
    for batch in (64, 512):
        results.append(demo_case(batch, 2_000 if args.quick else 100_000, passes))
        print(json.dumps(results[-1]), flush=True)
    report = {
        **run_metadata("python -m benchmarks.engine_paths" + (" --quick" if args.quick else "")),
        "passes": passes,
        "results": results,
    }
    write_results(args.out, "engine_paths", report, markdown(report))
    print(markdown(report))
    if not all(all(r["agree"].values()) for r in results):
        print(f"some variant's results differ from the {REFERENCE_VARIANT!r} variant's")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
