# SPDX-License-Identifier: Apache-2.0
"""Service benchmark: what a frontend feels, against the floor of the stack and the engine.

    python -m benchmarks.service [--quick] [--out DIR] [--workers N] [--concurrency C]
    python -m benchmarks.service --handoff      # the measurement behind inline_max_ids

One run packs the 26 DLRM-DCNv2-profile demo tables (compressed, IBP) into a table set and
serves it with one ``ibpembed serve`` process, then measures, in this order:

* **health**: ``grpc.health.v1.Health/Check`` one at a time, the round trip of an empty RPC
  through the same Python client and grpc.aio server: the floor of the stack;
* for B in {1, 64, 512, 2048} x 26 features (DCNv2 pooling factors, Zipf ids with permuted hot
  rows, SUM pooling), each **one request at a time** and **at saturation** (``--concurrency``
  client threads back to back):

  - ``tcp_fp32``: ``LookupClient.lookup_request`` of prebuilt requests, fp32 values in the
    response (parsed by the client, as a frontend would);
  - ``tcp_bf16``: the same with ``output_dtype=BFLOAT16``;
  - ``shm``: the values written into a registered shared-memory region (one window per client
    thread), the response carrying shapes only; the client gets numpy views;
  - ``shm_io``: the same, and the ids and lengths too go through the region (the client copies
    them in before each request, which then carries feature names and counts only);
  - ``in_process``: ``LookupEngine.run`` on the same table files in this process (``--workers``
    threads at saturation), requests decoded as the server decodes them.

Each point reports QPS, p50 and p99, and for the gRPC paths the server process's CPU time per
answered request over the measured window (``/proc``: event loop, workers, grpc's threads and
the kernels together). Client and server share the machine, so on few cores the gRPC numbers are
pessimistic: the client's own parsing competes with the server for the same cores.

Both the server and the in-process engine run the default hot-row policy: an unmeasured load
takes the server past its first refresh, and the engine ranks later draws of each point's
distribution before it is timed. Results: DIR/service.json and DIR/service.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks._harness import RESULTS, run_metadata, settings, write_results
from ibpembed.codec import compress
from ibpembed.engine import LookupEngine
from ibpembed.engine.tier import FIRST_REFRESH_S
from ibpembed.engine_defaults import DEFAULT_TIER
from ibpembed.server import demo
from ibpembed.server.wire import decode_packed
from ibpembed.tables.pack import save_table_set
from ibpembed.tables.store import TableStore
from ibpembed_client import (
    LookupClient,
    LookupServiceError,
    OutputRegion,
    RetryPolicy,
    SharedMemoryRegion,
)
from ibpembed_client._registered import move_inputs_to_region
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.workload import DCNV2_CARDINALITIES, hotness_for, make_requests
from tools.serve_process import ServerProcess, proc_cpu_seconds

BATCHES = (1, 64, 512, 2048)
PATHS = ("tcp_fp32", "tcp_bf16", "shm", "shm_io", "in_process")
MB = 1 << 20


@dataclass(frozen=True)
class Config:
    """Sizes of one run; ``quick`` is the smoke-test size."""

    max_rows: int  # rows per demo table cap (DCNv2 cardinalities capped to it)
    seconds: float  # measured seconds per point
    warmup_s: float
    batches: tuple[int, ...] = BATCHES
    # Unmeasured load first, past the server's first hot-row refresh.
    warm_server_s: float = FIRST_REFRESH_S + 1.0


FULL = Config(max_rows=100_000, seconds=2.0, warmup_s=0.4)
QUICK = Config(max_rows=5_000, seconds=0.4, warmup_s=0.1)
# The smoke test's: every path and load at two batch sizes, no hot-row warm-up.
SMOKE = Config(max_rows=2_000, seconds=0.2, warmup_s=0.05, batches=(1, 64), warm_server_s=0.0)
# Requests the in-process engine ranks its hot rows on before a point is timed: later draws
# of the point's distribution, not the timed requests.
RANKING_REQUESTS = 8


def pack_tables(directory: Path, max_rows: int) -> list[str]:
    """Write the compressed demo tables; returns the feature names."""
    tables, features = {}, {}
    for i, name in enumerate(demo.feature_names()):
        rows = min(DCNV2_CARDINALITIES[i], max_rows)
        raw = demo.demo_table(rows, demo.DIM, i, bf16_rounded=i % 4 == 3)
        tables[name] = compress(raw, sample_rows=min(rows, 65536))
        features[name] = name
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


def timed(
    call: Callable[[int, int], object], threads: int, seconds: float, warmup_s: float
) -> dict:
    """``call(thread, i)`` back to back on ``threads`` threads: QPS, p50/p99 (ms) and errors of
    the calls that started inside the measured window, and that window (monotonic)."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    errors: list[dict[str, int]] = [{} for _ in range(threads)]
    start = time.monotonic()
    warm_from, stop_at = start + warmup_s, start + warmup_s + seconds

    def worker(t: int) -> None:
        i = 0
        while (began := time.monotonic()) < stop_at:
            try:
                call(t, i)
            except LookupServiceError as err:
                if began >= warm_from:
                    errors[t][err.code.name] = errors[t].get(err.code.name, 0) + 1
            else:
                if began >= warm_from:
                    latencies[t].append(time.monotonic() - began)
            i += 1

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    lat = np.concatenate([np.asarray(x) for x in latencies]) * 1000.0
    merged: dict[str, int] = {}
    for e in errors:
        for code, n in e.items():
            merged[code] = merged.get(code, 0) + n
    return {
        "qps": lat.size / seconds,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "requests": int(lat.size),
        "errors": merged,
        "window": (warm_from, stop_at),
    }


