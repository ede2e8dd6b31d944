# SPDX-License-Identifier: Apache-2.0
"""Scraping ``/metrics`` over real HTTP, free loopback ports, and the Prometheus binaries."""

from __future__ import annotations

import shutil
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package `prometheus`: scripts/ci_install_prometheus.sh)",
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus not installed (Debian package `prometheus`: "
    "scripts/ci_install_prometheus.sh)",
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    """A loopback port nothing listens on right now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fetch(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def parse(text: str) -> Samples:
    """``{(sample name, labels): value}`` through prometheus_client's own text parser."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when the series does not exist (counters not yet touched)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
