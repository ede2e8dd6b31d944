# SPDX-License-Identifier: Apache-2.0
"""The torch-free client: imports, request building, the asyncio client, retries, stub freshness."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from ibpembed_client import (
    AsyncLookupClient,
    AsyncShardedLookupClient,
    FeatureBatch,
    KeepAliveOptions,
    LookupClient,
    LookupServiceError,
    OutlierEjection,
    RetryPolicy,
    ShardedLookupClient,
    ShardMap,
    bf16_to_float32,
    build_request,
    decode_response,
    service_config,
)
from ibpembed_client.v1 import lookup_pb2 as pb
from tests.engine.helpers import make_store
from tests.metrics.helpers import free_port
from tests.server.helpers import RunningServer

REPO = Path(__file__).resolve().parents[2]
STUBS = REPO / "clients" / "python" / "ibpembed_client" / "v1"


def test_import_does_not_pull_torch():
    code = (
        "import sys, ibpembed_client, ibpembed_client.aio, ibpembed_client.loadgen;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ibpembed'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_stubs_are_fresh(tmp_path):
    generate = [sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(tmp_path)]
    subprocess.run([*generate, "--typed-out", str(tmp_path)], check=True, capture_output=True)
    typed = Path("ibpembed") / "v1" / "lookup_typed.proto"
    assert (tmp_path / typed).read_text() == (REPO / "proto" / "typed" / typed).read_text(), (
        "the typed mirror is stale: run `python proto/generate.py`"
    )
    fresh = sorted((tmp_path / "ibpembed_client" / "v1").glob("*_pb2*"))
    assert [p.name for p in fresh] == sorted(p.name for p in STUBS.glob("*_pb2*"))
    for path in fresh:
        assert path.read_bytes() == (STUBS / path.name).read_bytes(), (
            f"{path.name} is stale: run `python proto/generate.py`"
        )


def test_feature_batch_from_lists_and_request_bytes():
    batch = FeatureBatch.from_lists([[3, 1], [], [7]], weights=[[0.5, 1.0], [], [2.0]])
    assert batch.lengths.tolist() == [2, 0, 1] and batch.ids.tolist() == [3, 1, 7]
    request = build_request({"f": batch}, "mean", request_id="x")
    feature = request.features[0]
    assert request.pooling == pb.POOLING_MEAN and request.request_id == "x"
    assert np.frombuffer(feature.ids, "<i8").tolist() == [3, 1, 7]
    assert np.frombuffer(feature.lengths, "<i4").tolist() == [2, 0, 1]
    assert np.frombuffer(feature.weights, "<f4").tolist() == [0.5, 1.0, 2.0]
    assert build_request({"f": [[1]]}).features[0].weights == b""
    with pytest.raises(ValueError, match="pooling"):
        build_request({}, "max")


def test_from_lists_needs_one_weight_per_id_in_every_sample():
    # Same total count as the ids, but sample 0 is one weight short and sample 1 one long.
    with pytest.raises(ValueError, match="sample 0 has 2 ids but 1 weights"):
        FeatureBatch.from_lists([[1, 2], [3]], weights=[[0.5], [1.0, 2.0]])
    with pytest.raises(ValueError, match="1 weight lists for 2 samples"):
        FeatureBatch.from_lists([[1], [2]], weights=[[0.5]])


def test_build_request_refuses_ids_a_cast_would_change():
    lengths = np.array([2], np.int32)
    with pytest.raises(TypeError, match="feature 'f': ids must be integers, got float64"):
        build_request({"f": FeatureBatch(np.array([1.9, 2.7]), lengths)})
    with pytest.raises(TypeError, match="feature 'f': lengths must be integers, got float32"):
        build_request({"f": FeatureBatch(np.array([1, 2]), np.array([2], np.float32))})
    with pytest.raises(ValueError, match=r"feature 'f': ids must be 1-D, got shape \(1, 2\)"):
        build_request({"f": FeatureBatch(np.array([[1, 2]]), lengths)})
    narrow = build_request({"f": FeatureBatch(np.array([7, 9], np.uint16), np.array([2], "i1"))})
    assert np.frombuffer(narrow.features[0].ids, "<i8").tolist() == [7, 9]
    assert np.frombuffer(narrow.features[0].lengths, "<i4").tolist() == [2]
    # numpy makes an empty list float64; nothing in it can be truncated.
    empty = build_request({"f": FeatureBatch(np.array([]), np.array([0, 0]))}).features[0]
    assert empty.ids == b"" and np.frombuffer(empty.lengths, "<i4").tolist() == [0, 0]


def test_list_ids_that_are_not_integers_never_reach_the_server():
    """The README's list form: ``[[1.5]]`` must not be cast to row 1 (as the numpy form is
    refused too), and the refusal names the feature and the value."""
    with RunningServer(make_store()) as running, LookupClient(running.target, timeout=30) as c:
        row_1 = c.lookup({"user": [[1]]}, "none")["user"]
        cases = {
            "1.5 (float)": [[1.5]],
            "2.0 (float)": [[1, 2.0]],
            "True (bool)": [[True]],
            "'3' (str)": [["3"]],
        }
        for shown, samples in cases.items():
            with pytest.raises(
                TypeError, match="feature .user.: ids must be integers, got " + re.escape(shown)
            ):
                c.lookup({"user": samples}, "none")
        with pytest.raises(ValueError, match=r"feature 'user': ids must fit int64"):
            c.lookup({"user": [[2**63]]}, "none")
        # numpy integer scalars are integers: the list form still takes them.
        assert c.lookup({"user": [[np.int32(1)]]}, "none")["user"].tobytes() == row_1.tobytes()


def test_decode_response_dtypes():
    bits = np.array([[0x3F80, 0xC000]], dtype="<u2")  # bf16 1.0, -2.0
    response = pb.LookupResponse(
        request_id="r",
        table_version=3,
        features=[pb.FeatureOutput(name="a", dtype=pb.DTYPE_BFLOAT16, shape=[1, 2])],
    )
    response.features[0].values = bits.tobytes()
    result = decode_response(response)
    assert result.dtypes == {"a": "bfloat16"} and result.table_version == 3
    assert bf16_to_float32(result["a"]).tolist() == [[1.0, -2.0]]
    failed = decode_response(
        pb.LookupResponse(request_id="r", error=pb.Error(code=5, message="gone"))
    )
    assert failed.error.code == grpc.StatusCode.NOT_FOUND and len(failed) == 0


def test_grpc_retries_unavailable_as_the_policy_says_and_nothing_else():
    retry = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02)
    target = f"127.0.0.1:{free_port()}"  # nothing listens here
    with (
        LookupClient(target, timeout=30, retry=retry) as client,
        pytest.raises(LookupServiceError) as info,
    ):
        client.lookup({"f": [[1]]})
    assert info.value.code == grpc.StatusCode.UNAVAILABLE

    async def lookup_async(target: str) -> None:
        async with AsyncLookupClient(target, timeout=30, retry=retry) as client:
            await client.lookup({"f": [[1]]})

    with RunningServer(make_store()) as running, LookupClient(running.target, retry=retry) as c:
        running.server.state.accepting = False  # every call refused with UNAVAILABLE
        refused = running.server.state.refused
        with pytest.raises(LookupServiceError) as info:
            c.lookup({"user": [[1]]})
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert running.server.state.refused - refused == 4  # gRPC's attempts reached the server
        refused = running.server.state.refused
        with pytest.raises(LookupServiceError) as info:
            asyncio.run(lookup_async(running.target))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert running.server.state.refused - refused == 4
        running.server.state.accepting = True
        with pytest.raises(LookupServiceError) as info:
            c.lookup({"no_such_feature": [[1]]})
        assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.attempts == 1


def test_the_published_service_config_is_the_default_policy():
    published = json.loads((REPO / "proto" / "ibpembed" / "v1" / "service_config.json").read_text())
    assert published == service_config(RetryPolicy(), OutlierEjection())
    assert published["loadBalancingConfig"][0]["outlier_detection_experimental"]["childPolicy"] == [
        {"round_robin": {}}
    ]
    assert RetryPolicy(max_attempts=1).service_config() == {}  # gRPC rejects maxAttempts 1


def test_router_picks_the_server_per_request():
    with RunningServer(make_store()) as running:
        seen = []

        def route(request: pb.LookupRequest) -> str:
            seen.append(request.request_id)
            return running.target

        # The default target has no server: only routed lookups can succeed.
        bogus = f"127.0.0.1:{free_port()}"
        keepalive = KeepAliveOptions(time_ms=10_000, timeout_ms=5_000)
        with LookupClient(bogus, timeout=30, router=route, keepalive=keepalive) as client:
            assert client.lookup({"user": [[1]]}, request_id="q1")["user"].shape == (1, 16)
        assert seen == ["q1"]


def test_an_error_carries_the_request_id_the_server_logged(caplog):
    """A caller that sets no id still finds one on its error, the one the server logged: the
    clients pick a fresh one per call (the server's own pick never reached the client)."""
    caplog.set_level(logging.DEBUG, logger="ibpembed.server.interceptors")
    unheld = 99  # a version the server does not hold: FAILED_PRECONDITION from the server
    prebuilt = build_request({"user": [[1]]}, table_version=unheld)
    ids: list[str] = []

    def failed(call) -> None:
        with pytest.raises(LookupServiceError) as info:
            call()
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        ids.append(info.value.request_id)

    async def failed_async(call) -> None:
        with pytest.raises(LookupServiceError) as info:
            await call()
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        ids.append(info.value.request_id)

    with RunningServer(make_store()) as running:
        with LookupClient(running.target, timeout=30) as client:
            failed(lambda: client.lookup({"user": [[1]]}, table_version=unheld))
            failed(lambda: client.lookup_request(prebuilt))
            failed(lambda: client.lookup_request(prebuilt))  # a new id for the second call
        shard_map = ShardMap.discover([running.target])
        with ShardedLookupClient(shard_map, timeout=30) as sharded:
            failed(lambda: sharded.lookup({"user": [[1]]}, table_version=unheld))

        async def run_async() -> None:
            async with AsyncLookupClient(running.target, timeout=30) as client:
                await failed_async(lambda: client.lookup({"user": [[1]]}, table_version=unheld))
                await failed_async(lambda: client.lookup_request(prebuilt))
            async with AsyncShardedLookupClient(shard_map, timeout=30) as sharded:
                await failed_async(lambda: sharded.lookup({"user": [[1]]}, table_version=unheld))

        asyncio.run(run_async())
    assert prebuilt.request_id == ""  # sent as a copy: the caller's message is left as it was
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids), ids
    logged = re.findall(r"request ([0-9a-f]{32}): FAILED_PRECONDITION", caplog.text)
    assert set(ids) <= set(logged), (ids, logged)


