# SPDX-License-Identifier: Apache-2.0
"""Start-up order: ports bound before the tables load, NOT_SERVING while they load, the metrics
port's probe paths, and the CUDA self-test's fallback.

The load is held open deterministically, without timing: the table set's ``manifest.json`` is a
named pipe, so the server blocks reading it until the test writes the real manifest into it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ibpembed.selftest import SelfTestFailed, choose_device, sample_ids, self_test
from ibpembed.server import demo
from ibpembed.server.app import load_store
from ibpembed.server.config import ServerConfig
from ibpembed.tables.manifest import MANIFEST
from ibpembed_client import LookupClient, LookupServiceError, RetryPolicy
from tests.engine.helpers import make_tables
from tests.metrics.helpers import fetch, free_port, parse, value
from tests.server.test_reload import assert_serves, pack
from tools.serve_process import IBPEMBED, ServerProcess

NO_RETRY = RetryPolicy(max_attempts=1)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture
def held_open(tmp_path: Path) -> Iterator[tuple[Path, bytes]]:
    """A packed set whose manifest is a named pipe; yields (directory, the manifest's bytes)."""
    directory = tmp_path / "set"
    pack(directory, 1)
    manifest = (directory / MANIFEST).read_bytes()
    (directory / MANIFEST).unlink()
    os.mkfifo(directory / MANIFEST)
    yield directory, manifest


def release(directory: Path, manifest: bytes) -> None:
    """Let the blocked load read its manifest (opening the pipe waits for the reader)."""
    with open(directory / MANIFEST, "wb") as pipe:
        pipe.write(manifest)


def test_not_serving_while_the_tables_load_then_serving(held_open) -> None:
    directory, manifest = held_open
    metrics_port = free_port()
    flags = ("--tables", str(directory), "--reload-poll-s", "0")
    server = ServerProcess(*flags, "--metrics-port", str(metrics_port), wait=False)
    try:
        target = server.wait_bound()
        base = f"http://127.0.0.1:{server.metrics_port}"
        client = LookupClient(target, timeout=30, retry=NO_RETRY)
        # Bound and answering, not serving: health, lookups, readiness and the loading gauge.
        assert not client.is_serving() and not client.is_serving("ibpembed.v1.EmbeddingLookup")
        with pytest.raises(LookupServiceError) as info:
            client.lookup({"item": [[0]]})
        assert info.value.code.name == "UNAVAILABLE" and "loading" in info.value.details
        assert http_status(f"{base}/healthz") == 200  # live
        assert http_status(f"{base}/readyz") == 503  # not ready
        samples = parse(fetch(f"{base}/metrics"))
        assert value(samples, "ibpembed_loading") == 1.0
        assert value(samples, "ibpembed_loading_progress_ratio") == 0.0
        # A second server on the same port fails at once, while the first still loads.
        busy = subprocess.run(
            [*IBPEMBED, "serve", "--port", str(server.port), "--metrics-port", "0", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert busy.returncode == 1 and "in use" in busy.stderr, busy.stderr
        assert not client.is_serving()

        threading.Thread(target=release, args=(directory, manifest), daemon=True).start()
        server.wait_listening()
        assert client.is_serving() and client.is_serving("ibpembed.v1.EmbeddingLookup")
        assert_serves(client, 1)
        assert http_status(f"{base}/readyz") == 200
        samples = parse(fetch(f"{base}/metrics"))
        assert value(samples, "ibpembed_loading") == 0.0
        assert value(samples, "ibpembed_loading_progress_ratio") == 1.0
        assert value(samples, "ibpembed_table_set_versions_held") == 1.0
        client.close()
    finally:
        if server.alive():
            os.close(os.open(directory / MANIFEST, os.O_RDWR))  # unblock a load still waiting
        server.stop()


def test_the_metrics_port_answers_only_its_paths(held_open) -> None:
    directory, manifest = held_open
    server = ServerProcess(
        "--tables", str(directory), "--metrics-port", str(free_port()), wait=False
    )
    try:
        server.wait_bound()
        base = f"http://127.0.0.1:{server.metrics_port}"
        for path in ("/", "/metrics/", "/health", "/favicon.ico", "/readyz/x"):
            assert http_status(base + path) == 404, path
        assert http_status(f"{base}/metrics") == 200  # the exposition answers during the load
        release(directory, manifest)
        server.wait_listening()
        assert http_status(f"{base}/readyz") == 200
        assert http_status(f"{base}/nope") == 404
    finally:
        if server.alive() and (directory / MANIFEST).is_fifo():
            os.close(os.open(directory / MANIFEST, os.O_RDWR))
        server.stop()


def test_sigterm_while_the_tables_load_exits_zero_and_frees_the_ports(held_open) -> None:
    directory, _ = held_open
    server = ServerProcess("--tables", str(directory), wait=False)
    target = server.wait_bound()
    assert server.stop() == 0
    assert "while loading the tables" in server.log() and "Traceback" not in server.log()
    assert not LookupClient(target, retry=NO_RETRY).is_serving(timeout=2)


# -- the CUDA self-test ----------------------------------------------------------------------------


def flipping_decoder(table, ids: torch.Tensor) -> torch.Tensor:
    """Stands in for the GPU: the CPU's rows with one bit of one row flipped."""
    rows = table.gather(ids).clone()
    rows.view(torch.uint8)[len(ids) // 2, 0] ^= 1
    return rows


def failing_decoder(table, ids: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_the_self_test_passes_for_an_exact_decoder_and_names_a_mismatch() -> None:
    tables = make_tables()
    report = self_test(tables, decode=lambda table, ids: table.gather(ids))
    assert report.passed and report.tables == len(tables)
    assert report.rows == sum(sample_ids(t.num_rows).numel() for t in tables.values())
    bad = self_test(tables, decode=flipping_decoder)
    assert not bad.passed and "differ from the CPU path" in bad.problem
    assert sample_ids(10).tolist() == list(range(10))
    spread = sample_ids(1_000_000, 64)
    assert spread[0] == 0 and spread[-1] == 999_999 and spread.unique().numel() == 64


@pytest.mark.parametrize("decoder", [flipping_decoder, failing_decoder])
def test_auto_falls_back_to_the_cpu_loudly_and_cuda_refuses(
    decoder, caplog: pytest.LogCaptureFixture
) -> None:
    tables = make_tables()
    with caplog.at_level(logging.ERROR, logger="ibpembed.selftest"):
        device = choose_device("auto", tables, cuda_present=lambda: True, decode=decoder)
    assert device.type == "cpu"
    assert any("CUDA SELF-TEST FAILED" in r.getMessage() for r in caplog.records)
    with pytest.raises(SelfTestFailed, match="CUDA self-test failed"):
        choose_device("cuda", tables, cuda_present=lambda: True, decode=decoder)
    exact = choose_device(
        "auto", tables, cuda_present=lambda: True, decode=lambda t, i: t.gather(i)
    )
    assert exact.type == "cuda"  # auto = CUDA when, and only when, the self-test passes
    assert choose_device("auto", tables, cuda_present=lambda: False).type == "cpu"
    assert choose_device("cpu", tables, cuda_present=lambda: True, decode=decoder).type == "cpu"


def test_device_cuda_without_a_gpu_exits_non_zero(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this checks the refusal without one")
    result = subprocess.run(
        [*IBPEMBED, "serve", "--port", "0", "--metrics-port", "0", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "--device cuda needs" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_demo_load_progress_counts_the_demo_tables():
    # The console's "loading: N/M tables" and the loading gauge: M is what the banner then says.
    seen: list[tuple[int, int]] = []
    config = ServerConfig(demo_max_rows=50, device="cpu").validate()
    store = load_store(config, lambda done, total: seen.append((done, total)))
    total = len(demo.feature_names())
    with store.acquire() as snap:
        assert len(snap.tables) == total
    assert seen == [(done, total) for done in range(total + 1)]
