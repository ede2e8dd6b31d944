# SPDX-License-Identifier: Apache-2.0
"""Live reloads of a served table set: a new manifest, SIGHUP, and bad sets that must not serve."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ibpembed.server.app import load_store
from ibpembed.server.config import ServerConfig
from ibpembed.server.metrics import ServerMetrics
from ibpembed.tables.format import TableFileError
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import MANIFEST, read_manifest
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableStore
from ibpembed_client import LookupClient
from tests.engine.helpers import RecordingObserver
from tests.metrics.helpers import free_port
from tests.server.helpers import DEMO_300, RunningServer
from tests.tables.helpers import flip_bit, section_ranges
from tools.serve_process import ServerProcess

ROWS, DIM = 300, 16


def weights(version: int) -> torch.Tensor:
    """Rows whose bits differ in every version (and row), so any stale row shows."""
    gen = torch.Generator().manual_seed(version)
    return torch.randn(ROWS, DIM, generator=gen) * 0.05


def pack(directory: Path, version: int) -> None:
    source = TableSource("emb", weights(version), feature_names=("item",))
    pack_table_set(directory, TableSet((source,)), sample_rows=None)


def served_rows(client: LookupClient, ids: list[int]) -> np.ndarray:
    return client.lookup({"item": [ids]}, pooling="none")["item"]


def assert_serves(client: LookupClient, version: int) -> None:
    ids = [0, 7, ROWS - 1, 7]
    expected = weights(version)[ids].numpy()
    assert served_rows(client, ids).view(np.uint32).tolist() == expected.view(np.uint32).tolist()


def wait_for_version(client: LookupClient, version: int, timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while client.describe_table("emb").version != version:
        assert time.monotonic() < give_up, f"version {version} never served"
        time.sleep(0.02)


def wait_until(condition, timeout: float = 30.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "condition never held"
        time.sleep(0.01)


def publish_corrupt(directory: Path, version: int, staging: Path) -> Path:
    """A bad deploy: a set whose table file has a flipped byte, published by its manifest."""
    pack(staging, version)
    entry = read_manifest(staging).tables["emb"]
    data = bytearray((staging / entry.file).read_bytes())
    data[200] ^= 0x10  # inside the section table / mask section: a checksum catches it
    (directory / entry.file).write_bytes(bytes(data))
    os.replace(staging / MANIFEST, directory / MANIFEST)  # atomic, like pack's own publish
    return directory / entry.file


def reload_samples(exposition: str) -> dict[tuple[str, str | None], float]:
    """(name, result label) -> value of the table-set reload metrics."""
    return {
        (sample.name, sample.labels.get("result")): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name.startswith("ibpembed_table_set_reload")
    }


@pytest.fixture
def table_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "set"
    pack(directory, 1)
    return directory


def test_a_new_manifest_is_served_without_a_restart(table_dir: Path) -> None:
    observer = RecordingObserver()
    with RunningServer(TableStore.load(table_dir), observer=observer, reload_poll_s=0.05) as srv:
        client = LookupClient(srv.target, timeout=30)
        assert_serves(client, 1)
        pack(table_dir, 2)
        wait_for_version(client, 2)
        assert_serves(client, 2)
        wait_until(lambda: "ok" in observer.reloads)  # reported just after the publication
        time.sleep(0.3)  # several more polls: the same manifest is not loaded again
        assert client.describe_table("emb").version == 2
        assert observer.reloads.count("ok") == 1 and "error" not in observer.reloads
        client.close()


def test_a_bad_set_keeps_the_old_version_serving_until_a_good_one_arrives(
    table_dir: Path, tmp_path: Path
) -> None:
    store = TableStore.load(table_dir)
    metrics = ServerMetrics(store, device="cpu")
    with RunningServer(store, observer=metrics, reload_poll_s=0.05) as srv:
        client = LookupClient(srv.target, timeout=30)

        def scrape() -> dict[tuple[str, str | None], float]:
            return reload_samples(generate_latest(metrics.registry).decode())

        give_up = time.monotonic() + 30
        while scrape()[("ibpembed_table_set_reloads_total", "unchanged")] < 1:  # first poll
            assert time.monotonic() < give_up
            time.sleep(0.02)

        bad_file = publish_corrupt(table_dir, 2, tmp_path / "staging")
        while scrape()[("ibpembed_table_set_reloads_total", "error")] < 1:
            assert time.monotonic() < give_up
            time.sleep(0.02)
        assert scrape()[("ibpembed_table_set_reload_failing", None)] == 1
        time.sleep(0.3)  # the watcher does not retry bytes that failed
        assert scrape()[("ibpembed_table_set_reloads_total", "error")] == 1
        assert client.describe_table("emb").version == 1
        assert_serves(client, 1)

        # SIGHUP's path retries at once and names the broken file.
        outcome = srv.run(srv.server.reloader.reload("test"))
        assert outcome.result == "error" and str(bad_file) in (outcome.error or "")
        assert_serves(client, 1)

        pack(table_dir, 3)  # the next good deploy heals it
        wait_for_version(client, 2)
        assert_serves(client, 3)
        wait_until(lambda: scrape()[("ibpembed_table_set_reloads_total", "ok")] == 1)
        sample = scrape()
        assert sample[("ibpembed_table_set_reload_failing", None)] == 0
        assert sample[("ibpembed_table_set_reloads_total", "ok")] == 1
        client.close()


def test_a_missing_table_set_is_an_error_not_an_empty_server(table_dir: Path) -> None:
    observer = RecordingObserver()
    with RunningServer(TableStore.load(table_dir), observer=observer, reload_poll_s=0) as srv:
        shutil.rmtree(table_dir)
        outcome = srv.run(srv.server.reloader.reload("test"))
        assert outcome.result == "error" and "no manifest" in (outcome.error or "")
        client = LookupClient(srv.target, timeout=30)
        assert_serves(client, 1)  # still mapped: the files' pages live as long as the mapping
        client.close()
    assert observer.reloads == ["error"]


def test_a_reload_gives_replaced_tables_fresh_hot_row_copies(table_dir: Path) -> None:
    store = TableStore.load(table_dir)
    with RunningServer(
        store, observer=RecordingObserver(), reload_poll_s=0, hot_tier="100%"
    ) as srv:
        client = LookupClient(srv.target, timeout=30)
        for _ in range(4):
            served_rows(client, [1, 2, 3, 1, 1, 2])
        srv.server.engine.tier.refresh()
        with store.acquire() as snap:
            assert snap.tables["emb"].hot is not None
        pack(table_dir, 2)
        outcome = srv.run(srv.server.reloader.reload("test"))
        assert outcome.result == "ok" and outcome.changed == ("emb",)
        with store.acquire() as snap:
            hot = snap.tables["emb"].hot
            assert hot is not None and 1 in hot.ids.tolist()
        assert_serves(client, 2)
        client.close()


def block_reloads(
    store: TableStore, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    """Make ``store.reload`` wait: returns (started, release), set when a reload begins and to
    let it go on."""
    original, started, release = store.reload, threading.Event(), threading.Event()

    def blocked_reload() -> bool:
        started.set()
        assert release.wait(60)
        return original()

    monkeypatch.setattr(store, "reload", blocked_reload)
    return started, release


def test_stopping_finishes_a_reload_in_progress_and_refuses_later_ones(
    table_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TableStore.load(table_dir)
    started, release = block_reloads(store, monkeypatch)
    observer = RecordingObserver()
    srv = RunningServer(store, observer=observer, reload_poll_s=0)
    pack(table_dir, 2)
    srv.loop.call_soon_threadsafe(srv.server.request_reload)  # what SIGHUP does
    assert started.wait(30)
    srv.loop.call_soon_threadsafe(srv.server.request_reload)  # queued behind it
    # Within the grace period the reload is waited for (a later one: test_lifecycle.py).
    stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(60), srv.loop)
    wait_until(lambda: not srv.server.state.accepting)  # stop() is under way
    release.set()
    stopping.result(60)
    srv.close_loop()
    assert store.version == 2 and observer.reloads == ["ok"]  # finished, and nothing after it


def test_the_watcher_retries_a_failure_that_may_pass(
    table_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TableStore.load(table_dir)
    original, failures = store.reload, [OSError(24, "Too many open files")]

    def flaky_reload() -> bool:
        if failures:
            raise failures.pop()
        return original()

    observer = RecordingObserver()
    with RunningServer(store, observer=observer, reload_poll_s=0.05) as srv:
        client = LookupClient(srv.target, timeout=30)
        wait_until(lambda: "unchanged" in observer.reloads)  # the start-up check
        monkeypatch.setattr(store, "reload", flaky_reload)
        pack(table_dir, 2)  # the same manifest is tried again at the next poll
        wait_for_version(client, 2)
        wait_until(lambda: "ok" in observer.reloads)  # reported just after the publication
        assert observer.reloads == ["unchanged", "error", "ok"]
        client.close()


def test_a_merging_pack_reloads_only_the_table_it_replaced(tmp_path: Path) -> None:
    directory = tmp_path / "two"
    other = TableSource("other", weights(7)[:50], feature_names=("user",))
    pack_table_set(directory, TableSet((other,)), sample_rows=None)
    pack(directory, 1)  # replaces the set: "emb" only
    assert set(read_manifest(directory).tables) == {"emb"}
    pack_table_set(directory, TableSet((other,)), sample_rows=None, merge=True)
    store = TableStore.load(directory)
    with store.acquire() as snap:
        kept = snap.tables["emb"]
    with RunningServer(store, observer=RecordingObserver(), reload_poll_s=0) as srv:
        new = TableSource("other", weights(8)[:50], feature_names=("user",))
        pack_table_set(directory, TableSet((new,)), sample_rows=None, merge=True)
        outcome = srv.run(srv.server.reloader.reload("test"))
        assert outcome.result == "ok" and outcome.changed == ("other",)
        with store.acquire() as snap:
            assert snap.tables["emb"] is kept  # not even mapped again
        client = LookupClient(srv.target, timeout=30)
        assert_serves(client, 1)
        rows = client.lookup({"user": [[3]]}, pooling="none")["user"]
        assert rows.view(np.uint32).tolist() == weights(8)[[3]].numpy().view(np.uint32).tolist()
        client.close()


def test_verify_payloads_refuses_a_set_whose_payload_is_corrupt(table_dir: Path) -> None:
    entry = read_manifest(table_dir).tables["emb"]
    path = table_dir / entry.file
    begin, _ = section_ranges(path)["payload"]
    flip_bit(path, begin + 100)
    assert load_store(ServerConfig(tables=str(table_dir))).version == 1  # payload not hashed
    with pytest.raises(TableFileError, match="payload"):
        load_store(ServerConfig(tables=str(table_dir), verify_payloads=True))


def test_sighup_reloads_a_serving_process(table_dir: Path) -> None:
    metrics_port = free_port()
    serve = ServerProcess(
        *DEMO_300,
        "--tables",
        str(table_dir),
        "--reload-poll-s",
        "0",
        "--metrics-port",
        str(metrics_port),
    )
    try:
        serve.wait_for("table set reloads on SIGHUP")
        client = LookupClient(serve.target, timeout=30)
        assert_serves(client, 1)
        pack(table_dir, 2)
        time.sleep(0.2)
        assert_serves(client, 1)  # no polling: nothing happens until the signal
        serve.proc.send_signal(signal.SIGHUP)
        serve.wait_for("version 2 published, tables changed: emb")
        assert_serves(client, 2)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            sample = reload_samples(r.read().decode())
        assert sample[("ibpembed_table_set_reloads_total", "ok")] == 1
        assert sample[("ibpembed_table_set_reloads_total", "error")] == 0
        assert sample[("ibpembed_table_set_reload_failing", None)] == 0
        client.close()
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(timeout=60) == 0
    finally:
        serve.kill()


def test_sighup_to_the_demo_server_is_harmless() -> None:
    serve = ServerProcess(*DEMO_300)
    try:
        serve.proc.send_signal(signal.SIGHUP)
        serve.wait_for("nothing to reload")
        client = LookupClient(serve.target, timeout=30)
        assert client.lookup({"cat_0": [[1, 2]]})["cat_0"].shape == (1, 128)
        client.close()
    finally:
        serve.kill()