def _point(
    call: Callable[[int, int], object],
    threads: int,
    cfg: Config,
    server_pid: int | None,
) -> dict:
    """One measured point; with ``server_pid``, the server's CPU ms per answered request."""
    sampler = CpuSampler(server_pid if server_pid is not None else os.getpid())
    row = timed(call, threads, cfg.seconds, cfg.warmup_s)
    cpu_s = sampler.between(*row.pop("window"))
    row["cpu_ms_per_request"] = cpu_s * 1000.0 / row["requests"] if row["requests"] else None
    row["cpu_of"] = "server" if server_pid is not None else "benchmark process"
    return row


def _with_dtype(request: pb.LookupRequest, dtype: int) -> pb.LookupRequest:
    copy = pb.LookupRequest()
    copy.CopyFrom(request)
    copy.output_dtype = dtype
    return copy


def _with_window(request: pb.LookupRequest, window: OutputRegion) -> pb.LookupRequest:
    copy = pb.LookupRequest()
    copy.CopyFrom(request)
    copy.output_region.name = window.name
    copy.output_region.offset = window.offset
    copy.output_region.byte_size = window.byte_size
    return copy


def _calls(
    client: LookupClient,
    engine: LookupEngine,
    requests: list[pb.LookupRequest],
    shm: SharedMemoryRegion,
    slots: tuple[int, int],
    threads: int,
) -> dict[str, Callable[[int, int], object]]:
    """What one request of each path is: ``call(thread, i)``. Thread t owns bytes
    ``[t * slot, (t + 1) * slot)`` of the region: outputs first, then inputs."""
    pool = len(requests)
    slot, out_bytes = slots
    bf16 = [_with_dtype(r, pb.DTYPE_BFLOAT16) for r in requests]
    packed = [decode_packed(r) for r in requests]
    windows = [
        [_with_window(r, OutputRegion("bench", t * slot, out_bytes)) for r in requests]
        for t in range(threads)
    ]
    # (ids bytes, lengths bytes, request naming the region for both) per thread and request
    io = [
        [
            (
                b"".join(f.ids for f in r.features),
                b"".join(f.lengths for f in r.features),
                move_inputs_to_region(
                    _with_window(r, OutputRegion("bench", t * slot, out_bytes)),
                    client._regions,
                    "bench",
                    t * slot + out_bytes,
                ),
            )
            for r in requests
        ]
        for t in range(threads)
    ]

    def shm_io(t: int, i: int) -> object:
        ids, lengths, request = io[t][i % pool]
        start = t * slot + out_bytes
        shm.write(start, ids)  # a frontend copies each batch's inputs in
        shm.write(start + len(ids), lengths)
        return client.lookup_request(request)

    return {
        "tcp_fp32": lambda t, i: client.lookup_request(requests[i % pool]),
        "tcp_bf16": lambda t, i: client.lookup_request(bf16[i % pool]),
        "shm": lambda t, i: client.lookup_request(windows[t][i % pool]),
        "shm_io": shm_io,
        "in_process": lambda t, i: engine.run(packed[i % pool], "sum"),
    }


def _warm_server(client: LookupClient, requests: list[pb.LookupRequest], seconds: float) -> None:
    """Unmeasured load for ``seconds`` (past the server's first hot-row refresh)."""
    stop_at = time.monotonic() + seconds
    i = 0
    while time.monotonic() < stop_at:
        client.lookup_request(requests[i % len(requests)])
        i += 1