def test_async_client_matches_sync_client():
    with RunningServer(make_store()) as running:
        features = {"user": [[1, 2], [3]], "item": [[4]]}
        with LookupClient(running.target, timeout=30) as sync:
            want = sync.lookup(features, "none")

        async def main():
            async with AsyncLookupClient(running.target, timeout=30) as client:
                assert await client.is_serving()
                assert len(await client.list_tables()) == 4
                assert (await client.describe_table("emb_f16")).dim == 3
                got = await asyncio.gather(*(client.lookup(features, "none") for _ in range(8)))
                streamed = [
                    r
                    async for r in client.lookup_stream(
                        [build_request(features, "none", request_id=str(i)) for i in range(3)]
                    )
                ]
                with pytest.raises(LookupServiceError) as info:
                    await client.lookup({"user": [[10**6]]})
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
                return got, streamed

        got, streamed = asyncio.run(main())
    assert [r.request_id for r in streamed] == ["0", "1", "2"]
    for result in [*got, *streamed]:
        for name in features:
            assert np.array_equal(result[name], want[name])


class _Broken(RuntimeError):
    """Raised by a caller's request generator."""


def _requests_then_broken():
    yield build_request({"user": [[1]]}, request_id="0")
    yield build_request({"user": [[2]]}, request_id="1")
    raise _Broken("the caller's generator failed")


