# SPDX-License-Identifier: Apache-2.0
"""``ibpembed-loadgen``: drive a server with recommendation traffic and report latency.

Two load modes, as in perf_analyzer:

* **concurrency** (``--concurrency N``): N requests always in flight (closed loop). Finds the
  throughput the server sustains.
* **request rate** (``--rate R``): Poisson arrivals at R requests/s (open loop), bounded by
  ``--max-inflight``. Exposes queueing: latency grows as R nears capacity. Arrivals that find
  ``--max-inflight`` requests outstanding are counted as ``dropped``, not sent.

``--concurrency-range START:END:STEP`` and ``--request-rate-range START:END:STEP`` sweep the
load, one measured step per value (START, START+STEP, ... up to END, included when a step lands
on it), and print one row per step: the curve a team sizes with.

The warm-up (``--warmup`` seconds) runs first and is not measured; ``--requests N`` then
measures N requests (or ``--duration`` seconds, whichever ends first). A run that measured no
request exits 1.

Requests are prebuilt so generating ids costs nothing on the hot path: ``--request-pool``
distinct synthetic ones (Zipf ids, the DLRM-DCNv2 profile), or the recorded requests of
``--input-data`` (JSON lines, one request per line), cycled. Every request has a deadline
(``--deadline-ms``). Latencies go into a bounded histogram (1 % buckets: the memory of a run
does not grow with its length). The report gives p50, p90, p99, p99.9, mean and max latency
of successful requests, QPS and errors by status code; with ``--metrics-url`` (the server's
``/metrics``), the server's own split of the mean beside it (queue, kernels, request decoding,
response encoding, the rest); as JSON with ``--json`` and as a latency histogram with ``--png``
(needs matplotlib: the ``loadgen`` extra).

    ibpembed-loadgen --target 127.0.0.1:50051 --concurrency 16 --duration 10 --batch-size 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import ModuleType

import numpy as np

from ibpembed_client import __version__
from ibpembed_client._errors import LookupServiceError
from ibpembed_client._histogram import LatencyHistogram
from ibpembed_client._options import RetryPolicy, TlsOptions
from ibpembed_client._server_metrics import Samples, scrape, server_split
from ibpembed_client.aio import AsyncLookupClient
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.workload import hotness_for, make_requests, read_recorded


@dataclass(frozen=True)
class LoadConfig:
    """What to send and how. Exactly one of ``concurrency`` and ``rate`` is set."""

    target: str
    concurrency: int | None = None
    rate: float | None = None
    duration_s: float = 10.0
    warmup_s: float = 1.0
    max_requests: int | None = None
    batch_size: int = 64
    features: tuple[str, ...] = ()  # empty = every feature the server lists
    hotness: str = "dcnv2"
    zipf_alpha: float = 1.05
    pooling: str = "sum"
    deadline_ms: float = 5000.0
    max_inflight: int = 256
    request_pool: int = 16
    input_data: str | None = None  # recorded requests (JSON lines) instead of synthetic ones
    metrics_url: str | None = None  # the server's /metrics, for its side of the latency
    seed: int = 0
    token: str | None = None
    tls: TlsOptions | None = None
    progress: bool = True

    def validate(self) -> LoadConfig:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of --concurrency and --rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("--rate must be > 0")
        if self.batch_size < 1 or self.request_pool < 1 or self.max_inflight < 1:
            raise ValueError("--batch-size, --request-pool and --max-inflight must be >= 1")
        # urlopen would read file:// and other schemes too.
        if self.metrics_url is not None and not self.metrics_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(f"--metrics-url must be an http(s) URL, got {self.metrics_url!r}")
        return self


@dataclass
class _Tally:
    """Outcomes of requests that started after the warm-up."""

    latencies: LatencyHistogram = field(default_factory=LatencyHistogram)
    errors: Counter = field(default_factory=Counter)
    dropped: int = 0
    sent: int = 0  # started after the warm-up (what max_requests counts)
    samples: int = 0  # of the successful requests

    def add(
        self, started: float, warm_from: float, seconds: float, code: str | None, samples: int
    ) -> None:
        if started < warm_from:
            return
        if code is None:
            self.latencies.add(seconds)
            self.samples += samples
        else:
            self.errors[code] += 1


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total_s: float, enabled: bool) -> None:
        self.total_s, self.enabled = total_s, enabled and sys.stderr.isatty()

    def update(self, elapsed: float, tally: _Tally) -> None:
        if not self.enabled:
            return
        done = min(1.0, elapsed / self.total_s) if self.total_s else 1.0
        bar = "#" * int(done * 30)
        sys.stderr.write(
            f"\r[{bar:<30}] {elapsed:5.1f}/{self.total_s:.0f} s  ok {tally.latencies.count}"
            f"  errors {sum(tally.errors.values())}  dropped {tally.dropped}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def _prepare(client: AsyncLookupClient, cfg: LoadConfig) -> list[pb.LookupRequest]:
    rows = {}
    for table in await client.list_tables(timeout=30):
        for feature in table.features:
            rows[feature] = table.num_rows
    features = list(cfg.features) or sorted(rows, key=_natural_key)
    if cfg.input_data is not None:
        recorded = read_recorded(cfg.input_data, cfg.pooling)  # type: ignore[arg-type]
        features = sorted({f.name for r in recorded for f in r.features})
    unknown = [f for f in features if f not in rows]
    if unknown:
        raise ValueError(f"features not served by {cfg.target}: {unknown}")
    if cfg.input_data is not None:
        return recorded
    return make_requests(
        {f: rows[f] for f in features},
        batch_size=cfg.batch_size,
        hotness=hotness_for(features, cfg.hotness),
        alpha=cfg.zipf_alpha,
        pooling=cfg.pooling,  # type: ignore[arg-type]
        count=cfg.request_pool,
        seed=cfg.seed,
    )


def request_samples(request: pb.LookupRequest) -> int:
    """A request's samples: its largest feature batch (B, the int32 lengths), since features
    of one request may have different batch sizes (a variable-batch KJT)."""
    return max((len(f.lengths) // 4 for f in request.features), default=0)


def _natural_key(name: str) -> tuple:
    """cat_2 before cat_10, so the DCNv2 profile lines up with the demo's feature order."""
    head, _, tail = name.rpartition("_")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


