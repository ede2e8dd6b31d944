# SPDX-License-Identifier: Apache-2.0
"""A hung replica: two real ``ibpembed serve`` processes behind one ``ipv4:a,b`` target, one
stopped with SIGSTOP (it keeps its socket and connections, and answers nothing). Plain
``round_robin`` keeps sending it half the calls, each failing at its deadline; the client's
default outlier ejection takes it out of the balancing after the first seconds."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ibpembed.tables.pack import pack_table_set
from ibpembed_client import LookupClient, LookupServiceError, OutlierEjection, RetryPolicy
from ibpembed_client._options import channel_options
from tests.sharding.helpers import make_table_set
from tools.serve_process import ServerProcess

ROUND_ROBIN = [("grpc.lb_policy_name", "round_robin")]
TIMEOUT_S = 0.5  # a call to the stopped replica fails at this deadline
SETTLE_S = 3.0  # ejection is decided once a second (OutlierEjection.interval_s)
BOUND = 0.02  # share of calls failing after SETTLE_S (measured: 0 of ~8,000)


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[ServerProcess]]:
    pack_table_set(tmp_path, make_table_set(), sample_rows=None)
    processes = [
        ServerProcess("--tables", str(tmp_path), "--workers", "1", wait=False) for _ in range(2)
    ]
    try:
        for process in processes:
            process.wait_listening()
        yield processes
    finally:
        for process in processes:
            if process.alive():
                os.kill(process.pid, signal.SIGCONT)
            process.kill()


def failures_per_second(client: LookupClient, seconds: float) -> list[tuple[int, int]]:
    """(calls, failed calls) in each second of back-to-back lookups."""
    buckets: list[tuple[int, int]] = []
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        second = int(elapsed)
        while len(buckets) <= second:
            buckets.append((0, 0))
        calls, failed = buckets[second]
        try:
            client.lookup({"user": [[1, 2]]})
        except LookupServiceError:
            failed += 1
        buckets[second] = (calls + 1, failed)
    return buckets


def share(buckets: list[tuple[int, int]]) -> float:
    return sum(f for _, f in buckets) / max(1, sum(c for c, _ in buckets))


def test_a_stopped_replica_is_routed_around_after_the_first_seconds(replicas):
    target = "ipv4:" + ",".join(r.target for r in replicas)
    # The documented replica setup (round_robin named in channel_options) keeps the default
    # ejection; the control has it off.
    routed = LookupClient(target, timeout=TIMEOUT_S, channel_options=ROUND_ROBIN)
    plain = LookupClient(
        target, timeout=TIMEOUT_S, channel_options=ROUND_ROBIN, outlier_ejection=None
    )
    with routed, plain:
        for client in (routed, plain):  # both connected to both replicas
            for _ in range(20):
                client.lookup({"user": [[1]]})
        os.kill(replicas[0].pid, signal.SIGSTOP)
        buckets = failures_per_second(routed, 8.0)
        control = failures_per_second(plain, 3.0)
    settled = buckets[int(SETTLE_S) :]
    assert share(settled) <= BOUND, buckets
    assert sum(c for c, _ in settled) >= 100, buckets  # the live replica served them
    # Without ejection about half the calls keep failing: the replica really is hung.
    assert share(control) >= 0.3, control


def test_a_policy_named_in_channel_options_goes_under_the_ejection():
    """As a channel argument, ``grpc.lb_policy_name`` would replace the service config's
    balancing and silently drop the ejection."""
    named = [("grpc.lb_policy_name", "pick_first")]
    options = dict(channel_options(1024, None, RetryPolicy(), named, OutlierEjection()))
    assert "grpc.lb_policy_name" not in options
    config = json.loads(str(options["grpc.service_config"]))
    ejection = config["loadBalancingConfig"][0]["outlier_detection_experimental"]
    assert ejection["childPolicy"] == [{"pick_first": {}}]
    assert config["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    off = dict(channel_options(1024, None, RetryPolicy(), named, None))
    assert off["grpc.lb_policy_name"] == "pick_first"
    assert "loadBalancingConfig" not in json.loads(str(off["grpc.service_config"]))
