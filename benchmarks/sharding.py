# SPDX-License-Identifier: Apache-2.0
"""Sharding benchmark: 3 row-shard servers behind the sharded client vs one server, same requests.

    python -m benchmarks.sharding [--quick] [--out DIR] [--batch 512] [--concurrency 4]

One run packs the DLRM-DCNv2-profile demo tables (26 features, D=128, cardinalities capped to
``max_rows``) twice: whole (one table set) and with ``pack_shards`` into 3 row shards. Four
``ibpembed serve`` processes start: one holding everything, one per shard. The same Zipf
requests (DCNv2 pooling factors, SUM) then go, in a closed loop of ``--concurrency`` requests in
flight, to the single server through :class:`~ibpembed_client.AsyncLookupClient` and to the
shards through :class:`~ibpembed_client.AsyncShardedLookupClient` (split, 3 RPCs, merge).
Rounds alternate single and sharded, so drifting machine load hits both alike; QPS, p50 and
p99 are over all rounds.

On one machine the shards share its cores with each other and with the client: the ratio
measures what the fan-out and merge cost, not what more machines would gain (each shard decodes
a third of the rows, on hardware of its own in a real deployment). Results: DIR/sharding.json
and DIR/sharding.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks._harness import RESULTS, run_metadata, write_results
from ibpembed.engine.tier import FIRST_REFRESH_S
from ibpembed.server import demo
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import shard_directory
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.shards import pack_shards
from ibpembed_client import (
    AsyncLookupClient,
    AsyncShardedLookupClient,
    LookupResult,
    LookupServiceError,
    RetryPolicy,
    ShardMap,
)
from ibpembed_client.shards import merge_results, split_request
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.workload import DCNV2_CARDINALITIES, hotness_for, make_requests
from tools.serve_process import ServerProcess

SHARDS = 3


@dataclass(frozen=True)
class Config:
    """Sizes of one run; ``quick`` is the smoke-test size."""

    max_rows: int  # rows per demo table cap (DCNv2 cardinalities capped to it)
    seconds: float  # measured seconds per round and variant
    warmup_s: float
    rounds: int  # single/sharded alternations


FULL = Config(max_rows=100_000, seconds=8.0, warmup_s=1.0, rounds=3)
QUICK = Config(max_rows=5_000, seconds=1.0, warmup_s=0.3, rounds=1)


def demo_set(max_rows: int) -> TableSet:
    """The demo's 26 tables as pack sources (one feature per table)."""
    sources = []
    for i, (name, cardinality) in enumerate(
        zip(demo.feature_names(), DCNV2_CARDINALITIES, strict=True)
    ):
        rows = min(cardinality, max_rows)
        weight = demo.demo_table(rows, demo.DIM, i, bf16_rounded=i % 4 == 3)
        sources.append(TableSource(name, weight))
    return TableSet(tuple(sources))


def serve(tables: Path, workers: int) -> ServerProcess:
    """``ibpembed serve --tables DIR`` on a free port, started without waiting (all load at
    once); one torch thread per server, as the servers share the cores."""
    return ServerProcess(
        *("--tables", str(tables), "--workers", str(workers), "--torch-threads", "1"),
        *("--device", "cpu", "--max-inflight", "1024", "--log-level", "warning"),
        wait=False,
    )


async def closed_loop(
    lookup: Callable[[pb.LookupRequest], Awaitable[object]],
    requests: list[pb.LookupRequest],
    concurrency: int,
    seconds: float,
    warmup_s: float,
) -> tuple[list[float], collections.Counter]:
    """Latencies (seconds) of requests started after the warm-up, and error codes."""
    loop = asyncio.get_running_loop()
    warm_from = loop.time() + warmup_s
    stop_at = warm_from + seconds
    latencies: list[float] = []
    errors: collections.Counter = collections.Counter()

    async def worker(w: int) -> None:
        i = w
        while (began := loop.time()) < stop_at:
            try:
                await lookup(requests[i % len(requests)])
            except LookupServiceError as err:
                errors[err.code.name] += 1
            else:
                if began >= warm_from:
                    latencies.append(loop.time() - began)
            i += concurrency

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return latencies, errors


async def measure(
    variant: str, target: str, shard_map: ShardMap, requests: list, cfg: Config, concurrency: int
) -> tuple[list[float], collections.Counter]:
    """One round of one variant, with a fresh client (channels belong to this event loop)."""
    # No retries: the benchmark reports what the servers answered.
    no_retry = RetryPolicy(max_attempts=1)
    client: AsyncLookupClient | AsyncShardedLookupClient
    if variant == "single":
        client = AsyncLookupClient(target, retry=no_retry, timeout=60)
    else:
        client = AsyncShardedLookupClient(shard_map, retry=no_retry, timeout=60)
    try:
        return await closed_loop(
            client.lookup_request, requests, concurrency, cfg.seconds, cfg.warmup_s
        )
    finally:
        await client.close()


async def warm_hot_rows(
    target: str, shard_map: ShardMap, requests: list, cfg: Config, concurrency: int
) -> None:
    """Unmeasured load on all four servers at once past their first hot-row refresh
    (FIRST_REFRESH_S after they start), so both variants are measured with copies in place."""
    warm = replace(cfg, seconds=FIRST_REFRESH_S + 2.0, warmup_s=0.0)
    await asyncio.gather(
        *(measure(v, target, shard_map, requests, warm, concurrency) for v in ("single", "sharded"))
    )


