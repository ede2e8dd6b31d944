# SPDX-License-Identifier: Apache-2.0
"""Soak: saturating load on a real server for a minute; errors, memory, descriptors, latency.

    python -m reliability.soak [--duration 60] [--window 10] [--concurrency 8] [--json PATH]

``ibpembed serve`` (the embedded DLRM-DCNv2-profile demo set, ``--max-inflight`` below the load
generator's concurrency) is driven by ``ibpembed-loadgen``'s closed loop in back-to-back windows
of ``--window`` seconds, each on a fresh connection (so connection churn is part of the soak).
The server's RSS and open file descriptors are sampled every second from ``/proc``.

Pass criteria: no error other than RESOURCE_EXHAUSTED (the in-flight limit, by
design); the median RSS of the last window within 5 % of the second window's (the first is
warm-up); no more open descriptors once idle than before the load; p99 of the last window within
1.5x the first window's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from ibpembed_client.loadgen import LoadConfig, run_load
from reliability.common import settle
from tools.serve_process import ServerProcess

RSS_GROWTH_LIMIT = 0.05
P99_RATIO_LIMIT = 1.5


class Sampler:
    """Samples a process's RSS and descriptors every ``period_s`` on a thread."""

    def __init__(self, server: ServerProcess, period_s: float = 1.0) -> None:
        self.server = server
        self.period_s = period_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s) and self.server.alive():
            self.samples.append(
                {
                    "t": round(time.monotonic() - self._started, 1),
                    "rss": self.server.rss(),
                    "fds": self.server.fds(),
                }
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def soak(server: ServerProcess, args: argparse.Namespace) -> dict:
    """Run the windows against ``server`` and judge them."""
    idle_before = settle(server)
    sampler = Sampler(server)
    windows = []
    window_ends: list[int] = []  # samples taken by the end of each window
    for i in range(max(1, round(args.duration / args.window))):
        cfg = LoadConfig(
            target=server.target,
            concurrency=args.concurrency,
            duration_s=args.window,
            warmup_s=0.0,
            batch_size=args.batch_size,
            progress=False,
            seed=i,
        )
        cpu_before = server.cpu_seconds()
        report = asyncio.run(run_load(cfg))
        cpu_ms = 1000 * (server.cpu_seconds() - cpu_before)
        windows.append(
            {
                "window": i,
                "ok": report["ok"],
                "qps": round(report["qps"], 1),
                "errors": report["errors"],
                "latency_ms": {k: round(v, 2) for k, v in report["latency_ms"].items()},
                "rss_mib": round(server.rss() / 2**20, 1),
                "fds": server.fds(),
                # Server CPU per answered request: unlike latency, other work on a shared host
                # does not move it, so it shows whether the server itself slowed down.
                "server_cpu_ms_per_ok": round(cpu_ms / max(1, report["ok"]), 2),
                # Shared hosts: other work on the cores moves the percentiles, so say how busy.
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
        print(json.dumps(windows[-1]), flush=True)
        window_ends.append(len(sampler.samples))
    sampler.stop()
    idle_after = settle(server, 1.0)
    errors = Counter()
    for w in windows:
        errors.update(w["errors"])
    unexpected = {k: v for k, v in errors.items() if k != "RESOURCE_EXHAUSTED"}
    first, last = windows[0]["latency_ms"]["p99"], windows[-1]["latency_ms"]["p99"]

    # NOTE(soak): under load the server's RSS is a sawtooth (1-2 MiB/s up, back down by 15-40
    # MiB every 12-14 s), so two single samples differ by its phase: one run read +5.0 % from
    # the end of the first window to the idle end, and +0.9 % between the medians below. The
    # baseline is the second window's median (the first is warm-up), compared with the last
    # window's.
    def window_median(i: int) -> float:
        begin = window_ends[i - 1] if i > 0 else 0
        rss = [s["rss"] for s in sampler.samples[begin : window_ends[i]]]
        # The window's end reading too: windows shorter than the 1 s sampling period.
        return statistics.median([*rss, windows[i]["rss_mib"] * 2**20])

    rss_baseline = window_median(min(1, len(windows) - 1))
    rss_last = window_median(len(windows) - 1)
    rss_growth = (rss_last - rss_baseline) / rss_baseline
    verdict = {
        "requests_ok": sum(w["ok"] for w in windows),
        "errors": dict(errors),
        "unexpected_errors": unexpected,
        "server_alive": server.alive(),
        "rss_baseline_median_mib": round(rss_baseline / 2**20, 1),
        "rss_last_window_median_mib": round(rss_last / 2**20, 1),
        "rss_end_mib": round(idle_after[0] / 2**20, 1),
        "rss_peak_mib": round(max(s["rss"] for s in sampler.samples) / 2**20, 1),
        "rss_growth": round(rss_growth, 4),
        "fds_idle_before": idle_before[1],
        "fds_idle_after": idle_after[1],
        "fds_peak": max(s["fds"] for s in sampler.samples),
        "p99_first_window_ms": first,
        "p99_last_window_ms": last,
        "p99_ratio": round(last / first, 3),
        "server_cpu_ms_per_ok_first_last": [
            windows[0]["server_cpu_ms_per_ok"],
            windows[-1]["server_cpu_ms_per_ok"],
        ],
    }
    verdict["passed"] = bool(
        not unexpected
        and verdict["server_alive"]
        and rss_growth < RSS_GROWTH_LIMIT
        and idle_after[1] <= idle_before[1]
        and last <= P99_RATIO_LIMIT * first
    )
    return {"windows": windows, "verdict": verdict, "samples": sampler.samples}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load in all")
    p.add_argument("--window", type=float, default=10.0, help="seconds per measured window")
    p.add_argument("--concurrency", type=int, default=8, help="load generator's requests in flight")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=4,
        help="server admission limit; 2x its workers keeps queueing inside the deadline",
    )
    p.add_argument("--batch-size", type=int, default=64, help="samples per request")
    p.add_argument("--demo-max-rows", type=int, default=20000, help="rows per demo table")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    flags = [
        "--max-inflight",
        str(args.max_inflight),
        "--demo-max-rows",
        str(args.demo_max_rows),
        "--device",
        "cpu",
        "--log-level",
        "warning",
    ]
    started = time.perf_counter()
    with ServerProcess(*flags) as server:
        result = soak(server, args)
        result["verdict"]["server_exit_code_on_sigterm"] = server.stop()
    result = {
        "command": "python -m reliability.soak " + " ".join(sys.argv[1:] if argv is None else argv),
        "seconds": round(time.perf_counter() - started, 1),
        "settings": vars(args),
        **result,
    }
    print(json.dumps(result["verdict"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
