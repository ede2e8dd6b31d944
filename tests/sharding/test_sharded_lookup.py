# SPDX-License-Identifier: Apache-2.0
"""Three shard server processes against one server holding everything, same requests."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from ibpembed import reference
from ibpembed_client import (
    AsyncShardedLookupClient,
    FeatureBatch,
    LookupClient,
    LookupServiceError,
    RetryPolicy,
    ShardedLookupClient,
    ShardedTable,
    ShardMap,
    ShardRange,
    bf16_to_float32,
    build_request,
)
from tests.engine.helpers import GateObserver, make_store
from tests.server.helpers import RunningServer
from tests.sharding.helpers import FEATURES, SHARDS, values_of

BATCH = 48
POOLINGS = ["sum", "mean"]


def table_rows(packed) -> dict[str, int]:
    return {s.name: s.weight.shape[0] for s in packed.table_set.tables}


def make_batches(packed, seed: int, weighted: bool) -> dict[str, FeatureBatch]:
    """Ids over every shard's range, empty bags, and ids repeated within and across shards."""
    rng = np.random.default_rng(seed)
    rows = table_rows(packed)
    batches = {}
    for feature, table in FEATURES.items():
        n = rows[table]
        samples = [
            rng.integers(0, n, 0 if b % 5 == 0 else rng.integers(1, 7)) for b in range(BATCH)
        ]
        samples[1] = np.array([0, n - 1, 0, n // 2, n - 1])  # every edge row, twice
        ids = np.concatenate(samples).astype(np.int64)
        lengths = np.array([s.size for s in samples], dtype=np.int32)
        weights = rng.uniform(-2, 2, ids.size).astype(np.float32) if weighted else None
        batches[feature] = FeatureBatch(ids, lengths, weights)
    return batches


@pytest.fixture(scope="module")
def shard_map(servers) -> ShardMap:
    return ShardMap.discover(servers.shards)


@pytest.fixture(scope="module")
def clients(servers, shard_map):
    with LookupClient(servers.whole) as single, ShardedLookupClient(shard_map) as sharded:
        yield single, sharded


def test_describe_table_reports_each_shards_range(servers):
    with LookupClient(servers.shards[1]) as shard, LookupClient(servers.whole) as single:
        info = shard.describe_table("emb_f32")
        whole = single.describe_table("emb_f32")
    assert (info.num_rows, info.row_start, info.row_end) == (1000, 333, 666)
    assert (whole.num_rows, whole.row_start, whole.row_end) == (1000, 0, 1000)


def test_discovered_map_equals_the_packed_file(packed, servers, shard_map):
    from_file = ShardMap.load(packed.sharded, servers.shards)
    assert shard_map.tables == from_file.tables
    assert dict(shard_map.features) == dict(from_file.features)


def test_shard_rejects_ids_outside_its_range_naming_it(servers):
    with LookupClient(servers.shards[1]) as client, pytest.raises(LookupServiceError) as err:
        client.lookup({"user": [[100, 400]]}, pooling="none")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "id 100" in err.value.details
    assert "shard of rows [333, 666) of 1000" in err.value.details


@pytest.mark.parametrize("seed", [0, 1])
def test_none_is_bit_exact(packed, clients, seed):
    single, sharded = clients
    request = build_request(make_batches(packed, seed, weighted=False), "none", f"none-{seed}")
    want, got = single.lookup_request(request), sharded.lookup_request(request)
    assert got.request_id == f"none-{seed}"
    for feature in FEATURES:
        assert got.dtypes[feature] == want.dtypes[feature]
        assert got[feature].shape == want[feature].shape
        assert got[feature].tobytes() == want[feature].tobytes(), feature


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", POOLINGS)
def test_pooled_matches_one_server_within_fp32_tolerance(packed, clients, pooling, weighted):
    single, sharded = clients
    batches = make_batches(packed, 7, weighted)
    request = build_request(batches, pooling)
    want, got = single.lookup_request(request), sharded.lookup_request(request)
    sources = {s.name: s for s in packed.table_set.tables}
    for feature, table in FEATURES.items():
        batch = batches[feature]
        offsets = np.concatenate([[0], np.cumsum(batch.lengths)])
        values = values_of(sources[table])
        tol = reference.pooled_tolerance(values, batch.ids, offsets, batch.weights, pooling)
        exact = reference.lookup_pooled(values, batch.ids, offsets, batch.weights, pooling)
        assert got[feature].shape == want[feature].shape == exact.shape
        assert np.all(np.abs(got[feature] - want[feature]) <= tol), feature
        assert np.all(np.abs(got[feature] - exact) <= tol), feature
        empty = batch.lengths == 0
        assert not got[feature][empty].any()


@pytest.mark.parametrize("output_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("pooling", POOLINGS)
def test_output_dtype_is_honoured_as_one_server_does(packed, clients, pooling, output_dtype):
    single, sharded = clients
    batches = make_batches(packed, 11, weighted=True)
    request = build_request(batches, pooling, output_dtype=output_dtype)
    want, got = single.lookup_request(request), sharded.lookup_request(request)
    fp32 = sharded.lookup_request(build_request(batches, pooling))
    # bfloat16 has 8 significant bits, float16 11: one rounding is at most half a unit of the
    # last of them, and the fp32 sums of one server and of the shards differ far less.
    rtol = 2.0**-8 if output_dtype == "bfloat16" else 2.0**-11
    for feature in FEATURES:
        assert got.dtypes[feature] == want.dtypes[feature] == output_dtype
        assert got[feature].dtype == want[feature].dtype
        assert got[feature].shape == want[feature].shape
        exact = fp32[feature]
        for values in (got[feature], want[feature]):
            # bfloat16 comes back as uint16 bit patterns where ml_dtypes is not installed.
            as_fp32 = bf16_to_float32(values) if values.dtype == np.uint16 else values.astype("f4")
            assert np.all(np.abs(as_fp32 - exact) <= rtol * np.abs(exact) + 1e-6), feature


def test_a_sharded_request_naming_a_region_is_refused(clients):
    _, sharded = clients
    request = build_request({"user": [[1, 999]]}, "sum", output_region="out")
    with pytest.raises(ValueError, match="output_region: the sharded clients do not use"):
        sharded.lookup_request(request)


def test_all_empty_request_needs_no_shard(clients):
    _, sharded = clients
    empty = FeatureBatch(np.zeros(0, np.int64), np.zeros(3, np.int32))
    pooled = sharded.lookup({"user": empty, "quant": empty}, pooling="mean")
    assert pooled["user"].shape == (3, 16) and not pooled["user"].any()
    assert pooled["quant"].shape == (3, 12)
    rows = sharded.lookup({"item": empty}, pooling="none")
    assert rows["item"].shape == (0, 8) and rows.dtypes["item"] == "bfloat16"


def test_async_client_gives_the_same_rows(packed, servers, shard_map, clients):
    single, _ = clients
    request = build_request(make_batches(packed, 3, weighted=False), "none")

    async def run():
        async with AsyncShardedLookupClient(shard_map) as client:
            return await client.lookup_request(request)

    got, want = asyncio.run(run()), single.lookup_request(request)
    for feature in FEATURES:
        assert got[feature].tobytes() == want[feature].tobytes()


def test_killed_shard_is_unavailable_naming_it(servers, shard_map):
    spare = servers.spare
    addresses = list(shard_map.addresses)
    addresses[1] = spare.target
    spare_map = ShardMap(tuple(addresses), shard_map.tables, shard_map.features)
    retry = RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
    with ShardedLookupClient(spare_map, retry=retry, timeout=30) as client:
        assert client.lookup({"user": [[10, 400, 900]]}, pooling="sum")["user"].shape == (1, 16)
        spare.kill()
        with pytest.raises(LookupServiceError) as err:
            client.lookup({"user": [[10, 400, 900]]}, pooling="sum")
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert f"shard 1 at {spare.target} (emb_f32 rows [333, 666))" in err.value.details
        # Requests that need only the live shards still work.
        assert client.lookup({"user": [[10, 900]]}, pooling="sum")["user"].shape == (1, 16)


def test_client_discovers_its_map(servers, shard_map):
    with ShardedLookupClient.discover(servers.shards, timeout=30) as client:
        assert client.shard_map.tables == shard_map.tables
        assert client.lookup({"tiny": [[1, 0]]}, pooling="none")["tiny"].shape == (2, 4)
    assert {r.shard for t in shard_map.tables.values() for r in t.ranges} == set(range(SHARDS))


def test_shard_errors_name_the_callers_feature_position(servers, shard_map):
    # A stale map (shards 1 and 2 swapped): shard 1's part reaches the server of [666, 1000).
    addresses = list(shard_map.addresses)
    addresses[1], addresses[2] = addresses[2], addresses[1]
    stale = ShardMap(tuple(addresses), shard_map.tables, shard_map.features)
    features = {"user": [[10]], "user_hist": [[400]]}
    # Shard 1 is sent only user_hist, its features[0]; the caller sent it as features[1].
    where = f"shard 1 at {addresses[1]} (emb_f32 rows [333, 666)): features[1].ids: "

    async def run_async() -> LookupServiceError:
        async with AsyncShardedLookupClient(stale, timeout=30) as client:
            with pytest.raises(LookupServiceError) as err:
                await client.lookup(features)
            return err.value

    with ShardedLookupClient(stale, timeout=30) as client, pytest.raises(LookupServiceError) as err:
        client.lookup(features)
    for error in (err.value, asyncio.run(run_async())):
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details.startswith(where), error.details
        assert "id 400" in error.details


def halves_of_one_server(target: str) -> ShardMap:
    """emb_f32 as two shards of 500 rows, both at ``target`` (which holds every row)."""
    table = ShardedTable(
        "emb_f32", 1000, 16, "float32", None, (ShardRange(0, 0, 500), ShardRange(1, 500, 1000))
    )
    return ShardMap((target, target), {"emb_f32": table}, {"user": "emb_f32"})


def test_concurrent_callers_each_keep_their_deadline(monkeypatch):
    """More parts than the client's pool has threads, and a server that answers none of them:
    every caller gets DEADLINE_EXCEEDED (a caller waiting for an answer would get one only when
    the gate gives up, 60 s on, and OK), the server received and held parts, and no part was
    sent with more time than its request had left (a part queued for a pool thread must not
    start a fresh timeout)."""
    timeout, callers = 1.0, 8
    gate = GateObserver()  # holds every lookup, so no shard answers in time
    codes: list[grpc.StatusCode] = []
    given: list[float | None] = []  # the timeout of every part sent to a shard

    def call(client: ShardedLookupClient) -> None:
        try:
            client.lookup({"user": [[1, 700]]}, timeout=timeout)
            codes.append(grpc.StatusCode.OK)
        except LookupServiceError as err:
            codes.append(err.code)

    with RunningServer(make_store(), observer=gate) as running:
        try:
            with ShardedLookupClient(halves_of_one_server(running.target)) as client:
                for shard_client in client._clients:
                    send = shard_client.lookup_request

                    def recorded(request, *, timeout=None, send=send):
                        given.append(timeout)
                        return send(request, timeout=timeout)

                    monkeypatch.setattr(shard_client, "lookup_request", recorded)
                # 16 parts: more than the pool's threads, so some wait for one.
                threads = [threading.Thread(target=call, args=(client,)) for _ in range(callers)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                held = gate.entered  # while the gate is still closed: none was answered
        finally:
            gate.open()
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * callers
    assert held >= 1
    assert 1 <= len(given) <= 2 * callers
    assert all(t is not None and 0 < t < timeout for t in given), given


def test_a_failed_part_waits_for_the_others(monkeypatch):
    """Shard 0's part fails at once while shard 1's is held by the server: the lookup raises
    the failure only after the held part has finished. The gate opens once shard 0 has failed
    and shard 1's part has reached the server, or as soon as the lookup has raised: a lookup
    that did not wait for shard 1 raises before its answer."""
    gate = GateObserver()  # holds shard 1's part until the opener opens it
    events: list[str] = []
    failed, returned = threading.Event(), threading.Event()

    def broken(request: object, *, timeout: float | None = None) -> None:
        events.append("shard 0 failed")
        failed.set()
        raise RuntimeError("shard 0 client bug")

    def opener() -> None:
        gate.wait_entered(1)
        failed.wait(30)
        returned.wait(0.3)  # a lookup that does not wait raises now (the wait is not asserted)
        events.append("shard 1 released")
        gate.open()

    with (
        RunningServer(make_store(), observer=gate) as running,
        ShardedLookupClient(halves_of_one_server(running.target), timeout=30) as client,
    ):
        monkeypatch.setattr(client._clients[0], "lookup_request", broken)
        send = client._clients[1].lookup_request

        def held(request, *, timeout=None):
            try:
                return send(request, timeout=timeout)
            finally:
                events.append("shard 1 answered")

        monkeypatch.setattr(client._clients[1], "lookup_request", held)
        # A daemon: when the lookup does not wait, shard 1's part may never reach the gate.
        threading.Thread(target=opener, daemon=True).start()
        try:
            with pytest.raises(RuntimeError, match="shard 0 client bug"):
                client.lookup({"user": [[1, 700]]})
            events.append("lookup raised")
        finally:
            returned.set()
            gate.open()
    assert events == ["shard 0 failed", "shard 1 released", "shard 1 answered", "lookup raised"]
    assert gate.entered == 1
