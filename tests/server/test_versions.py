# SPDX-License-Identifier: Apache-2.0
"""Kept table-set versions: packs number what they publish, a server keeps the last K and serves
any of them on request, and a version it does not hold is a clear FAILED_PRECONDITION."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import MANIFEST, SHARD_MAP, TableSetError, read_manifest
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.shards import pack_shards
from ibpembed.tables.store import TableStore
from ibpembed_client import (
    VERSIONS_HELD_METADATA_KEY,
    LookupClient,
    LookupServiceError,
    RetryPolicy,
    build_request,
)
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc
from tests.metrics.helpers import fetch, free_port, parse, value
from tests.server.helpers import RunningServer
from tests.server.test_reload import ROWS, pack, weights
from tools.serve_process import ServerProcess

IDS = [0, 7, ROWS - 1]
NO_RETRY = RetryPolicy(max_attempts=1)


def rows_of(version: int) -> list[list[int]]:
    return weights(version)[IDS].numpy().view(np.uint32).tolist()


def served(client: LookupClient, table_version: int = 0) -> tuple[int, list[list[int]]]:
    result = client.lookup({"item": [IDS]}, pooling="none", table_version=table_version)
    return result.table_version, result["item"].view(np.uint32).tolist()


def test_every_pack_publishes_the_next_version(tmp_path: Path) -> None:
    directory = tmp_path / "set"
    for version in (1, 2, 3):
        pack(directory, version)
        assert read_manifest(directory).table_set_version == version
    source = TableSource("emb", weights(9), feature_names=("item",))
    with pytest.raises(TableSetError, match="versions only grow"):
        pack_table_set(directory, TableSet((source,)), table_set_version=3)
    pack_table_set(directory, TableSet((source,)), table_set_version=10)  # skipping is fine
    assert read_manifest(directory).table_set_version == 10
    assert TableStore.load(directory).version == 10


@pytest.mark.parametrize("bad", [0, -1, 1 << 64, "7", True, 1.5])
def test_a_malformed_manifest_version_is_refused(tmp_path: Path, bad: object) -> None:
    directory = tmp_path / "set"
    pack(directory, 1)
    body = json.loads((directory / MANIFEST).read_bytes())
    body["table_set_version"] = bad
    (directory / MANIFEST).write_text(json.dumps(body))
    with pytest.raises(TableSetError, match="table_set_version"):
        read_manifest(directory)


def test_a_sharded_pack_gives_every_shard_one_version(tmp_path: Path) -> None:
    source = TableSource("emb", weights(1), feature_names=("item",))
    for expected in (1, 2):
        reports = pack_shards(tmp_path, TableSet((source,)), 3)
        versions = {read_manifest(r.directory).table_set_version for r in reports}
        assert versions == {expected}
        assert json.loads((tmp_path / SHARD_MAP).read_bytes())["table_set_version"] == expected


def test_the_store_keeps_the_last_versions_and_numbers_them_once(tmp_path: Path) -> None:
    directory = tmp_path / "set"
    pack(directory, 1)
    store = TableStore.load(directory, keep_versions=2)
    assert store.versions_held() == (1,) and store.older_versions_bytes() == 0
    pack(directory, 2)
    assert store.reload()
    assert store.versions_held() == (1, 2) and store.older_versions_bytes() > 0
    with store.acquire(1) as old, store.acquire() as new:
        assert (old.version, new.version) == (1, 2)
        assert torch.equal(old.tables["emb"].decompress(), weights(1))
        assert torch.equal(new.tables["emb"].decompress(), weights(2))
    # The same rows packed again are a new version: the shards that did change must be able to
    # pin it, so this one must hold it too.
    source = TableSource("emb", weights(2), feature_names=("item",))
    pack_table_set(directory, TableSet((source,)), sample_rows=None)
    assert store.reload() and store.versions_held() == (2, 3)
    with store.acquire(3) as snap, store.acquire(2) as prev:
        assert snap.tables["emb"] is prev.tables["emb"]  # unchanged tables are shared
    assert store.older_versions_bytes() == 0  # ... and counted once
    assert not store.reload()  # nothing new: no version
    assert store.versions_held() == (2, 3)


def test_pinned_lookups_over_grpc(tmp_path: Path) -> None:
    directory = tmp_path / "set"
    pack(directory, 1)
    store = TableStore.load(directory, keep_versions=2)
    with RunningServer(store, reload_poll_s=0) as running:
        client = LookupClient(running.target, timeout=30, retry=NO_RETRY)
        assert client.versions_held() == (1,)
        pack(directory, 2)
        assert store.reload()
        assert client.versions_held() == (1, 2)
        assert served(client) == (2, rows_of(2))  # 0 = newest
        assert served(client, 2) == (2, rows_of(2))
        assert served(client, 1) == (1, rows_of(1))
        for missing in (3, (1 << 64) - 1):
            with pytest.raises(LookupServiceError) as info:
                served(client, missing)
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert f"version {missing} is not held here; versions held: 1, 2" in info.value.details
            assert info.value.versions_held == (1, 2)
        # The raw trailer, as a frontend in any language reads it.
        with grpc.insecure_channel(running.target) as channel, pytest.raises(grpc.RpcError) as raw:
            lookup_pb2_grpc.EmbeddingLookupStub(channel).Lookup(
                build_request({"item": [IDS]}, "none", table_version=3), timeout=30
            )
        assert (VERSIONS_HELD_METADATA_KEY, "1,2") in raw.value.trailing_metadata()
        # In a stream, the pinned request that cannot be served fails alone.
        requests = [
            build_request({"item": [IDS]}, "none", "a", table_version=1),
            build_request({"item": [IDS]}, "none", "b", table_version=9),
            build_request({"item": [IDS]}, "none", "c"),
        ]
        a, b, c = client.lookup_stream(requests)
        assert a.table_version == 1 and a["item"].view(np.uint32).tolist() == rows_of(1)
        assert b.error.code == grpc.StatusCode.FAILED_PRECONDITION and "1, 2" in b.error.details
        assert c.table_version == 2
        pack(directory, 3)
        assert store.reload()
        assert client.versions_held() == (2, 3)
        with pytest.raises(LookupServiceError, match="versions held: 2, 3"):
            served(client, 1)  # dropped: keep_versions 2
        client.close()


def test_keep_versions_setting_and_its_memory_metric(tmp_path: Path) -> None:
    directory = tmp_path / "set"
    pack(directory, 1)
    server = ServerProcess(
        "--tables",
        str(directory),
        "--keep-versions",
        "3",
        "--reload-poll-s",
        "0",
        "--metrics-port",
        str(free_port()),
    )
    try:
        client = LookupClient(server.target, timeout=30)
        for version in (2, 3, 4):
            pack(directory, version)
            server.proc.send_signal(1)  # SIGHUP: reload now
            server.wait_for(f"version {version} published")
        assert client.versions_held() == (2, 3, 4)
        assert served(client, 2) == (2, rows_of(2))
        samples = parse(fetch(f"http://127.0.0.1:{server.metrics_port}/metrics"))
        assert value(samples, "ibpembed_table_set_versions_held") == 3.0
        assert value(samples, "ibpembed_table_set_older_versions_bytes") > 0
        client.close()
    finally:
        server.stop()


def test_list_tables_reports_the_version_of_the_tables_it_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "set"
    pack(directory, 1)
    store = TableStore.load(directory, keep_versions=2)
    with RunningServer(store, reload_poll_s=0) as running:
        engine = running.server.engine
        describe = engine.describe

        def reload_after_describing(name: str | None = None):
            described = describe(name)
            pack(directory, 2)
            assert store.reload()  # a reload lands between the tables and the versions
            return described

        monkeypatch.setattr(engine, "describe", reload_after_describing)
        with grpc.insecure_channel(running.target) as channel:
            listed = lookup_pb2_grpc.EmbeddingLookupStub(channel).ListTables(
                pb.ListTablesRequest(), timeout=30
            )
        assert store.versions_held() == (1, 2)
        assert listed.table_version == 1 and tuple(listed.versions_held) == (1,)
        assert {t.version for t in listed.tables} == {1}
