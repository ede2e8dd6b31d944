# SPDX-License-Identifier: Apache-2.0
"""Start-up and shutdown edge cases: a busy port, SIGTERM during a reload, a reload watcher or
SIGHUP reload that fails."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ibpembed.server.app import LookupServer
from ibpembed.server.config import ServerConfig
from ibpembed.server.reload import TableSetReloader
from ibpembed.tables.manifest import MANIFEST
from ibpembed.tables.store import TableStore
from ibpembed_client import LookupClient
from tests.engine.helpers import RecordingObserver, make_store
from tests.metrics.helpers import free_port
from tests.server.helpers import DEMO_300, RunningServer
from tests.server.test_reload import block_reloads, pack, wait_until
from tools.serve_process import ServerProcess

T = TypeVar("T")


@pytest.fixture
def table_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "set"
    pack(directory, 1)
    return directory


class BackgroundLoop:
    """An event loop in a thread, for servers whose lifecycle a test drives itself."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


def refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


# -- a busy port -----------------------------------------------------------------------------------


def test_a_second_server_on_a_busy_port_fails_to_start() -> None:
    port = free_port()
    config = ServerConfig(port=port, workers=1, hot_tier="off", metrics_port=0).validate()
    background = BackgroundLoop()
    first = LookupServer(config, make_store())
    background.run(first.start())
    try:
        second = LookupServer(config, make_store())
        # grpc's SO_REUSEPORT would let it start and the kernel split connections between them.
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127\.0\.0\.1:{port}: .*in use"):
            background.run(second.start())
        client = LookupClient(f"127.0.0.1:{port}", timeout=30)
        assert client.is_serving()
        client.close()
    finally:
        background.run(first.stop(0))
        background.close()


# -- SIGTERM during a reload -----------------------------------------------------------------------


def test_stop_abandons_a_reload_still_running_when_the_grace_period_ends(
    table_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = TableStore.load(table_dir)
    started, release = block_reloads(store, monkeypatch)
    observer = RecordingObserver()
    srv = RunningServer(store, observer=observer, reload_poll_s=0)
    try:
        pack(table_dir, 2)
        srv.loop.call_soon_threadsafe(srv.server.request_reload)  # what SIGHUP does
        assert started.wait(30)
        with caplog.at_level(logging.WARNING, logger="ibpembed.server.app"):
            srv.run(srv.server.stop(0.2), timeout=30)  # returns with the reload still blocked
        assert not release.is_set()
        assert "abandoned" in caplog.text
        assert refuses_connections(srv.server.port)
        assert store.version == 1
        # Its thread runs on: what it publishes is the whole set, and it reports nothing.
        release.set()
        for thread in threading.enumerate():
            if thread.name == "ibpembed-reload":
                thread.join(30)
        srv.run(asyncio.sleep(0))  # callbacks from the thread have run
        assert store.version == 2 and observer.reloads == []
    finally:
        release.set()
        srv.close_loop()


def test_sigterm_during_a_reload_exits_zero_without_waiting_for_it(table_dir: Path) -> None:
    serve = ServerProcess(
        *DEMO_300, "--tables", str(table_dir), "--reload-poll-s", "0", "--metrics-port", "0",
        "--grace-s", "0.5", "--log-level", "debug",
    )  # fmt: skip
    try:
        serve.wait_for("table set reloads on SIGHUP")
        # A manifest that is a FIFO: the reload blocks reading it, for as long as the test likes.
        fifo = table_dir / ".manifest.fifo"
        os.mkfifo(fifo)
        os.replace(fifo, table_dir / MANIFEST)
        serve.proc.send_signal(signal.SIGHUP)
        serve.wait_for("(SIGHUP) started", timeout=60)
        serve.proc.send_signal(signal.SIGTERM)
        serve.wait_for("abandoned", timeout=60)
        assert serve.proc.wait(timeout=60) == 0
    finally:
        serve.kill()


# -- failing reload tasks --------------------------------------------------------------------------


class ExplodingObserver(RecordingObserver):
    """A metrics hook with a bug."""

    def reload_done(self, result: str) -> None:
        super().reload_done(result)
        raise RuntimeError("metrics bug")


def test_a_failing_metrics_hook_stops_neither_the_watcher_nor_sighup(
    table_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = TableStore.load(table_dir)
    observer = ExplodingObserver()
    with (
        caplog.at_level(logging.ERROR, logger="ibpembed.server"),
        RunningServer(store, observer=observer, reload_poll_s=0.05) as srv,
    ):
        wait_until(lambda: observer.reloads == ["unchanged"])  # the start-up check
        pack(table_dir, 2)
        wait_until(lambda: observer.reloads == ["unchanged", "ok"])
        assert store.version == 2
        pack(table_dir, 3)  # the watcher is still alive
        wait_until(lambda: observer.reloads == ["unchanged", "ok", "ok"])
        srv.loop.call_soon_threadsafe(srv.server.request_reload)
        wait_until(lambda: len(observer.reloads) == 4)
    assert store.version == 3 and observer.reloads[3] == "unchanged"
    logged = [r for r in caplog.records if r.exc_info and "metrics bug" in str(r.exc_info[1])]
    assert len(logged) == 4


def test_one_failed_check_does_not_end_the_watcher(
    table_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    original, calls = TableSetReloader._stamp, []

    def stamp_failing_once(self: TableSetReloader) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("stat bug")
        return original(self)

    monkeypatch.setattr(TableSetReloader, "_stamp", stamp_failing_once)
    observer = RecordingObserver()
    with (
        caplog.at_level(logging.ERROR, logger="ibpembed.server.reload"),
        RunningServer(TableStore.load(table_dir), observer=observer, reload_poll_s=0.05),
    ):
        wait_until(lambda: "unchanged" in observer.reloads)  # the next poll did the check
    assert "stat bug" in caplog.text and "watching on" in caplog.text


def test_stop_survives_a_watcher_that_failed(
    table_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken_watch(self: TableSetReloader) -> None:
        raise RuntimeError("watcher bug")

    monkeypatch.setattr(TableSetReloader, "_watch", broken_watch)
    srv = RunningServer(TableStore.load(table_dir), reload_poll_s=0.05)
    watcher = srv.server.reloader._task
    wait_until(lambda: watcher.done())
    with caplog.at_level(logging.ERROR, logger="ibpembed.server"):
        srv.stop()  # the whole shutdown runs: the gRPC server stops
    assert refuses_connections(srv.server.port)
    assert "watcher bug" in caplog.text


# The serving process itself, with a watcher that dies at once.
_BROKEN_WATCHER = """
import sys
from ibpembed.server.reload import TableSetReloader

async def _watch(self):
    raise RuntimeError("watcher bug")

TableSetReloader._watch = _watch
from ibpembed.cli import main

sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_after_the_watcher_failed_exits_zero(table_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _BROKEN_WATCHER, "serve", "--port", "0", "--metrics-port", "0",
         "--tables", str(table_dir), "--reload-poll-s", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "table set reloads" in line:  # the banner's end: signals are handled
                break
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0, stderr
    assert "watcher bug" in stderr and "ibpembed.server.app: stopped" in stderr