def client_overhead(shard_map: ShardMap, requests: list, repeats: int = 5) -> dict:
    """Client CPU per request for the split and for the merge, in ms (best of ``repeats``).

    The merge gets zero partial sums of the shapes the shards would return, so this is the
    client's own work, without any RPC.
    """
    split_s, merge_s = [], []
    for _ in range(repeats):
        for request in requests:
            began = time.perf_counter()
            plan = split_request(shard_map, request)
            split_s.append(time.perf_counter() - began)
            partials = {
                shard: LookupResult(
                    "",
                    1,
                    {
                        f.name: np.zeros((len(f.lengths) // 4, demo.DIM), np.float32)
                        for f in part.features
                    },
                )
                for shard, part in plan.requests.items()
            }
            began = time.perf_counter()
            merge_results(plan, partials)
            merge_s.append(time.perf_counter() - began)
    return {"split_ms": min(split_s) * 1000.0, "merge_ms": min(merge_s) * 1000.0}


def summary(latencies: list[float], errors: collections.Counter, seconds: float) -> dict:
    lat = np.asarray(latencies) * 1000.0
    return {
        "qps": lat.size / seconds,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "requests": int(lat.size),
        "errors": dict(errors),
    }


def run(cfg: Config, out: Path, batch: int, concurrency: int, workers: int) -> dict:
    table_set = demo_set(cfg.max_rows)
    rows = {s.name: s.weight.shape[0] for s in table_set.tables}
    features = list(rows)
    requests = make_requests(
        rows,
        batch_size=batch,
        hotness=hotness_for(features, "dcnv2"),
        alpha=1.05,
        pooling="sum",
        count=4,
    )
    with tempfile.TemporaryDirectory(prefix="ibpembed-bench-") as tmp:
        root = Path(tmp)
        pack_table_set(root / "whole", table_set, sample_rows=65536)
        pack_shards(root / "sharded", table_set, SHARDS, sample_rows=65536)
        del table_set  # the servers map the files; the sources are not needed any more
        processes = [serve(root / "whole", workers)] + [
            serve(root / "sharded" / shard_directory(k, SHARDS), workers) for k in range(SHARDS)
        ]
        try:
            single, *shards = [p.wait_listening() for p in processes]
            shard_map = ShardMap.load(root / "sharded", shards)
            asyncio.run(warm_hot_rows(single, shard_map, requests, cfg, concurrency))
            runs: dict[str, tuple[list[float], collections.Counter]] = {
                "single": ([], collections.Counter()),
                "sharded": ([], collections.Counter()),
            }
            for r in range(cfg.rounds):
                order = ("single", "sharded") if r % 2 == 0 else ("sharded", "single")
                for variant in order:
                    lat, err = asyncio.run(
                        measure(variant, single, shard_map, requests, cfg, concurrency)
                    )
                    runs[variant][0].extend(lat)
                    runs[variant][1].update(err)
                    print(f"round {r} {variant}: {len(lat) / cfg.seconds:.1f} QPS", flush=True)
        finally:
            for p in processes:
                p.stop()
    overhead = client_overhead(shard_map, requests)
    results = {v: summary(lat, err, cfg.seconds * cfg.rounds) for v, (lat, err) in runs.items()}
    single_r, sharded_r = results["single"], results["sharded"]
    report = {
        **run_metadata(" ".join(["python -m benchmarks.sharding", *sys.argv[1:]])),
        "config": asdict(cfg)
        | {"batch": batch, "concurrency": concurrency, "workers": workers, "shards": SHARDS},
        "results": results,
        "client_overhead": overhead,
        "qps_ratio": sharded_r["qps"] / single_r["qps"] if single_r["qps"] else None,
        "p99_ratio": (
            sharded_r["p99_ms"] / single_r["p99_ms"]
            if sharded_r["p99_ms"] and single_r["p99_ms"]
            else None
        ),
    }
    write_results(out, "sharding", report, markdown(report))
    return report


def markdown(report: dict) -> str:
    """The section pasted into BENCHMARKS.md."""
    cfg = report["config"]
    lines = [
        f"{report['date']}, {report['machine']} (load average {report['load_average']:.1f}), "
        f"torch {report['torch']}, `{report['command']}`: B={cfg['batch']}, 26 DCNv2-profile "
        f"features (rows capped at {cfg['max_rows']}), SUM, {cfg['concurrency']} requests in "
        f"flight, {cfg['workers']} kernel thread(s) per server, {cfg['rounds']} x "
        f"{cfg['seconds']:.0f} s per variant.",
        "",
        "| servers | QPS | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|",
    ]
    names = {"single": "1 (whole tables)", "sharded": f"{cfg['shards']} row shards"}
    for variant, r in report["results"].items():
        lines.append(
            f"| {names[variant]} | {r['qps']:.1f} | {_ms(r['p50_ms'])} | {_ms(r['p99_ms'])} "
            f"| {r['errors'] or 'none'} |"
        )
    lines += [
        "",
        f"sharded / single: QPS {_ratio(report['qps_ratio'])}, "
        f"p99 {_ratio(report['p99_ratio'])}; the sharded client's own CPU per request: split "
        f"{report['client_overhead']['split_ms']:.1f} ms, merge "
        f"{report['client_overhead']['merge_ms']:.1f} ms (best of 5, no RPC).",
    ]
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tables, 1 s per round")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="kernel threads per server")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    report = run(cfg, args.out, args.batch, args.concurrency, args.workers)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