async def run_load(cfg: LoadConfig) -> dict:
    """Run the load described by ``cfg`` and return the report (see :func:`summarize`)."""
    cfg.validate()
    # No retries: the load generator reports what the server answered.
    client = AsyncLookupClient(
        cfg.target, token=cfg.token, tls=cfg.tls, retry=RetryPolicy(max_attempts=1)
    )
    try:
        requests = await _prepare(client, cfg)
        # Recorded requests carry batches of their own sizes, not --batch-size.
        samples = [request_samples(r) for r in requests]
        tally = _Tally()
        loop = asyncio.get_running_loop()
        start = loop.time()
        warm_from = start + cfg.warmup_s
        stop_at = warm_from + cfg.duration_s
        timeout = cfg.deadline_ms / 1000.0
        progress = _Progress(cfg.warmup_s + cfg.duration_s, cfg.progress)

        def budget_left() -> bool:
            within = cfg.max_requests is None or tally.sent < cfg.max_requests
            return within and loop.time() < stop_at

        def count_start() -> None:
            if loop.time() >= warm_from:
                tally.sent += 1

        async def one(i: int) -> None:
            began = loop.time()
            code = None
            try:
                await client.lookup_request(requests[i], timeout=timeout)
            except LookupServiceError as err:
                code = err.code.name
            tally.add(began, warm_from, loop.time() - began, code, samples[i])

        async def closed_loop(worker: int) -> None:
            i = worker
            while budget_left():
                count_start()
                await one(i % len(requests))
                i += cfg.concurrency or 1

        async def open_loop() -> None:
            arrivals = random.Random(cfg.seed)
            inflight: set[asyncio.Task] = set()
            next_at, i = loop.time(), 0
            while True:
                next_at += arrivals.expovariate(cfg.rate or 1.0)
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                if not budget_left():
                    break
                if len(inflight) >= cfg.max_inflight:
                    if next_at >= warm_from:
                        tally.dropped += 1
                    continue
                count_start()
                task = asyncio.create_task(one(i % len(requests)))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                i += 1
            await asyncio.gather(*inflight)

        async def report_progress() -> None:
            while True:
                progress.update(loop.time() - start, tally)
                await asyncio.sleep(0.5)

        async def scrape_when_warm() -> Samples | None:
            if cfg.metrics_url is None:
                return None
            await asyncio.sleep(max(0.0, warm_from - loop.time()))
            return await asyncio.to_thread(scrape, cfg.metrics_url)

        ticker = asyncio.create_task(report_progress())
        before = asyncio.create_task(scrape_when_warm())
        if cfg.concurrency is not None:
            await asyncio.gather(*(closed_loop(w) for w in range(cfg.concurrency)))
        else:
            await open_loop()
        ticker.cancel()
        progress.update(loop.time() - start, tally)
        progress.close()
        window = (warm_from, min(loop.time(), stop_at))
        report = summarize(cfg, tally, window)
        scraped = await before
        if scraped is not None and cfg.metrics_url is not None:
            after = await asyncio.to_thread(scrape, cfg.metrics_url)
            report["server"] = server_split(scraped, after)
        return report
    finally:
        await client.close()


