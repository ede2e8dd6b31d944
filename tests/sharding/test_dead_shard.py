# SPDX-License-Identifier: Apache-2.0
"""A dead shard fails only the requests that need it: three real shard processes, one killed
with SIGKILL, and a shard address where nothing listens. The clients keep asking the shards
which versions they hold (every ``version_refresh_s``), and a shard that stops answering must
not take the others down with it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from ibpembed_client import (
    AsyncShardedLookupClient,
    LookupServiceError,
    RetryPolicy,
    ShardedLookupClient,
    ShardMap,
)
from tests.metrics.helpers import free_port
from tests.sharding.conftest import Packed, serve
from tests.sharding.helpers import SHARDS
from tools.serve_process import ServerProcess

REFRESH_S = 0.2  # the pins go stale many times while a test runs
LIVE = {"user": [[10, 900]]}  # emb_f32 rows of shards 0 and 2
DEAD = {"user": [[400]]}  # a row of shard 1
NO_RETRY = RetryPolicy(max_attempts=1)


@pytest.fixture
def shard_processes(packed: Packed) -> Iterator[list[ServerProcess]]:
    processes = [serve(packed.sharded / f"shard-{k}-of-{SHARDS}") for k in range(SHARDS)]
    try:
        for process in processes:
            process.wait_listening()
        yield processes
    finally:
        for process in processes:
            process.kill()


def assert_dead_shard_error(err: LookupServiceError, address: str) -> None:
    assert err.code == grpc.StatusCode.UNAVAILABLE, err
    assert err.shard == 1
    assert err.details.startswith(f"shard 1 at {address} (emb_f32 rows [333, 666))"), err


def test_a_killed_shard_fails_only_the_requests_that_touch_it(shard_processes):
    """Before: once the pin went stale, every lookup failed (``shard=None``), [[10]] too."""
    shard_map = ShardMap.discover([p.target for p in shard_processes])
    address = shard_map.addresses[1]
    sync = ShardedLookupClient(shard_map, timeout=30, retry=NO_RETRY, version_refresh_s=REFRESH_S)

    async def run_async(async_client: AsyncShardedLookupClient, until: float) -> int:
        served = 0
        while time.monotonic() < until:
            assert (await async_client.lookup(LIVE))["user"].shape == (1, 16)
            with pytest.raises(LookupServiceError) as info:
                await async_client.lookup(DEAD)
            assert_dead_shard_error(info.value, address)
            served += 1
            await asyncio.sleep(REFRESH_S / 4)
        return served

    async def main() -> int:
        async with AsyncShardedLookupClient(
            shard_map, timeout=30, retry=NO_RETRY, version_refresh_s=REFRESH_S
        ) as async_client:
            assert (await async_client.lookup({"user": [[10, 400, 900]]}))["user"].shape == (1, 16)
            shard_processes[1].kill()
            return await run_async(async_client, time.monotonic() + 8 * REFRESH_S)

    with sync:
        assert sync.lookup({"user": [[10, 400, 900]]})["user"].shape == (1, 16)
        pinned = sync.pinned_version()
        served = asyncio.run(main())  # kills shard 1
        # Many refresh periods, each asking the dead shard again.
        give_up = time.monotonic() + 8 * REFRESH_S
        while time.monotonic() < give_up:
            assert sync.lookup(LIVE)["user"].shape == (1, 16)
            assert sync.lookup({"item": [[3]]}, pooling="none").table_version == pinned
            with pytest.raises(LookupServiceError) as info:
                sync.lookup(DEAD)
            assert_dead_shard_error(info.value, address)
            time.sleep(REFRESH_S / 4)
        # The dead shard keeps its last pin: the version a whole-map lookup is sent at.
        assert sync.pinned_version() == pinned
    assert served >= 4


def test_a_shard_that_never_answered_fails_only_the_requests_that_need_it(shard_processes):
    live = ShardMap.discover([p.target for p in shard_processes])
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens here
    addresses = list(live.addresses)
    addresses[1] = nobody
    shard_map = ShardMap(tuple(addresses), live.tables, live.features)

    def check(err: LookupServiceError) -> None:
        assert_dead_shard_error(err, nobody)
        assert "asked which table-set versions it holds" in err.details

    with ShardedLookupClient(
        shard_map, timeout=30, retry=NO_RETRY, version_refresh_s=REFRESH_S
    ) as client:
        for _ in range(3):
            with pytest.raises(LookupServiceError) as info:
                client.lookup(DEAD)
            check(info.value)
            assert client.lookup(LIVE)["user"].shape == (1, 16)
            time.sleep(REFRESH_S)
        with pytest.raises(LookupServiceError) as info:
            client.pinned_version(timeout=10)
        assert info.value.shard == 1 and info.value.details.startswith(f"shard 1 at {nobody}")

    async def main() -> None:
        async with AsyncShardedLookupClient(
            shard_map, timeout=30, retry=NO_RETRY, version_refresh_s=REFRESH_S
        ) as client:
            with pytest.raises(LookupServiceError) as info:
                await client.lookup(DEAD)
            check(info.value)
            assert (await client.lookup(LIVE))["user"].shape == (1, 16)

    asyncio.run(main())
