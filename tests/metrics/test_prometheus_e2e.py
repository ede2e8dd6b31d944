# SPDX-License-Identifier: Apache-2.0
"""Debian's Prometheus server scrapes a running ``ibpembed serve`` on loopback.

The server is the real command (``--metrics-port``), the Prometheus server loads the project's
own alert rules, and the test reads a ``rate()`` and the recording rules back over Prometheus'
HTTP API.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from ibpembed_client import LookupClient, LookupServiceError, RetryPolicy
from tests.metrics.helpers import PROMETHEUS, fetch, free_port, needs_prometheus
from tests.server.helpers import DEMO_300
from tools.serve_process import ServerProcess

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ibpembed.json"
# Bounds on the test's own traffic and waiting (it stops by itself whatever happens).
MAX_REQUESTS = 5000
WAIT_S = 90.0


def query(base: str, promql: str) -> list[dict]:
    """Instant query result vector over Prometheus' HTTP API."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    body = json.loads(fetch(url))
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_until(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    give_up = time.monotonic() + timeout
    while not check():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def ready(base: str) -> bool:
    try:
        fetch(f"{base}/-/ready", timeout=2)
    except (urllib.error.URLError, ConnectionError):
        return False
    return True


@pytest.fixture
def prometheus_for(tmp_path):
    """Start Prometheus scraping a metrics port every second; yields its base URL."""
    procs: list[subprocess.Popen] = []
    log = (tmp_path / "prometheus.log").open("w")

    def start(metrics_port: int) -> str:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {
                    "job_name": "ibpembed",
                    "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        web = f"127.0.0.1:{free_port()}"
        procs.append(
            subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'data'}",
                    f"--web.listen-address={web}",
                    "--log.level=warn",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        )
        return f"http://{web}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)
    log.close()


@needs_prometheus
def test_prometheus_scrapes_serve_and_reads_a_rate(prometheus_for):
    metrics_port = free_port()
    server = ServerProcess(*DEMO_300, "--metrics-port", str(metrics_port))
    stop = threading.Event()
    sent = {"ok": 0, "not_found": 0}

    def traffic() -> None:
        client = LookupClient(server.target, timeout=30, retry=RetryPolicy(max_attempts=1))
        for i in range(MAX_REQUESTS):
            if stop.is_set():
                break
            if i % 10 == 9:
                try:
                    client.lookup({"no_such_feature": [[1]]})
                except LookupServiceError:
                    sent["not_found"] += 1
            else:
                client.lookup({"cat_0": [[1, 2], [3]], "cat_1": [[i % 100]]})
                sent["ok"] += 1
            time.sleep(0.01)
        client.close()

    sender = threading.Thread(target=traffic, daemon=True)
    try:
        base = prometheus_for(metrics_port)
        # Bound before the tables loaded, so printed before the banner the process waited for.
        assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in server.log()
        sender.start()
        wait_until(lambda: ready(base), "prometheus ready")

        def rate_positive() -> bool:
            result = query(
                base, 'sum(rate(ibpembed_requests_total{job="ibpembed", code="OK"}[5s]))'
            )
            return bool(result) and float(result[0]["value"][1]) > 0

        wait_until(rate_positive, "a positive request rate")
        up = query(base, 'up{job="ibpembed"}')
        assert [float(r["value"][1]) for r in up] == [1.0]

        def recorded() -> bool:
            return bool(query(base, 'ibpembed:requests:rate5m{code="NOT_FOUND"} > 0')) and bool(
                query(base, 'ibpembed:lookups:rate5m{method="Lookup", pooling="sum"} > 0')
            )

        wait_until(recorded, "the recording rules to see the traffic")
        # The dashboard's server-error ratio reads 0 (not "No data"): the traffic has client
        # errors (NOT_FOUND) and no server-side one, so its error series does not exist.
        dashboard = json.loads(DASHBOARD.read_text())
        (panel,) = [p for p in dashboard["panels"] if p["title"] == "Server-side error ratio"]
        expr = panel["targets"][0]["expr"]
        for variable, value in (("$job", "ibpembed"), ("$instance", ".*")):
            expr = expr.replace(variable, value)
        ratio = query(base, expr.replace("$__rate_interval", "5s"))
        assert [float(r["value"][1]) for r in ratio] == [0.0]
        # The per-request split: every part reads a time, and the parts fit in the total.
        (panel,) = [p for p in dashboard["panels"] if p["title"].startswith("Server time per")]
        means = {}
        for target in panel["targets"]:
            expr = target["expr"].replace("$job", "ibpembed").replace("$instance", ".*")
            (result,) = query(base, expr.replace("$__rate_interval", "5s"))
            means[target["legendFormat"]] = float(result["value"][1])
        parts = ("queue", "kernels", "decode", "encode")
        assert all(means[part] > 0 for part in ("kernels", "decode", "encode")), means
        assert means["queue"] >= 0  # 0, not "No data", when every request ran inline
        assert sum(means[part] for part in parts) <= means["total"], means
        build = query(base, "ibpembed_build_info")
        assert build[0]["metric"]["device"] == "cpu"
        rules = json.loads(fetch(f"{base}/api/v1/rules"))["data"]["groups"]
        for group in rules:
            for rule in group["rules"]:
                assert rule["health"] == "ok", rule
    finally:
        stop.set()
        if sender.is_alive():
            sender.join(timeout=60)
        server.kill()
    # Prometheus' last scraped count of OK lookups: some, and no more than the test sent.
    counted = query(base, 'max_over_time(ibpembed_requests_total{code="OK"}[1m])')
    assert 0 < float(counted[0]["value"][1]) <= sent["ok"]
    assert sent["not_found"] > 0