def run(cfg: Config, out: Path, workers: int, concurrency: int) -> dict:
    torch.set_num_threads(1)  # as the server runs (ServerConfig.torch_threads)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ibpembed-bench-") as tmp:
        features = pack_tables(Path(tmp), cfg.max_rows)
        store = TableStore.load(tmp)
        engine = LookupEngine(store, max_workers=1, hot_tier=DEFAULT_TIER)
        assert engine.tier is not None
        with store.acquire() as snap:
            rows = {f: snap.tables[f].num_rows for f in features}
        hotness = hotness_for(features, "dcnv2")
        server = serve(Path(tmp), workers)
        # One slot per client thread: a window for the largest response, then its inputs.
        biggest = max(cfg.batches) * len(features) * demo.DIM * 4 + len(features) * 64
        inputs = max(cfg.batches) * (8 * sum(hotness.values()) + 4 * len(features))
        slot = biggest + inputs
        shm = SharedMemoryRegion.create(
            f"/ibpembed-bench-{uuid.uuid4().hex[:8]}", concurrency * slot
        )
        client = LookupClient(
            server.target,
            timeout=120,
            retry=RetryPolicy(max_attempts=1),
            max_message_bytes=256 * MB,
        )
        try:
            client.register_region("bench", shm)
            warm = make_requests(
                rows, batch_size=64, hotness=hotness, alpha=1.05, pooling="sum", count=8, seed=99
            )
            _warm_server(client, warm, cfg.warm_server_s)
            health = health_pb2_grpc.HealthStub(client._channel(server.target))
            check = health_pb2.HealthCheckRequest()
            row = _point(lambda t, i: health.Check(check, timeout=30), 1, cfg, server.pid)
            results.append({"path": "health", "batch": 0, "load": "one", "concurrency": 1} | row)
            print(json.dumps(results[-1]), flush=True)
            for batch in cfg.batches:
                pool = 2 if batch >= 512 else 8
                drawn = make_requests(
                    rows,
                    batch_size=batch,
                    hotness=hotness,
                    alpha=1.05,
                    pooling="sum",
                    count=pool + RANKING_REQUESTS,
                )
                requests = drawn[:pool]
                for request in drawn[pool:]:  # rank this point's traffic, not the timed requests
                    packed = decode_packed(request)
                    assert packed is not None
                    engine.run(packed, "sum")
                engine.tier.refresh()
                calls = _calls(client, engine, requests, shm, (slot, biggest), concurrency)
                for load in ("one", "saturation"):
                    for path in PATHS:
                        local = path == "in_process"
                        threads = 1 if load == "one" else (workers if local else concurrency)
                        row = _point(calls[path], threads, cfg, None if local else server.pid)
                        results.append(
                            {
                                "path": path,
                                "batch": batch,
                                "load": load,
                                "concurrency": threads,
                                "response_mb": batch
                                * len(features)
                                * demo.DIM
                                * (2 if path == "tcp_bf16" else 4)
                                / 1e6,
                            }
                            | row
                        )
                        print(json.dumps(results[-1]), flush=True)
        finally:
            client.close()
            server.stop()
            shm.close()
            engine.close()
    report = {
        **run_metadata(" ".join(["python -m benchmarks.service", *sys.argv[1:]])),
        "config": cfg.__dict__ | {"workers": workers, "concurrency": concurrency},
        "results": results,
        "targets": targets(results),
    }
    write_results(out, "service", report, markdown(report))
    return report


def _find(results: list[dict], path: str, batch: int, load: str) -> dict | None:
    for r in results:
        if (r["path"], r["batch"], r["load"]) == (path, batch, load):
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def targets(results: list[dict]) -> dict:
    """The service targets (BENCHMARKS.md), computed from this run."""
    health = _find(results, "health", 0, "one") or {}
    one = _find(results, "tcp_fp32", 1, "one") or {}
    out: dict[str, dict] = {
        "b1_p50_vs_health_p50": {
            "value": _ratio(one.get("p50_ms"), health.get("p50_ms")),
            "target": "<= 2",
        },
        "b1_p99_vs_health_p99": {
            "value": _ratio(one.get("p99_ms"), health.get("p99_ms")),
            "target": "<= 3",
        },
    }
    inproc = _find(results, "in_process", 512, "saturation") or {}
    paths = (
        ("tcp_fp32", ">= 0.5"),
        ("tcp_bf16", ">= 0.5"),
        ("shm", ">= 0.85"),
        ("shm_io", ">= 0.85"),
    )
    for path, goal in paths:
        row = _find(results, path, 512, "saturation") or {}
        out[f"b512_{path}_vs_in_process_qps"] = {
            "value": _ratio(row.get("qps"), inproc.get("qps")),
            "cpu_ratio": _ratio(inproc.get("cpu_ms_per_request"), row.get("cpu_ms_per_request")),
            "target": goal,
        }
    big = [r for r in results if r["path"] in ("shm", "shm_io") and r["batch"] == 2048]
    out["b2048_shm"] = {
        "value": all(r["requests"] > 0 and not r["errors"] for r in big) if big else None,
        "target": "served with no message-size limit in the way",
    }
    return out


