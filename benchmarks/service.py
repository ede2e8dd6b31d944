# SPDX-License-Identifier: Apache-2.0
"""Service benchmark: gRPC lookups vs the engine in-process, compressed vs raw tables.

    python -m benchmarks.service [--quick] [--out DIR] [--workers N] [--concurrency C]

One run packs the DLRM-DCNv2-profile demo tables twice into one table set: ``cat_i`` compressed
(IBP) and ``raw_cat_i`` stored raw through the same layout and kernels (``method="raw"``). One
``ibpembed serve --tables`` process serves both, so compressed and raw are measured in the same
server run. For each batch size B (26 features, DCNv2 pooling factors, Zipf ids with permuted hot
rows, SUM pooling) it measures:

* **gRPC**: the load generator in concurrency mode (``--concurrency`` requests in flight) against
  the server process: QPS, p50 and p99 at saturation;
* **in-process**: the same requests decoded once and run by a ``LookupEngine`` over the same
  table files with ``--workers`` threads each running lookups back to back.

Both run the server's default hot-row policy (``ibpembed.hot_rows``): an unmeasured load first
takes the server past its first refresh, and the in-process engine ranks more requests drawn
from each point's distribution (not the timed ones) before timing it.

``grpc / in-process`` is the throughput ratio. Client and server share the machine, so on few
cores the ratio is a lower bound. CPU per request is measured over the same windows: the server
process's CPU time (``/proc``) per answered gRPC request, and the benchmark process's per
in-process request. Their ratio (in-process / server) is the gRPC path's throughput relative to
the engine's when CPU-bound on cores of its own, which the shared machine cannot show directly.
Results: DIR/service.json and DIR/service.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ibpembed.codec import compress
from ibpembed.engine import LookupEngine
from ibpembed.hot_rows import DEFAULT_BUDGET, FIRST_REFRESH_S
from ibpembed.server import demo
from ibpembed.server.servicer import decode_request
from ibpembed.tables.pack import save_table_set
from ibpembed.tables.store import TableStore
from ibpembed_client.loadgen import LoadConfig, run_load
from ibpembed_client.workload import hotness_for, make_requests
from tools.serve_process import ServerProcess, proc_cpu_seconds

DEFAULT_OUT = Path(__file__).resolve().parent / ".cache" / "results"
BATCHES = (1, 64, 512, 2048)


@dataclass(frozen=True)
class Config:
    """Sizes of one run; ``quick`` is the smoke-test size."""

    max_rows: int  # rows per demo table cap (DCNv2 cardinalities capped to it)
    seconds: float  # measured seconds per point and path
    warmup_s: float


FULL = Config(max_rows=100_000, seconds=5.0, warmup_s=1.0)
QUICK = Config(max_rows=5_000, seconds=1.0, warmup_s=0.3)
# Requests the in-process engine ranks its hot rows on before a point is timed: later draws
# of the point's distribution, not the timed requests.
RANKING_REQUESTS = 8


def pack_tables(directory: Path, max_rows: int) -> list[str]:
    """Write compressed ``cat_i`` and raw ``raw_cat_i`` tables; returns the feature names."""
    tables, features = {}, {}
    for i, name in enumerate(demo.feature_names()):
        rows = min(demo.DCNV2_CARDINALITIES[i], max_rows)
        raw = demo.demo_table(rows, demo.DIM, i, bf16_rounded=i % 4 == 3)
        tables[name] = compress(raw, sample_rows=min(rows, 65536))
        tables[f"raw_{name}"] = compress(raw, method="raw")
        features[name], features[f"raw_{name}"] = name, f"raw_{name}"
    save_table_set(directory, tables, features)
    return demo.feature_names()


def serve(tables: Path, workers: int) -> ServerProcess:
    """``ibpembed serve --tables DIR`` on a free port, CPU kernels, admission out of the way."""
    return ServerProcess(
        *("--tables", str(tables), "--workers", str(workers), "--device", "cpu"),
        *("--max-inflight", "1024", "--log-level", "warning"),
    )


class CpuSampler:
    """A process's CPU seconds, sampled on the ``time.monotonic()`` clock every ``every_s`` while
    running, so that the CPU of any span inside the sampling can be read afterwards."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._sample()
        self._thread.start()

    def _sample(self) -> None:
        self.samples.append((time.monotonic(), proc_cpu_seconds(self.pid)))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def between(self, start: float, end: float) -> float:
        """CPU seconds from ``start`` to ``end`` (monotonic), linear between samples."""
        self._stop.set()
        self._thread.join()
        self._sample()
        times, cpu = zip(*self.samples, strict=True)
        return float(np.interp(end, times, cpu) - np.interp(start, times, cpu))


def in_process(
    engine: LookupEngine, requests: list, workers: int, seconds: float, warmup_s: float
) -> dict:
    """QPS, latency and CPU per request of ``workers`` threads running ``engine.run`` back to
    back."""
    decoded = [decode_request(r) for r in requests]
    latencies: list[list[float]] = [[] for _ in range(workers)]
    cpu = CpuSampler(os.getpid())
    start = time.perf_counter()
    to_monotonic = time.monotonic() - start
    warm_from, stop_at = start + warmup_s, start + warmup_s + seconds

    def worker(w: int) -> None:
        i = w
        while (now := time.perf_counter()) < stop_at:
            features, pooling = decoded[i % len(decoded)]
            engine.run(features, pooling)
            if now >= warm_from:
                latencies[w].append(time.perf_counter() - now)
            i += workers

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = np.concatenate([np.asarray(x) for x in latencies]) * 1000.0
    return {
        "qps": lat.size / seconds,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "cpu_ms": (
            cpu.between(warm_from + to_monotonic, stop_at + to_monotonic) * 1000.0 / lat.size
            if lat.size
            else None
        ),
    }


