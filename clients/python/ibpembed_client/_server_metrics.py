# SPDX-License-Identifier: Apache-2.0
"""The server's side of a load run, read from its Prometheus exposition (``/metrics``).

Two scrapes, at the start and the end of the measured window, give per-request means of what
the server spent: the whole lookup (``ibpembed_lookup_duration_seconds``), the wait for a
kernel thread (``ibpembed_queue_wait_seconds``), the kernels (``ibpembed_kernel_duration_seconds``:
decode, pool and copy out, summed over a request's tables), the request's decoding and the
response's encoding in the servicer (``ibpembed_wire_duration_seconds{phase}``), and the rest of
the server's time (the engine's checks and planning, the hand-off to a worker thread and back,
waits for the event loop). What the client measured beyond the server's total is grpc's
receiving and sending on both sides, the network, and the client's own encoding and decoding.
The counters are the server's: other traffic in the window counts too.
"""

from __future__ import annotations

import math
import re
import urllib.request

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

LOOKUP = "ibpembed_lookup_duration_seconds"
QUEUE = "ibpembed_queue_wait_seconds"
KERNELS = "ibpembed_kernel_duration_seconds"
WIRE = "ibpembed_wire_duration_seconds"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> Samples:
    """``(name, labels) -> value`` of every sample in a text exposition (comments skipped)."""
    samples: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        samples[name, tuple(sorted(_LABEL.findall(labels)))] = float(value)
    return samples


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """The samples ``url`` (a server's ``/metrics``, http or https) serves now."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_exposition(response.read().decode())


def _delta(before: Samples, after: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def _total(samples: Samples, name: str, **where: str) -> float:
    """``name``'s samples summed over their labels (those with the ``where`` values only)."""
    wanted = set(where.items())
    return sum(v for (n, labels), v in samples.items() if n == name and wanted <= set(labels))


def histogram_quantile(q: float, samples: Samples, name: str) -> float:
    """The ``q`` quantile (0-1) of histogram ``name`` summed over its other labels, linearly
    interpolated inside a bucket as Prometheus's ``histogram_quantile`` does; NaN when empty."""
    cumulative: dict[float, float] = {}
    for (n, labels), value in samples.items():
        if n == f"{name}_bucket":
            le = float(dict(labels)["le"])
            cumulative[le] = cumulative.get(le, 0.0) + value
    edges = sorted(cumulative.items())
    if not edges or edges[-1][1] <= 0:
        return math.nan
    rank = q * edges[-1][1]
    lower, below = 0.0, 0.0
    for le, count in edges:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return lower


def server_split(before: Samples, after: Samples) -> dict:
    """Per-request server time over the window between two scrapes, in milliseconds."""
    delta = _delta(before, after)
    requests = _total(delta, f"{LOOKUP}_count")
    if requests <= 0:
        return {"requests": 0}
    total, queue, kernels = (
        1000.0 * _total(delta, f"{name}_sum") / requests for name in (LOOKUP, QUEUE, KERNELS)
    )
    # 0 from a server older than the histogram: its time stays in "other".
    decode, encode = (
        1000.0 * _total(delta, f"{WIRE}_sum", phase=phase) / requests
        for phase in ("decode", "encode")
    )
    return {
        "requests": int(requests),
        "mean_ms": {
            "total": total,
            "queue": queue,
            "kernels": kernels,
            "decode": decode,
            "encode": encode,
            "other": total - queue - kernels - decode - encode,
        },
        "p50_ms": 1000.0 * histogram_quantile(0.5, delta, LOOKUP),
        "p99_ms": 1000.0 * histogram_quantile(0.99, delta, LOOKUP),
    }