def markdown(report: dict) -> str:
    """The tables BENCHMARKS.md is generated from."""
    lines = [
        f"{report['date']}, {report['machine']}, torch {report['torch']}, "
        f"`{report['command']}` ({settings(report['config'])})",
        "",
        "| B | path | load | threads | QPS | p50 ms | p99 ms | CPU ms / request | CPU of "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['batch'] or '—'} | {r['path']} | {r['load']} | {r['concurrency']} "
            f"| {r['qps']:.1f} | {_fmt(r['p50_ms'])} | {_fmt(r['p99_ms'])} "
            f"| {_fmt(r['cpu_ms_per_request'])} | {r['cpu_of']} | {r['errors'] or 'none'} |"
        )
    lines += ["", "| target | measured | goal |", "|---|---|---|"]
    for name, t in report["targets"].items():
        value = t["value"]
        if isinstance(value, bool):
            shown = "yes" if value else "no"
        else:
            shown = "—" if value is None else f"{value:.2f}"
        if t.get("cpu_ratio") is not None:
            shown = f"{shown} (CPU {t['cpu_ratio']:.2f})"
        lines.append(f"| {_target_label(name)} | {shown} | {t['target']} |")
    return "\n".join(lines) + "\n"


_PATH_LABELS = {
    "tcp_fp32": "gRPC fp32 outputs",
    "tcp_bf16": "gRPC bf16 outputs",
    "shm": "outputs in shared memory",
    "shm_io": "ids and outputs in shared memory",
}


def _target_label(name: str) -> str:
    """A target's key (kept in the results) as a reader reads it."""
    if name.startswith("b1_p"):
        quantile = name.split("_")[1]
        return f"B=1 round trip {quantile} vs a health check's"
    if name.startswith("b512_") and name.endswith("_vs_in_process_qps"):
        path = name.removeprefix("b512_").removesuffix("_vs_in_process_qps")
        return f"B=512 QPS at saturation, {_PATH_LABELS.get(path, path)} vs in process"
    if name == "b2048_shm":
        return "B=2048 served through shared memory"
    return name


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def handoff(out: Path) -> list[dict]:
    """What a request's hand-off to a worker thread costs against its kernels, per B at 26
    features (the rule behind ``inline_max_ids``): engine.run on this thread, the same request
    through ``await engine.lookup`` on a worker, and the kernels' own time."""
    torch.set_num_threads(1)
    tables = demo.build()
    names = demo.feature_names()
    store = TableStore.from_tables(tables, {n: n for n in names})
    kernel_s: list[float] = []

    class Kernels:
        def kernels_done(self, pooling: str, calls: list) -> None:
            kernel_s.append(sum(c[3] for c in calls))

    engine = LookupEngine(store, max_workers=1, inline_max_ids=0, observer=Kernels())
    rows = {n: tables[n].num_rows for n in names}
    hotness = hotness_for(names, "dcnv2")
    report = []

    async def measure() -> None:
        for batch in (1, 2, 4, 8, 16, 32):
            drawn = make_requests(
                rows, batch_size=batch, hotness=hotness, alpha=1.05, pooling="sum", count=8
            )
            packed = [decode_packed(r) for r in drawn]
            direct, via_worker = [], []
            kernel_s.clear()
            for i in range(600):
                request = packed[i % 8]
                began = time.perf_counter()
                engine.run(request, "sum")
                direct.append(time.perf_counter() - began)
                began = time.perf_counter()
                await engine.lookup(request, "sum")
                via_worker.append(time.perf_counter() - began)
            d, w = np.median(direct[100:]) * 1e6, np.median(via_worker[100:]) * 1e6
            report.append(
                {
                    "batch": batch,
                    "ids": int(np.mean([p.ids.size for p in packed])),
                    "run_us": d,
                    "via_worker_us": w,
                    "handoff_us": w - d,
                    "kernel_us": float(np.median(kernel_s[200:])) * 1e6,
                }
            )
            print(json.dumps(report[-1]), flush=True)

    try:
        asyncio.run(measure())
    finally:
        engine.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "service_handoff.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tables, short points")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--handoff", action="store_true", help="measure the inline rule only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--concurrency", type=int, default=None, help="default 2 x workers")
    args = parser.parse_args(argv)
    if args.handoff:
        handoff(args.out)
        return 0
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    report = run(cfg, args.out, args.workers, args.concurrency or 2 * args.workers)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
