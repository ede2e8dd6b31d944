# SPDX-License-Identifier: Apache-2.0
"""What an operator or a caller does to files the server reads: a served table file truncated
in place, a manifest nested past the recursion limit, input counts past int64."""

from __future__ import annotations

import mmap
import os
import signal
import time
import uuid
from pathlib import Path

import grpc
import pytest

from ibpembed.tables.manifest import MANIFEST, read_manifest
from ibpembed.tables.store import TableStore
from ibpembed_client import LookupClient, LookupServiceError, RetryPolicy, SharedMemoryRegion
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc
from tests.engine.helpers import RecordingObserver, make_store
from tests.server.test_reload import ROWS, assert_serves, pack
from tools.serve_process import ServerProcess

from .helpers import RunningServer

NO_RETRY = RetryPolicy(max_attempts=1)


def _until(condition, timeout: float = 30.0) -> bool:
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.02)
    return True


def _refused(client: LookupClient) -> grpc.StatusCode | None:
    try:
        client.lookup({"item": [list(range(ROWS))]}, pooling="none")
    except LookupServiceError as err:
        return err.code
    return None


def test_a_table_file_truncated_in_place_is_withdrawn_and_the_server_lives(tmp_path: Path):
    directory = tmp_path / "set"
    pack(directory, 1)
    path = directory / read_manifest(directory).tables["emb"].file
    original = path.read_bytes()
    flags = ("--tables", str(directory), "--reload-poll-s", "0.1", "--hot-tier", "off")
    with (
        ServerProcess(*flags) as server,
        LookupClient(server.target, timeout=30, retry=NO_RETRY) as client,
    ):
        os.truncate(path, len(original) // 2)  # what `truncate`, or `cp` over it, does first
        # Withdrawn at the next poll, then refused, never read (every row is past the end). No
        # lookup before: the first the server sees is of a withdrawn table.
        assert "withdrawn" in server.wait_for("table emb withdrawn", timeout=30)
        assert _refused(client) == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(LookupServiceError) as err:
            client.lookup({"item": [[0]]}, pooling="none")
        assert "withdrawn" in err.value.details and "changed size in place" in err.value.details
        assert server.alive() and client.is_serving()
        # The fix: the file published whole under a new inode, then a reload.
        staging = directory / "staging.tmp"
        staging.write_bytes(original)
        os.replace(staging, path)
        server.proc.send_signal(signal.SIGHUP)
        assert _until(lambda: _refused(client) is None)
        assert_serves(client, 1)
        assert server.alive()


@pytest.mark.parametrize("pooling", ["none", "sum"])
@pytest.mark.parametrize(
    ("cut", "why"),
    [
        # Whole pages past the new end: reading them raises SIGBUS, which the guard absorbs.
        (lambda size: size // 2 // mmap.PAGESIZE * mmap.PAGESIZE, "shortened in place"),
        # The page holding the new end reads zeros past it, with no fault: the corrupt rows
        # they decode to send the server to the file's stamp.
        (lambda size: size // 2 + 100, "changed size in place"),
    ],
    ids=["whole-pages", "mid-page"],
)
def test_lookups_reading_a_file_truncated_under_them_are_refused_and_the_server_lives(
    tmp_path: Path, pooling: str, cut, why: str
):
    """No poll (``--reload-poll-s 0``): the lookups alone find the truncation. The lookup that
    reads it, and every later one of the table, is refused: its rows may have read as zeros."""
    directory = tmp_path / "set"
    pack(directory, 1)
    path = directory / read_manifest(directory).tables["emb"].file
    flags = ("--tables", str(directory), "--reload-poll-s", "0", "--hot-tier", "off")
    with (
        ServerProcess(*flags) as server,
        LookupClient(server.target, timeout=30, retry=NO_RETRY) as client,
    ):
        assert_serves(client, 1)
        os.truncate(path, cut(path.stat().st_size))
        for ids in (list(range(ROWS)), [0]):  # every row, then a row before the new end
            with pytest.raises(LookupServiceError) as err:
                client.lookup({"item": [ids]}, pooling=pooling)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, server.log()
            assert why in err.value.details
        assert server.alive() and client.is_serving()
        # A table withdrawn on a corrupt read is logged once, as the poll logs it.
        assert server.log().count("table emb withdrawn") == (why == "changed size in place")


def test_a_manifest_nested_too_deep_is_rejected_once(tmp_path: Path):
    directory = tmp_path / "set"
    pack(directory, 1)
    observer = RecordingObserver()
    store = TableStore.load(directory)
    with RunningServer(store, observer=observer, reload_poll_s=0.05) as running:
        assert _until(lambda: observer.reloads == ["unchanged"])  # the start-up check
        staging = directory / f"{uuid.uuid4().hex}.tmp"
        staging.write_text("[" * 100_000 + "]" * 100_000)
        os.replace(staging, directory / MANIFEST)
        assert _until(lambda: len(observer.reloads) == 2)
        time.sleep(0.5)  # ten more polls: the same manifest is not tried again
        assert observer.reloads == ["unchanged", "error"]
        with LookupClient(running.target, timeout=30) as client:
            assert_serves(client, 1)


@pytest.mark.parametrize(
    "num_ids",
    [[2**62, 2**62], [2**62] * 4, [2**63 - 1, 1]],
    ids=["overflows", "wraps-to-zero", "one-past"],
)
def test_input_counts_past_int64_are_invalid_arguments(num_ids):
    name = f"/ibpembed-test-{uuid.uuid4().hex[:12]}"
    with (
        RunningServer(make_store()) as running,
        SharedMemoryRegion.create(name, 1 << 16) as shm,
        LookupClient(running.target, timeout=30, retry=NO_RETRY) as client,
    ):
        client.register_region("in", shm)
        request = pb.LookupRequest(pooling=pb.POOLING_SUM)
        for feature in ("user", "user_hist", "item", "ctx")[: len(num_ids)]:
            request.features.add(name=feature)
        request.input_region.name = "in"
        request.input_region.num_ids.extend(num_ids)
        request.input_region.batch_sizes.extend([1] * len(num_ids))
        stub = lookup_pb2_grpc.EmbeddingLookupStub(grpc.insecure_channel(running.target))
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("input_region.offset")
        assert client.lookup({"user": [[1]]})["user"].shape == (1, 16)


def test_a_table_with_a_hot_tier_is_withdrawn_too(tmp_path: Path):
    """A hot tier makes a new table object over the same mapped payload: the file check
    must still find it (in process, the check called directly: no lookup while it is stale)."""
    directory = tmp_path / "set"
    pack(directory, 1)
    path = directory / read_manifest(directory).tables["emb"].file
    store = TableStore.load(directory)
    with (
        RunningServer(store, hot_tier="100%", reload_poll_s=0) as running,
        LookupClient(running.target, timeout=30, retry=NO_RETRY) as client,
    ):
        for _ in range(20):
            client.lookup({"item": [[1, 2, 3, 4]]})
        assert running.server.engine.tier.refresh()["emb"] > 0
        with store.acquire() as snap:
            assert snap.tables["emb"].hot is not None  # another object than the one loaded
        os.truncate(path, path.stat().st_size // 2)
        assert set(store.check_files()) == {"emb"}
        assert _refused(client) == grpc.StatusCode.FAILED_PRECONDITION
        assert store.check_files() == {}  # withdrawn once