async def run_sweep(cfg: LoadConfig, values: Sequence[float]) -> list[dict]:
    """One :func:`run_load` per value, in order: the concurrency (``cfg.concurrency`` set) or
    the request rate (``cfg.rate`` set) of each step; each step warms up again."""
    steps = []
    for value in values:
        step = (
            replace(cfg, concurrency=int(value))
            if cfg.concurrency is not None
            else replace(cfg, rate=float(value))
        )
        steps.append(await run_load(step))
    return steps


def summarize(cfg: LoadConfig, tally: _Tally, window: tuple[float, float]) -> dict:
    """The JSON report: settings, counts, QPS, latency percentiles in milliseconds and the
    latency histogram (``histogram_ms``: non-empty 1 % buckets).

    ``window``: the measured span on the event loop's clock (``time.monotonic()``), reported so
    that other readings (a server's CPU time) can be taken over the same span.
    """
    measured_s = max(1e-9, window[1] - window[0])
    ok = tally.latencies.count
    return {
        # Never write a secret (token, TLS key) into a report.
        "config": asdict(cfg) | {"token": None, "tls": cfg.tls is not None},
        "mode": "concurrency" if cfg.concurrency is not None else "request_rate",
        "concurrency": cfg.concurrency,
        "rate": cfg.rate,
        "measured_s": measured_s,
        "window_monotonic_s": list(window),
        "ok": ok,
        "errors": dict(tally.errors),
        "dropped": tally.dropped,
        "qps": ok / measured_s,
        "samples": tally.samples,
        "samples_per_s": tally.samples / measured_s,
        "latency_ms": tally.latencies.summary_ms(),
        "histogram_ms": tally.latencies.to_json(),
    }


