# SPDX-License-Identifier: Apache-2.0
"""Callers are isolated from each other and from other processes: a caller registers only shm it
can write (checked against another process's object by a caller in a process of its own, with
fewer rights than the server), refusals quote no byte of a region, and identities (and with
them region quotas) come from configured tokens only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from ibpembed.server.app import LookupServer
from ibpembed.server.config import ServerConfig
from ibpembed.server.regions import MAX_REGIONS_PER_OWNER
from ibpembed_client import LookupClient, LookupServiceError, RetryPolicy, SharedMemoryRegion
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc
from tests.engine.helpers import make_store
from tools.hostile import SECRET, victim_object

from .helpers import RunningServer

REPO = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the attacker drops to another user: needs root to start as"
)


@pytest.fixture()
def victim() -> Iterator[str]:
    """The shm name of another process's object holding SECRET (mode 0600, its user only)."""
    with victim_object() as name:
        yield name


def _attack(target: str, victim: str, token: str | None) -> dict[str, str]:
    command = [sys.executable, "-m", "reliability.shm_attacker", target, victim]
    if token is not None:
        command += ["--token", token]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=120, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_root
@pytest.mark.parametrize("auth", [False, True], ids=["no-auth", "token-auth"])
def test_another_process_shm_cannot_be_registered_read_or_written(victim, tmp_path, auth):
    settings = {}
    token = None
    if auth:  # the attacker holds a valid token of its own
        tokens = tmp_path / "tokens"
        tokens.write_text("frontend frontend-secret\nattacker attacker-secret\n")
        settings["auth_tokens_file"] = str(tokens)
        token = "attacker-secret"
    with RunningServer(make_store(), **settings) as server:
        outcome = _attack(server.target, victim, token)
    assert outcome == {
        "open_locally": "EACCES",  # it cannot write the object itself...
        "register_without_nonce": "FAILED_PRECONDITION",  # ...so the server does not for it
        "register_with_unwritten_nonce": "PERMISSION_DENIED",
        "register_with_nonce_in_own_object": "PERMISSION_DENIED",
        "register_with_nonce_for_own_object": "PERMISSION_DENIED",
        "read_through_lookup": "NOT_FOUND",
        "write_through_lookup": "NOT_FOUND",
        "regions_listed": "0",
    }
    with open("/dev/shm" + victim, "rb") as f:
        assert f.read(len(SECRET)) == SECRET


def test_refusals_quote_no_byte_of_a_region():
    """Inputs read from a region that the engine refuses (lengths that do not sum to the ids,
    ids out of range): the message names the field, never a value read from the region."""
    planted = 0x5EC2E7  # in the lengths, then in the ids
    name = f"/ibpembed-test-{uuid.uuid4().hex[:12]}"
    with (
        RunningServer(make_store()) as server,
        SharedMemoryRegion.create(name, 1 << 16) as shm,
        LookupClient(server.target, timeout=30, retry=RetryPolicy(max_attempts=1)) as client,
    ):
        client.register_region("in", shm)
        stub = lookup_pb2_grpc.EmbeddingLookupStub(grpc.insecure_channel(server.target))
        cases = {
            "features[0].lengths": (np.array([1], "<i8"), np.array([planted], "<i4")),
            "features[0].ids": (np.array([planted], "<i8"), np.array([1], "<i4")),
        }
        for field, (ids, lengths) in cases.items():
            end = shm.write(0, ids)
            shm.write(end, lengths)
            request = pb.LookupRequest(pooling=pb.POOLING_SUM)
            request.features.add(name="user")
            request.input_region.name = "in"
            request.input_region.num_ids.append(ids.size)
            request.input_region.batch_sizes.append(lengths.size)
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(field)
            for shown in (str(planted), hex(planted), str(planted - 1)):
                assert shown not in err.value.details()


def _register_many(client: LookupClient, shm: SharedMemoryRegion, prefix: str, count: int) -> int:
    """Register up to ``count`` 64-byte regions; returns how many the server took."""
    for i in range(count):
        try:
            client.register_region(f"{prefix}{i}", shm, offset=64 * i, byte_size=64)
        except LookupServiceError as err:
            assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            return i
    return count


def test_made_up_authorization_headers_are_one_anonymous_caller():
    """Without configured tokens the header names nobody: every caller is one identity, with one
    quota, however many headers it invents."""
    name = f"/ibpembed-test-{uuid.uuid4().hex[:12]}"
    with (
        RunningServer(make_store()) as server,
        SharedMemoryRegion.create(name, 1 << 16) as shm,
    ):
        taken = 0
        for header in range(4):  # each client a "new" identity on the old server
            with LookupClient(
                server.target, token=f"made-up-{header}", timeout=30, retry=RetryPolicy(1)
            ) as client:
                taken += _register_many(client, shm, f"h{header}-", MAX_REGIONS_PER_OWNER)
        assert taken == MAX_REGIONS_PER_OWNER
        with LookupClient(server.target, timeout=30) as plain:
            assert len(plain.list_regions()) == MAX_REGIONS_PER_OWNER
            assert plain.unregister_region() == MAX_REGIONS_PER_OWNER


def test_tokens_file_identities_are_isolated_and_share_a_server_wide_cap(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# frontends\nfe-a token-a\nfe-b token-b\n\nfe-c token-c\n")
    name = f"/ibpembed-test-{uuid.uuid4().hex[:12]}"
    with (
        RunningServer(make_store(), auth_tokens_file=str(tokens), max_regions=5) as server,
        SharedMemoryRegion.create(name, 1 << 16) as shm,
    ):
        clients = {
            who: LookupClient(server.target, token=f"token-{who}", timeout=30, retry=RetryPolicy(1))
            for who in "abc"
        }
        try:
            assert _register_many(clients["a"], shm, "a", 3) == 3
            assert _register_many(clients["b"], shm, "b", 3) == 2  # the server holds 5 now
            assert _register_many(clients["c"], shm, "c", 1) == 0
            # Each identity sees, uses and releases its own regions only.
            assert [r.name for r in clients["b"].list_regions()] == ["b0", "b1"]
            with pytest.raises(LookupServiceError) as err:
                clients["c"].unregister_region("a0")
            assert err.value.code == grpc.StatusCode.NOT_FOUND  # a's names are not c's
            assert clients["c"].unregister_region() == 0
            assert clients["a"].unregister_region() == 3
            assert _register_many(clients["c"], shm, "c", 1) == 1
        finally:
            for client in clients.values():
                client.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fe-a token-a\nfe-b token-a\n", r"tokens:2: this token is already given to 'fe-a'"),
        ("fe-a token-a\nfe-a token-b\n", r"tokens:2: identity 'fe-a' given twice"),
        ("fe-a\n", r"tokens:1: expected '<identity> <token>' \(1 fields\)"),
        ("anonymous token-a\n", r"tokens:1: 'anonymous' is reserved"),
    ],
)
def test_a_bad_tokens_file_stops_the_server_naming_the_line(tmp_path, text, message):
    tokens = tmp_path / "tokens"
    tokens.write_text(text)
    config = ServerConfig(port=0, auth_tokens_file=str(tokens)).validate()
    with pytest.raises(ValueError, match=message) as err:
        LookupServer(config, make_store())
    assert "token-a" not in str(err.value) and "token-b" not in str(err.value)
