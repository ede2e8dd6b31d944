# SPDX-License-Identifier: Apache-2.0
"""Metrics overhead: lookup throughput of ``ibpembed serve`` with metrics on vs off, same run.

    python -m benchmarks.metrics_overhead [--quick] [--out DIR] [--rounds N] [--batches B ...]

One table set (the DLRM-DCNv2-profile demo tables, compressed) is served by pairs of server
processes started side by side with the same flags, except ``--metrics-port``: free port (on)
or 0 (off). For each batch size B (26 features, DCNv2 pooling factors, Zipf ids, SUM pooling) the
load generator measures both servers of a pair in alternating rounds (on/off, then off/on, ...),
so drift in the machine's load hits both arms alike; the rounds are spread over ``--pairs``
fresh pairs (started in alternating order), because where a process lands on a shared host
moves its CPU per request by several percent for its whole life, which one pair would report as
the metrics' cost. While the "on" server is measured, /metrics is
scraped every ``--scrape-interval`` seconds (default 1; Prometheus is typically configured at
15 s, so the default is pessimistic; 0 = no scrapes).

Reported per B, each as the median over rounds of the per-round on/off ratio:

* **QPS overhead** ``1 - qps_on / qps_off`` (the target is <= 3 %). Client and servers share the
  machine's cores, so on a busy machine this swings by tens of percent from round to round;
* **server CPU overhead** ``cpu_on / cpu_off - 1``, the server process's CPU seconds (all threads,
  ``/proc/<pid>/stat``) per request answered. A saturated server's throughput is its cores over
  this; it depends less on what else runs on the machine, but cache and core sharing still move
  it by several percent per round.
* **hook estimate**: the metrics code's own cost per request, timed in process (best of several
  repeats, so other load hardly matters): the service interceptor's ``lookup_started``,
  ``lookup_done`` and ``rpc_done`` calls, the servicer's ``wire_timed`` (decode and encode) and
  ``output_written``, and ``kernels_done`` (the engine's one call per request, per table read),
  divided by the "off" server's CPU per request. It leaves out what the same code costs in a
  loaded server (cold caches, worker threads holding the GIL the event loop waits for): 3-6x
  more, measured while developing.

Results: DIR/metrics_overhead.json and DIR/metrics_overhead.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks._harness import RESULTS, run_metadata, write_results
from ibpembed.server import demo
from ibpembed.server.interceptors import LOOKUP_METHOD
from ibpembed.server.metrics import ServerMetrics
from ibpembed.tables.pack import save_table_set
from ibpembed.tables.store import TableStore
from ibpembed_client.loadgen import LoadConfig, run_load
from ibpembed_client.v1 import lookup_pb2 as pb
from tools.serve_process import ServerProcess


@dataclass(frozen=True)
class Config:
    """Sizes of one run; ``quick`` is the smoke-test size."""

    max_rows: int  # rows per demo table cap (DCNv2 cardinalities capped to it)
    batches: tuple[int, ...]
    seconds: float  # measured seconds per round and arm
    warmup_s: float
    rounds: int
    # Fresh server pairs the rounds are spread over: a process's placement (cores, memory,
    # caches) moved one pair's CPU per request by 5-10 % either way on this shared host.
    pairs: int
    scrape_interval_s: float = 1.0  # 0 = the "on" server is not scraped


FULL = Config(max_rows=100_000, batches=(1, 64, 512), seconds=4.0, warmup_s=0.5, rounds=16, pairs=4)
QUICK = Config(max_rows=2_000, batches=(1,), seconds=0.5, warmup_s=0.1, rounds=2, pairs=2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(tables: Path, *, metrics: bool, workers: int) -> ServerProcess:
    """``ibpembed serve --tables DIR``, metrics on a free port (``.metrics_port``) or off."""
    metrics_port = _free_port() if metrics else 0
    server = ServerProcess(
        *("--tables", str(tables), "--workers", str(workers), "--device", "cpu"),
        *("--max-inflight", "1024", "--log-level", "warning"),
        *("--metrics-port", str(metrics_port)),
        # Hot-row refreshes (~0.2 s of CPU every 30 s, at different moments in the two
        # servers) would land in some rounds and not others: off in both arms, as the
        # metrics code does not depend on them.
        *("--hot-tier", "off"),
    )
    server.metrics_port = metrics_port
    return server


# The scraper runs in its own process, as Prometheus does: a thread in this process would take
# the GIL from the load generator and make the server look slower for the wrong reason.
_SCRAPE_LOOP = """
import sys, time, urllib.request
url, every = sys.argv[1], float(sys.argv[2])
while True:
    time.sleep(every)
    with urllib.request.urlopen(url, timeout=10) as response:
        response.read()
    print(flush=True)