def warm_hot_rows(target: str, features: list[str]) -> None:
    """Unmeasured load past the server's first hot-row refresh (FIRST_REFRESH_S after start),
    so that every measured point runs with its copies in place."""
    load = LoadConfig(
        target=target,
        concurrency=2,
        duration_s=FIRST_REFRESH_S + 2.0,
        warmup_s=0.0,
        batch_size=64,
        features=tuple(features),
        request_pool=8,
        deadline_ms=60_000,
        progress=False,
    )
    asyncio.run(run_load(load))


def run(cfg: Config, out: Path, workers: int, concurrency: int) -> dict:
    torch.set_num_threads(1)  # as the server runs (ServerConfig.torch_threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="ibpembed-bench-") as tmp:
        features = pack_tables(Path(tmp), cfg.max_rows)
        store = TableStore.load(tmp)
        # Both sides run the server's default hot-row policy (1 % of raw bytes per table).
        engine = LookupEngine(store, max_workers=1, hot_row_budget=DEFAULT_BUDGET)
        assert engine.hot_rows is not None
        server = serve(Path(tmp), workers)
        try:
            with store.acquire() as snap:
                rows = {f: snap.tables[f].num_rows for f in features}
            warm_hot_rows(server.target, features)
            for batch in BATCHES:
                for variant in ("compressed", "raw"):
                    names = features if variant == "compressed" else [f"raw_{f}" for f in features]
                    pool = 2 if batch >= 512 else 8
                    drawn = make_requests(
                        {n: rows[f] for n, f in zip(names, features, strict=True)},
                        batch_size=batch,
                        hotness=dict(
                            zip(names, hotness_for(features, "dcnv2").values(), strict=True)
                        ),
                        alpha=1.05,
                        pooling="sum",
                        count=pool + RANKING_REQUESTS,
                    )
                    # Rank this point's traffic first, as the server has ranked what it saw: on
                    # later draws of the same distribution, never on the timed requests.
                    requests = drawn[:pool]
                    for features_, pooling in map(decode_request, drawn[pool:]):
                        engine.run(features_, pooling)
                    engine.hot_rows.refresh()
                    local = in_process(engine, requests, workers, cfg.seconds, cfg.warmup_s)
                    load = LoadConfig(
                        target=server.target,
                        concurrency=concurrency,
                        duration_s=cfg.seconds,
                        warmup_s=cfg.warmup_s,
                        batch_size=batch,
                        features=tuple(names),
                        request_pool=pool,
                        deadline_ms=60_000,
                        progress=False,
                    )
                    server_cpu = CpuSampler(server.pid)
                    remote = asyncio.run(run_load(load))
                    window_cpu_s = server_cpu.between(*remote["window_monotonic_s"])
                    server_cpu_ms = window_cpu_s * 1000.0 / max(1, remote["ok"])
                    lat = remote["latency_ms"]
                    row = {
                        "batch": batch,
                        "tables": variant,
                        "grpc_qps": remote["qps"],
                        "grpc_p50_ms": lat.get("p50"),
                        "grpc_p99_ms": lat.get("p99"),
                        "grpc_errors": remote["errors"],
                        "inproc_qps": local["qps"],
                        "inproc_p50_ms": local["p50_ms"],
                        "inproc_p99_ms": local["p99_ms"],
                        "ratio": remote["qps"] / local["qps"] if local["qps"] else None,
                        "grpc_server_cpu_ms": server_cpu_ms,
                        "inproc_cpu_ms": local["cpu_ms"],
                        "response_mb": batch * len(features) * demo.DIM * 4 / 1e6,
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            server.stop()
            engine.close()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "config": cfg.__dict__ | {"workers": workers, "concurrency": concurrency},
        "command": " ".join(sys.argv),
        "results": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "service.json").write_text(json.dumps(report, indent=2))
    (out / "service.md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    """The table pasted into BENCHMARKS.md."""
    lines = [
        f"{report['date']}, {report['machine']}, torch {report['torch']}, "
        f"`{report['command']}` ({report['config']})",
        "",
        "| B | tables | gRPC QPS | gRPC p50 ms | gRPC p99 ms | in-process QPS | gRPC / in-process "
        "| server CPU ms / request | in-process CPU ms / request | CPU in-process / server "
        "| response MB | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        cpu_ratio = r["inproc_cpu_ms"] / r["grpc_server_cpu_ms"] if r["inproc_cpu_ms"] else None
        lines.append(
            f"| {r['batch']} | {r['tables']} | {r['grpc_qps']:.1f} | {_ms(r['grpc_p50_ms'])} "
            f"| {_ms(r['grpc_p99_ms'])} | {r['inproc_qps']:.1f} | {_ratio(r['ratio'])} "
            f"| {_ms(r['grpc_server_cpu_ms'])} | {_ms(r['inproc_cpu_ms'])} | {_ratio(cpu_ratio)} "
            f"| {r['response_mb']:.1f} | {r['grpc_errors'] or 'none'} |"
        )
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tables, 1 s per point")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--concurrency", type=int, default=None, help="default 2 x workers")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    report = run(cfg, args.out, args.workers, args.concurrency or 2 * args.workers)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