PNG_NEEDS = "--png needs matplotlib: pip install 'ibpembed-client[loadgen]'"


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(report: dict, path: str | Path) -> None:
    """Histogram of successful-request latency with the percentiles marked (matplotlib)."""
    try:
        plt = _pyplot()
    except ImportError as exc:
        raise SystemExit(PNG_NEEDS) from exc
    buckets = np.asarray(report["histogram_ms"]["buckets_ms"]).reshape(-1, 2)
    fig, ax = plt.subplots(figsize=(7, 4))
    if buckets.size:
        # The 1 % buckets regrouped into 60 log-spaced bars over the observed range.
        edges, counts = buckets[:, 0], buckets[:, 1]
        low = max(float(edges.min()), 1e-3)
        bins = np.logspace(np.log10(low), np.log10(float(edges.max()) * 1.02 + 1e-3), 60)
        ax.hist(np.maximum(edges, low), bins=bins, weights=counts)
        ax.set_xscale("log")
        for name, value in report["latency_ms"].items():
            if name.startswith("p"):
                ax.axvline(value, linestyle="--", linewidth=1)
                ax.text(value, ax.get_ylim()[1] * 0.9, name, rotation=90, fontsize=8)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("requests")
    ax.set_title(f"{_load_of(report)}: {report['qps']:.0f} QPS, {report['ok']} ok")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


DESCRIPTION = """\
Drive an ibpembed server with recommendation traffic and report latency, QPS and errors.

Load: --concurrency N keeps N requests in flight (closed loop); --rate R sends Poisson arrivals
at R requests/s (open loop). --concurrency-range and --request-rate-range sweep either, one
measured step per value. Requests are synthetic (Zipf ids, the DLRM-DCNv2 profile) or replayed
from --input-data. With --metrics-url, the server's own time per request (queue, kernels,
decode, encode, the rest) is printed beside the client's."""

EXAMPLES = """\
examples:
  ibpembed-loadgen --target 127.0.0.1:50051 --concurrency 16 --duration 10 --batch-size 512
  ibpembed-loadgen --concurrency-range 4:32:4 --duration 5 --metrics-url http://127.0.0.1:9464/metrics
  ibpembed-loadgen --request-rate-range 100:400:100 --max-inflight 64 --json sweep.json
  ibpembed-loadgen --input-data recorded.jsonl --concurrency 8   # one request per line:
      {"cat_0": [[1, 2], [3]], "cat_1": [[7]]}   (feature -> per-sample id lists)"""


