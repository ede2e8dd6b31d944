# SPDX-License-Identifier: Apache-2.0
"""Row shards with replicas: 2 shards x 2 replicas on loopback, each shard one gRPC target
(``ipv4:a,b``) balanced by ``round_robin``, as ``dns:///`` over a headless Service is in a
cluster. A replica killed with SIGKILL under load costs no lookup; a rolling reload under load
never mixes versions in one result."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from ibpembed.tables.importers import TableSet
from ibpembed.tables.manifest import shard_directory
from ibpembed.tables.shards import pack_shards
from ibpembed_client import (
    AsyncShardedLookupClient,
    LookupResult,
    LookupServiceError,
    ShardedLookupClient,
    ShardMap,
)
from tests.metrics.helpers import fetch, free_port, parse
from tests.sharding.helpers import make_table_set
from tools.serve_process import ServerProcess

SHARDS, REPLICAS = 2, 2
ROUND_ROBIN = [("grpc.lb_policy_name", "round_robin")]
# Rows of each feature's table looked up per request (pooling NONE: bit-exact rows back).
FEATURES = ("user", "item", "ctx", "quant")


def rows_by_feature(table_set: TableSet) -> dict[str, np.ndarray]:
    tables = {source.name: source for source in table_set.tables}
    return {
        feature: tables[table].weight.contiguous().view(torch.uint8).numpy()
        for feature, table in table_set.features().items()
    }


@dataclass
class Cluster:
    root: Path
    replicas: list[list[ServerProcess]]  # [shard][replica]

    def shard_map(self) -> ShardMap:
        targets = [
            "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in shard) for shard in self.replicas
        ]
        return ShardMap.load(self.root, targets)


def start(
    root: Path, keep_versions: int = 2, replicas: int = REPLICAS
) -> list[list[ServerProcess]]:
    servers = [
        [
            ServerProcess(
                "--tables",
                str(root / shard_directory(k, SHARDS)),
                "--keep-versions",
                str(keep_versions),
                "--reload-poll-s",
                "0",  # reloads on SIGHUP only: the test rolls them
                "--workers",
                "1",
                "--metrics-port",
                str(free_port()),
                wait=False,
            )
            for _ in range(replicas)
        ]
        for k in range(SHARDS)
    ]
    for shard in servers:
        for server in shard:
            server.wait_listening()
    return servers


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    pack_shards(tmp_path, make_table_set(0), SHARDS, sample_rows=None)
    replicas = start(tmp_path)
    try:
        yield Cluster(tmp_path, replicas)
    finally:
        for shard in replicas:
            for replica in shard:
                replica.kill()


@dataclass
class Load:
    """Threads looking up random rows of every feature until stopped, each result checked bit
    for bit against the rows of the version that says it served it."""

    client: ShardedLookupClient
    expected: dict[int, dict[str, np.ndarray]]  # version -> feature -> rows (bytes)
    threads: int = 4
    done: int = 0
    versions: list[int] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers = [
            threading.Thread(target=self._run, args=(seed,), daemon=True)
            for seed in range(self.threads)
        ]

    def __enter__(self) -> Load:
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=120)

    def wait_until(self, condition: Callable[[], bool]) -> None:
        """Block until ``condition()`` holds (the load going on meanwhile) or lookups fail."""
        while not self._stop.wait(0.02):
            with self._lock:
                if condition() or self.failures:
                    return

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        newest = self.expected[max(self.expected)]
        while not self._stop.is_set():
            ids = {f: rng.integers(0, newest[f].shape[0], 24).tolist() for f in FEATURES}
            try:
                result = self.client.lookup({f: [i] for f, i in ids.items()}, pooling="none")
            except BaseException as exc:
                with self._lock:
                    self.failures.append(exc)
                return
            problem = self._check(result, ids)
            with self._lock:
                self.done += 1
                self.versions.append(result.table_version)
                if problem:
                    self.mismatches.append(problem)

    def _check(self, result: LookupResult, ids: dict[str, list[int]]) -> str | None:
        rows = self.expected.get(result.table_version)
        if rows is None:
            return f"served from version {result.table_version}, never published"
        for feature, wanted in ids.items():
            got = np.ascontiguousarray(result[feature]).view(np.uint8).reshape(len(wanted), -1)
            if not np.array_equal(got, rows[feature][wanted]):
                return f"{feature}: rows differ from version {result.table_version}'s"
        return None


def requests_served(replica: ServerProcess) -> float:
    samples = parse(fetch(f"http://127.0.0.1:{replica.metrics_port}/metrics"))
    return sum(v for (name, _), v in samples.items() if name == "ibpembed_requests_total")


def test_a_replica_killed_under_load_costs_no_lookup(cluster: Cluster) -> None:
    expected = {1: rows_by_feature(make_table_set(0))}
    client = ShardedLookupClient(cluster.shard_map(), timeout=60, channel_options=ROUND_ROBIN)
    victim, survivor = cluster.replicas[0]
    with Load(client, expected) as load:
        load.wait_until(lambda: load.done >= 60)
        # round_robin spread shard 0's calls over both replicas: the victim was serving.
        assert requests_served(victim) > 0 and requests_served(survivor) > 0
        victim.kill()  # SIGKILL: no drain, connections reset mid-call
        before = requests_served(survivor)
        done_at_kill = load.done
        load.wait_until(lambda: load.done >= done_at_kill + 150)
    assert load.failures == [] and load.mismatches == []
    assert load.done >= done_at_kill + 150 and requests_served(survivor) > before
    assert set(load.versions) == {1}
    client.close()


def test_a_rolling_reload_under_load_never_mixes_versions(cluster: Cluster) -> None:
    expected = {1: rows_by_feature(make_table_set(0)), 2: rows_by_feature(make_table_set(1))}
    client = ShardedLookupClient(
        cluster.shard_map(), timeout=60, channel_options=ROUND_ROBIN, version_refresh_s=0.05
    )
    assert client.pinned_version() == 1
    with Load(client, expected) as load:
        load.wait_until(lambda: load.done >= 40)
        pack_shards(cluster.root, make_table_set(1), SHARDS, sample_rows=None)  # version 2
        # One replica at a time, as a rollout goes: meanwhile replicas of one shard disagree.
        for shard in cluster.replicas:
            for replica in shard:
                reloaded = load.done
                replica.proc.send_signal(signal.SIGHUP)
                replica.wait_for("version 2 published")
                load.wait_until(lambda reloaded=reloaded: load.done >= reloaded + 20)
        load.wait_until(lambda: load.versions.count(2) >= 40)
    assert load.failures == [] and load.mismatches == []
    assert set(load.versions) == {1, 2}
    assert client.pinned_version() == 2
    assert client.versions_held() == [(1, 2), (1, 2)]
    client.close()


def test_shards_without_a_common_version_fail_clearly(tmp_path: Path) -> None:
    pack_shards(tmp_path, make_table_set(0), SHARDS, sample_rows=None)
    replicas = start(tmp_path, keep_versions=1)
    try:
        pack_shards(tmp_path, make_table_set(1), SHARDS, sample_rows=None)
        shard_0 = replicas[0]
        for replica in shard_0:  # shard 0 moves to version 2 and drops 1; shard 1 stays at 1
            replica.proc.send_signal(signal.SIGHUP)
            replica.wait_for("version 2 published")
        cluster = Cluster(tmp_path, replicas)
        client = ShardedLookupClient(cluster.shard_map(), timeout=60, channel_options=ROUND_ROBIN)
        with pytest.raises(LookupServiceError) as info:
            client.lookup({"user": [[1, 999]]}, pooling="none")
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "hold no table-set version in common" in info.value.details
        assert "shard 0 at" in info.value.details and "holds [2]" in info.value.details
        assert "holds [1]" in info.value.details
        # Asked for a version one shard does not hold: that shard's refusal, naming it.
        with pytest.raises(LookupServiceError) as info:
            client.lookup({"user": [[1, 999]]}, pooling="none", table_version=1)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details.startswith("shard 0 at")
        assert "versions held: 2" in info.value.details
        # Rows of shard 1 alone are served at its version.
        assert client.lookup({"user": [[999]]}, pooling="none", table_version=1).table_version == 1
        client.close()
    finally:
        for shard in replicas:
            for replica in shard:
                replica.kill()


def test_two_publishes_between_asks_move_every_shard_to_the_newest_version(tmp_path: Path) -> None:
    """Two versions published before the clients ask again: every shard holds (2, 3), the pin
    says 1. Each shard's refusal narrows that shard's versions, and shards whose versions then
    have none in common with the others' are asked again at once: no request fails."""
    pack_shards(tmp_path, make_table_set(0), SHARDS, sample_rows=None)
    replicas = start(tmp_path, replicas=1)
    loop = asyncio.new_event_loop()  # the async clients' channels belong to one loop
    try:
        shard_map = Cluster(tmp_path, replicas).shard_map()
        settings = {"timeout": 60, "version_refresh_s": 3600}
        both, first = (ShardedLookupClient(shard_map, **settings) for _ in range(2))

        async def make() -> list[AsyncShardedLookupClient]:
            return [AsyncShardedLookupClient(shard_map, **settings) for _ in range(2)]

        async_both, async_first = loop.run_until_complete(make())
        pinned = [both.pinned_version(), first.pinned_version()]
        for client in (async_both, async_first):
            result = loop.run_until_complete(client.lookup({"user": [[1, 999]]}, "none"))
            pinned.append(result.table_version)
        assert pinned == [1, 1, 1, 1]
        for version, seed in ((2, 1), (3, 2)):
            pack_shards(tmp_path, make_table_set(seed), SHARDS, sample_rows=None)
            for [replica] in replicas:
                replica.proc.send_signal(signal.SIGHUP)
                replica.wait_for(f"version {version} published")
        assert both.versions_held() == [(2, 3), (2, 3)]
        # Both shards refuse version 1.
        assert both.lookup({"user": [[1, 999]]}, "none").table_version == 3
        result = loop.run_until_complete(async_both.lookup({"user": [[1, 999]]}, "none"))
        assert result.table_version == 3
        # Only shard 0 refuses; shard 1's stale (1,) then shares nothing with shard 0's (2, 3).
        assert first.lookup({"user": [[1]]}, "none").table_version == 3
        assert first.lookup({"user": [[1, 999]]}, "none").table_version == 3
        for ids in ([[1]], [[1, 999]]):
            result = loop.run_until_complete(async_first.lookup({"user": ids}, "none"))
            assert result.table_version == 3
        for client in (both, first):
            client.close()
        for client in (async_both, async_first):
            loop.run_until_complete(client.close())
    finally:
        loop.close()
        for shard in replicas:
            for replica in shard:
                replica.kill()