def _requests_naming_an_unregistered_region():
    return [
        build_request({"user": [[1]]}),
        build_request({"user": [[1]]}, "sum", output_region="nowhere"),
    ]


@pytest.mark.parametrize(
    ("requests", "error", "words"),
    [
        (_requests_then_broken, _Broken, "caller's generator"),
        (_requests_naming_an_unregistered_region, ValueError, "'nowhere' was not registered"),
    ],
)
def test_a_stream_raises_what_iterating_its_requests_raised(requests, error, words):
    """Not gRPC's UNKNOWN "Exception iterating requests!" (sync) or a cancellation (asyncio)."""
    with (
        RunningServer(make_store()) as running,
        LookupClient(running.target, timeout=30) as client,
    ):
        with pytest.raises(error, match=words):
            list(client.lookup_stream(requests()))

        async def main() -> list[tuple[int, int]]:
            async with AsyncLookupClient(running.target, timeout=30) as aio:
                with pytest.raises(error, match=words):
                    [r async for r in aio.lookup_stream(requests())]
                streamed = aio.lookup_stream([build_request({"user": [[3]]})])
                return [r["user"].shape async for r in streamed]

        assert asyncio.run(main()) == [(1, 16)]
        streamed = client.lookup_stream([build_request({"user": [[3]]})])
        assert [r["user"].shape for r in streamed] == [(1, 16)]


def _first_calls(client: LookupClient, threads: int) -> list[object]:
    """The channel each of ``threads`` threads gets from its first call, all starting at once."""
    start = threading.Barrier(threads)
    seen: list[object] = []

    def first_call() -> None:
        start.wait()
        seen.append(client._channel(client.target))

    workers = [threading.Thread(target=first_call) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return seen


def test_threads_first_calls_share_one_channel():
    """The client is thread-safe: concurrent first calls must not each open a channel (and leak
    all but one)."""
    for _ in range(20):
        client = LookupClient("127.0.0.1:1")
        assert len({id(channel) for channel in _first_calls(client, 8)}) == 1
        client.close()


def test_build_request_refuses_values_the_wire_types_cannot_hold() -> None:
    with pytest.raises(ValueError, match="lengths must fit int32"):
        build_request({"f": FeatureBatch(np.arange(3), np.array([2**40], np.int64))})
    with pytest.raises(ValueError, match="ids must fit int64"):
        build_request({"f": FeatureBatch(np.array([2**64 - 1], np.uint64), np.array([1]))})