def parse_range(text: str, kind: type[int] | type[float]) -> list[float]:
    """``START[:END[:STEP]]`` (perf_analyzer's form: START, START+STEP, ... up to END, included
    when a step lands on it; STEP 1 by default)."""
    parts = text.split(":")
    try:
        if not 1 <= len(parts) <= 3:
            raise ValueError
        start, end, step = (kind(p) for p in (*parts, *[parts[0], "1"][len(parts) - 1 :]))
    except ValueError:
        raise ValueError(f"expected START[:END[:STEP]], got {text!r}") from None
    if start <= 0 or step <= 0 or end < start:
        raise ValueError(f"need 0 < START <= END and STEP > 0, got {text!r}")
    count = int((end - start) / step + 1e-9) + 1
    return [start + i * step for i in range(count)]


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse ``type=`` taking a number > 0: anything else is a usage error (exit 2)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value > 0:  # nan too
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _writable(flag: str, path: str) -> str | None:
    """Why ``path`` cannot be written (None when it can), found by opening it as the run's
    end will, so a bad path fails before the load, not after it with the results lost."""
    target = Path(path)
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as exc:
        return f"{flag}: {exc}"
    if not existed:
        target.unlink()
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ibpembed-loadgen",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"ibpembed-loadgen {__version__}")
    p.add_argument("--target", default="127.0.0.1:50051", help="server host:port (%(default)s)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--concurrency",
        type=_positive(int),
        help="requests kept in flight, closed loop (the default, 8)",
    )
    mode.add_argument(
        "--rate", type=_positive(float), help="Poisson arrivals per second (open loop)"
    )
    mode.add_argument(
        "--concurrency-range",
        metavar="START:END:STEP",
        help="sweep the concurrency: START, START+STEP, ... up to END (END included when a step"
        " lands on it: 4:32:4 runs 4, 8, ..., 32; 1:32:2 stops at 31)",
    )
    mode.add_argument(
        "--request-rate-range",
        metavar="START:END:STEP",
        help="sweep the request rate (per second) the same way",
    )
    p.add_argument(
        "--duration", type=float, default=10.0, help="measured seconds per step (%(default)g)"
    )
    p.add_argument(
        "--warmup", type=float, default=1.0, help="seconds run before measuring (%(default)g)"
    )
    p.add_argument(
        "--requests",
        type=_positive(int),
        help="measure this many requests per step after the warm-up (unset: --duration alone)",
    )
    p.add_argument(
        "--batch-size", type=_positive(int), default=64, help="samples per request, B (%(default)s)"
    )
    p.add_argument("--features", default="", help="comma-separated features (all served)")
    p.add_argument(
        "--hotness", default="dcnv2", help="ids per sample: dcnv2 or an integer (%(default)s)"
    )
    p.add_argument(
        "--zipf-alpha", type=float, default=1.05, help="Zipf exponent of the ids (%(default)g)"
    )
    p.add_argument(
        "--input-data",
        metavar="FILE",
        help="replay recorded requests (JSON lines) instead of synthetic ones",
    )
    p.add_argument(
        "--pooling",
        choices=("sum", "mean", "none"),
        default="sum",
        help="how each sample's rows are combined (%(default)s)",
    )
    p.add_argument(
        "--deadline-ms", type=float, default=5000.0, help="per-request deadline, ms (%(default)g)"
    )
    p.add_argument(
        "--max-inflight",
        type=_positive(int),
        default=256,
        help="rate modes: outstanding cap (%(default)s)",
    )
    p.add_argument(
        "--request-pool",
        type=_positive(int),
        default=16,
        help="distinct synthetic requests (%(default)s)",
    )
    p.add_argument(
        "--metrics-url",
        metavar="URL",
        help="the server's /metrics (http://host:9464/metrics): its time per request",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic ids and arrivals (%(default)s)"
    )
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", help="bearer token (visible in ps: prefer --token-file)")
    token.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--tls-ca", help="PEM CA bundle: connect with TLS, trusting this CA")
    p.add_argument("--tls-cert", help="PEM client certificate (mTLS; with --tls-key)")
    p.add_argument("--tls-key", help="PEM client private key (mTLS)")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--png", help="write a latency histogram here (the last step's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _step_line(report: dict) -> str:
    lat = report["latency_ms"]
    line = (
        f"{_load_of(report)}: {report['ok']} ok in {report['measured_s']:.1f} s = "
        f"{report['qps']:.1f} QPS ({report['samples_per_s']:.0f} samples/s)\n"
        f"latency: {'  '.join(f'{k} {v:.2f} ms' for k, v in lat.items()) or 'none ok'}\n"
        f"errors: {report['errors'] or 'none'}  dropped: {report['dropped']}"
    )
    server = report.get("server")
    if server and server["requests"]:
        mean = server["mean_ms"]
        line += (
            f"\nserver ({server['requests']} requests): mean {mean['total']:.2f} ms = queue "
            f"{mean['queue']:.2f} + kernels {mean['kernels']:.2f} + decode {mean['decode']:.2f}"
            f" + encode {mean['encode']:.2f} + other {mean['other']:.2f} (planning, hand-off);"
            f" p50 {server['p50_ms']:.2f} p99 {server['p99_ms']:.2f} ms; client - server "
            f"{lat.get('mean', float('nan')) - mean['total']:.2f} ms (grpc, network, client)"
        )
    return line


def _sweep_table(steps: list[dict]) -> str:
    columns = ["load", "qps", "p50_ms", "p90_ms", "p99_ms", "p99.9_ms", "errors", "server_ms"]
    rows = []
    for r in steps:
        lat, server = r["latency_ms"], r.get("server") or {}
        split = server.get("mean_ms")
        rows.append(
            [
                _load_of(r),
                f"{r['qps']:.1f}",
                *(f"{lat[k]:.2f}" if k in lat else "-" for k in ("p50", "p90", "p99", "p99.9")),
                str(sum(r["errors"].values()) + r["dropped"]),
                "-"
                if not split
                else f"{split['total']:.2f} (q {split['queue']:.2f}, k {split['kernels']:.2f},"
                f" d+e {split['decode'] + split['encode']:.2f})",
            ]
        )
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        values = None
        if args.concurrency_range:
            values = parse_range(args.concurrency_range, int)
            args.concurrency = int(values[0])
        elif args.request_rate_range:
            values = parse_range(args.request_rate_range, float)
            args.rate = values[0]
    except ValueError as exc:
        print(f"ibpembed-loadgen: {exc}", file=sys.stderr)
        return 2
    if args.concurrency is None and args.rate is None:
        args.concurrency = 8
    if args.png:  # before the run, not after minutes of load
        try:
            _pyplot()
        except ImportError:
            print(f"ibpembed-loadgen: {PNG_NEEDS}", file=sys.stderr)
            return 2
    for flag, path in (("--json", args.json), ("--png", args.png)):
        problem = path and _writable(flag, path)
        if problem:
            print(f"ibpembed-loadgen: {problem}", file=sys.stderr)
            return 2
    token = args.token
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            print(f"ibpembed-loadgen: --token-file: {exc}", file=sys.stderr)
            return 2
    tls = None
    if args.tls_ca or args.tls_cert:
        pem: dict[str, bytes | None] = {}
        for flag, path in (("--tls-ca", args.tls_ca), ("--tls-key", args.tls_key),
                           ("--tls-cert", args.tls_cert)):  # fmt: skip
            try:
                pem[flag] = Path(path).read_bytes() if path else None
            except OSError as exc:
                print(f"ibpembed-loadgen: {flag}: {exc}", file=sys.stderr)
                return 2
        tls = TlsOptions(pem["--tls-ca"], pem["--tls-key"], pem["--tls-cert"])
    cfg = LoadConfig(
        target=args.target,
        concurrency=args.concurrency,
        rate=args.rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        max_requests=args.requests,
        batch_size=args.batch_size,
        features=tuple(f for f in args.features.split(",") if f),
        hotness=args.hotness,
        zipf_alpha=args.zipf_alpha,
        pooling=args.pooling,
        deadline_ms=args.deadline_ms,
        max_inflight=args.max_inflight,
        request_pool=args.request_pool,
        input_data=args.input_data,
        metrics_url=args.metrics_url,
        seed=args.seed,
        token=token,
        tls=tls,
        progress=not args.no_progress,
    )
    try:
        load = args.concurrency if args.concurrency is not None else args.rate
        steps = asyncio.run(run_sweep(cfg, values or [load]))
    except (ValueError, OSError, LookupServiceError) as exc:
        print(f"ibpembed-loadgen: {exc}", file=sys.stderr)
        return 2
    for report in steps:
        print(_step_line(report))
    if len(steps) > 1:
        print(_sweep_table(steps))
    if args.json:
        document = json.dumps(steps[0] if values is None else {"steps": steps}, indent=2)
        try:
            Path(args.json).write_text(document)
        except OSError as exc:  # checked before the run; a full disk can still refuse it
            print(f"ibpembed-loadgen: --json: {exc}; the report follows", file=sys.stderr)
            print(document)
            return 1
    if args.png:
        plot_latency(steps[-1], args.png)
    if any(r["ok"] + sum(r["errors"].values()) == 0 for r in steps):
        print(
            "ibpembed-loadgen: no request was measured: the run ended within the warm-up "
            "(--warmup longer than --duration?)",
            file=sys.stderr,
        )
        return 1
    return 0 if not any(r["errors"] for r in steps) else 1


def _load_of(report: dict) -> str:
    """``concurrency 16`` or ``rate 200/s``: the load a report measured."""
    if report["concurrency"] is not None:
        return f"concurrency {report['concurrency']}"
    return f"rate {report['rate']:g}/s"


if __name__ == "__main__":
    sys.exit(main())
