# SPDX-License-Identifier: Apache-2.0
"""Proof of write access, on the registry itself over a real shm object: a nonce registers one
region of the caller, object and offset it was issued for, once, before it expires; a caller
holds a bounded number of them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from ibpembed.errors import PermissionDenied, ResourceExhausted
from ibpembed.server import regions
from ibpembed.server.regions import MAX_CHALLENGES_PER_OWNER, RegionRegistry
from ibpembed_client import SharedMemoryRegion


@pytest.fixture()
def shm() -> Iterator[SharedMemoryRegion]:
    with SharedMemoryRegion.create(f"/ibpembed-nonce-{uuid.uuid4().hex[:10]}", 1 << 16) as memory:
        yield memory


@pytest.fixture()
def registry() -> Iterator[RegionRegistry]:
    registry = RegionRegistry()
    yield registry
    registry.close()


def _proven(registry: RegionRegistry, shm: SharedMemoryRegion, owner: str, offset: int) -> bytes:
    nonce = registry.challenge(owner, shm.shm_name, offset)
    shm.write(offset, nonce)
    return nonce


def test_a_nonce_registers_once(registry, shm):
    nonce = _proven(registry, shm, "a", 0)
    registry.register("a", "r1", shm.shm_name, 0, 1024, nonce)
    with pytest.raises(PermissionDenied, match=r"^nonce"):
        registry.register("a", "r2", shm.shm_name, 0, 1024, nonce)
    assert [info.name for info in registry.list("a")] == ["r1"]


@pytest.mark.parametrize(
    ("owner", "offset"), [("b", 0), ("a", 4096)], ids=["another-caller", "another-offset"]
)
def test_a_nonce_is_for_its_caller_object_and_offset(registry, shm, owner, offset):
    nonce = _proven(registry, shm, "a", 0)
    shm.write(offset, nonce)
    with pytest.raises(PermissionDenied, match=r"^nonce"):
        registry.register(owner, "r", shm.shm_name, offset, 1024, nonce)


def test_an_expired_nonce_is_refused_and_makes_room(registry, shm, monkeypatch):
    monkeypatch.setattr(regions, "NONCE_TTL_S", 0.05)
    nonces = [_proven(registry, shm, "a", 0) for _ in range(MAX_CHALLENGES_PER_OWNER)]
    with pytest.raises(ResourceExhausted, match="outstanding"):
        registry.challenge("a", shm.shm_name, 0)
    registry.challenge("b", shm.shm_name, 0)  # another caller's quota is its own
    time.sleep(0.1)
    shm.write(0, nonces[-1])
    with pytest.raises(PermissionDenied, match="expired"):
        registry.register("a", "r", shm.shm_name, 0, 1024, nonces[-1])
    fresh = _proven(registry, shm, "a", 0)  # the expired ones no longer count
    registry.register("a", "r", shm.shm_name, 0, 1024, fresh)