"""


class Scraper:
    """Fetches /metrics every ``interval_s`` from a child process until stopped."""

    def __init__(self, port: int, interval_s: float) -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SCRAPE_LOOP, url, str(interval_s)],
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> int:
        """Stop scraping; returns the number of scrapes done."""
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        return out.count("\n")


def load(server: ServerProcess, batch: int, concurrency: int, seconds: float) -> dict:
    """One closed-loop load generator run against ``server`` (no warm-up phase of its own)."""
    config = LoadConfig(
        target=server.target,
        concurrency=concurrency,
        duration_s=seconds,
        warmup_s=0.0,
        batch_size=batch,
        request_pool=8 if batch < 512 else 2,
        deadline_ms=60_000,
        progress=False,
    )
    return asyncio.run(run_load(config))


def measure(server: ServerProcess, cfg: Config, batch: int, concurrency: int) -> dict:
    """QPS and server CPU per request of one run; scraped while it runs when metrics are on."""
    scrape = server.metrics_port and cfg.scrape_interval_s > 0
    scraper = Scraper(server.metrics_port, cfg.scrape_interval_s) if scrape else None
    cpu = server.cpu_seconds()
    report = load(server, batch, concurrency, cfg.seconds)
    cpu = server.cpu_seconds() - cpu
    scrapes = scraper.stop() if scraper is not None else 0
    answered = report["ok"] + sum(report["errors"].values())
    return {
        "qps": report["qps"],
        "cpu_per_request_s": cpu / answered if answered else None,
        "errors": report["errors"],
        "scrapes": scrapes,
    }


def hook_costs(store: TableStore, repeats: int = 7, number: int = 20_000) -> dict:
    """Seconds the metrics code adds per request and per table read (best of ``repeats``)."""
    metrics = ServerMetrics(store, device="cpu")
    request = pb.LookupRequest(pooling=pb.POOLING_SUM)

    def per_request() -> None:  # what the service interceptor and the servicer call for a Lookup
        token = metrics.lookup_started(LOOKUP_METHOD, request)
        metrics.wire_timed("decode", 3e-5)
        metrics.wire_timed("encode", 4e-5)
        metrics.output_written("wire", 4096)
        metrics.lookup_done(token, 1e-3)
        metrics.rpc_done(LOOKUP_METHOD, grpc.StatusCode.OK)

    request_s = min(timeit.repeat(per_request, number=number, repeat=repeats))
    kernels = [(name, 64, 60, 2e-4) for name in store.accounting()]  # a request reading all
    per_table = min(
        timeit.repeat(lambda: metrics.kernels_done("sum", kernels), number=number, repeat=repeats)
    ) / len(kernels)
    return {"per_request_s": request_s / number, "per_table_s": per_table / number}


def measure_pair(
    tables: Path, pair: int, cfg: Config, batch: int, workers: int, concurrency: int
) -> dict[str, list[dict]]:
    """One fresh pair of servers (metrics on, off), warmed, then measured in alternating rounds
    (on/off, then off/on, ...); pairs alternate which arm starts first too."""
    arms = ("on", "off") if pair % 2 == 0 else ("off", "on")
    servers: dict[str, ServerProcess] = {}
    try:
        for arm in arms:
            servers[arm] = serve(tables, metrics=arm == "on", workers=workers)
        for server in servers.values():  # warm caches, threads and connections
            load(server, batch, concurrency, cfg.warmup_s)
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for r in range(-(-cfg.rounds // cfg.pairs)):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                runs[arm].append(measure(servers[arm], cfg, batch, concurrency))
        return runs
    finally:
        for server in servers.values():
            server.stop()


def _median_ratio(on: list[dict], off: list[dict], key: str) -> float | None:
    ratios = [a[key] / b[key] for a, b in zip(on, off, strict=True) if a[key] and b[key]]
    return statistics.median(ratios) if ratios else None


def run(cfg: Config, out: Path, workers: int, concurrency: int) -> dict:
    results = []
    with tempfile.TemporaryDirectory(prefix="ibpembed-metrics-bench-") as tmp:
        tables = demo.build(cfg.max_rows)
        save_table_set(tmp, tables, {name: name for name in tables})
        costs = hook_costs(TableStore.load(tmp))
        for batch in cfg.batches:
            runs: dict[str, list[dict]] = {"on": [], "off": []}
            pair_cpu_ratios = []
            for pair in range(cfg.pairs):
                pair_runs = measure_pair(Path(tmp), pair, cfg, batch, workers, concurrency)
                pair_cpu_ratios.append(
                    _median_ratio(pair_runs["on"], pair_runs["off"], "cpu_per_request_s")
                )
                for arm in runs:
                    runs[arm] += pair_runs[arm]
            qps_ratio = _median_ratio(runs["on"], runs["off"], "qps")
            cpu_ratio = _median_ratio(runs["on"], runs["off"], "cpu_per_request_s")
            cpu_off = statistics.median(
                x["cpu_per_request_s"] for x in runs["off"] if x["cpu_per_request_s"]
            )
            # Every demo feature reads its own table: one kernel call per table.
            hooks = costs["per_request_s"] + len(tables) * costs["per_table_s"]
            row = {
                "batch": batch,
                "hook_estimate": hooks / cpu_off,
                "qps_on": statistics.median(x["qps"] for x in runs["on"]),
                "qps_off": statistics.median(x["qps"] for x in runs["off"]),
                "qps_overhead": None if qps_ratio is None else 1.0 - qps_ratio,
                "cpu_overhead": None if cpu_ratio is None else cpu_ratio - 1.0,
                "runs": runs,
                "scrapes": sum(x["scrapes"] for x in runs["on"]),
                "pair_cpu_overheads": [None if x is None else x - 1.0 for x in pair_cpu_ratios],
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    report = {
        **run_metadata(" ".join(["python -m benchmarks.metrics_overhead", *sys.argv[1:]])),
        "config": cfg.__dict__ | {"workers": workers, "concurrency": concurrency},
        "hook_costs": costs,
        "results": results,
    }
    write_results(out, "metrics_overhead", report, markdown(report))
    return report


def markdown(report: dict) -> str:
    """The table pasted into BENCHMARKS.md."""
    cfg = report["config"]
    lines = [
        f"{report['date']}, {report['machine']} (load average {report['load_average']:.1f}), "
        f"torch {report['torch']}, `{report['command']}`: {cfg['rounds']} alternating rounds "
        f"of {cfg['seconds']} s per arm over {cfg['pairs']} fresh server pairs, "
        f"{cfg['concurrency']} requests in flight, "
        f"scraped every {cfg['scrape_interval_s']} s (0 = never), "
        f"{cfg['workers']} server workers, 26 features, tables capped at {cfg['max_rows']} rows.",
        "",
        f"Metrics code per request: {1e6 * report['hook_costs']['per_request_s']:.1f} us, "
        f"plus {1e6 * report['hook_costs']['per_table_s']:.2f} us per table read.",
        "",
        "| B | QPS off | QPS on | QPS overhead | server CPU/request off | server CPU/request on "
        "| server CPU overhead | hook estimate | per-pair CPU overhead | scrapes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        cpu = {
            arm: statistics.median(
                x["cpu_per_request_s"] for x in r["runs"][arm] if x["cpu_per_request_s"]
            )
            for arm in ("off", "on")
        }
        pairs = ", ".join(_percent(x) for x in r["pair_cpu_overheads"])
        lines.append(
            f"| {r['batch']} | {r['qps_off']:.1f} | {r['qps_on']:.1f} "
            f"| {_percent(r['qps_overhead'])} | {1e3 * cpu['off']:.2f} ms "
            f"| {1e3 * cpu['on']:.2f} ms | {_percent(r['cpu_overhead'])} "
            f"| {_percent(r['hook_estimate'])} | {pairs} "
            f"| {r['scrapes']} |"
        )
    return "\n".join(lines) + "\n"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.1f} %"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tables, B=1, short rounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per B")
    parser.add_argument("--pairs", type=int, default=None, help="server pairs per B")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes B")
    parser.add_argument(
        "--scrape-interval", type=float, default=1.0, help="seconds between scrapes (0 = none)"
    )
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--concurrency", type=int, default=None, help="default 2 x workers")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.rounds is not None:
        cfg = Config(**(cfg.__dict__ | {"rounds": args.rounds}))
    if args.pairs is not None:
        cfg = Config(**(cfg.__dict__ | {"pairs": args.pairs}))
    if args.batches is not None:
        cfg = Config(**(cfg.__dict__ | {"batches": tuple(args.batches)}))
    cfg = Config(**(cfg.__dict__ | {"scrape_interval_s": args.scrape_interval}))
    report = run(cfg, args.out, args.workers, args.concurrency or 2 * args.workers)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
