# SPDX-License-Identifier: Apache-2.0
"""Every status code, triggered by a real request over gRPC; the server survives each one."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import numpy as np
import pytest

from ibpembed.engine import LookupEngine
from ibpembed.errors import ServiceError
from ibpembed.server.servicer import EmbeddingLookupServicer
from ibpembed.server.status import status_for
from ibpembed_client import (
    OVERLOADED_METADATA_KEY,
    LookupClient,
    LookupServiceError,
    RetryPolicy,
    build_request,
)
from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc
from tests.engine.helpers import GateObserver, RecordingObserver, make_store
from tests.server.helpers import FailingObserver, RunningServer

I64, I32, F32 = "<i8", "<i4", "<f4"


def _raw(name="user", ids=(1, 2), lengths=(2,), weights=None, pooling=pb.POOLING_SUM, **kw):
    feature = pb.FeatureInput(
        name=name,
        ids=kw.get("ids_bytes", np.asarray(ids, I64).tobytes()),
        lengths=kw.get("lengths_bytes", np.asarray(lengths, I32).tobytes()),
        weights=b"" if weights is None else np.asarray(weights, F32).tobytes(),
    )
    return pb.LookupRequest(request_id="t-1", pooling=pooling, features=[feature])


@pytest.fixture(scope="module")
def server():
    with RunningServer(make_store()) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with LookupClient(server.target, timeout=30) as c:
        yield c


def _fails(client, request, code: grpc.StatusCode) -> str:
    with pytest.raises(LookupServiceError) as info:
        client.lookup_request(request)
    assert info.value.code == code, info.value
    return info.value.details


BAD_INPUTS = [
    # (request, field named in the message, other words it must contain)
    (_raw(ids_bytes=b"\x01" * 12), "features[0].ids", ["12 bytes"]),
    (_raw(lengths_bytes=b"\x01" * 6), "features[0].lengths", ["6 bytes"]),
    (_raw(weights=[1.0]), "features[0].weights", ["one per id"]),
    (_raw(ids=(1, 2, 3), lengths=(2, 2)), "features[0].lengths", ["sum to 4", "3 ids"]),
    (_raw(ids=(1,), lengths=(2, -1)), "features[0].lengths", ["non-negative"]),
    (_raw(ids=(1, 1000)), "features[0].ids", ["id 1000", "'emb_f32'", "1000 rows", "'user'"]),
    (_raw(ids=(-3, 1)), "features[0].ids", ["id -3"]),
    (_raw(weights=[1, 1], pooling=pb.POOLING_NONE), "features[0].weights", ["SUM or MEAN"]),
    (_raw(pooling=17), "pooling", ["17"]),
    (_raw(name=""), "features[0].name", ["empty"]),
    (_raw(ids=(1,), lengths=(1,)), "features[1].name", ["repeated"]),  # duplicated below
]
BAD_INPUTS[-1][0].features.append(BAD_INPUTS[-1][0].features[0])
BAD_INPUTS.append((pb.LookupRequest(request_id="r" * 300), "request_id", ["300 characters"]))


@pytest.mark.parametrize(("request_", "field", "words"), BAD_INPUTS)
def test_invalid_argument_names_the_field(client, request_, field, words):
    details = _fails(client, request_, grpc.StatusCode.INVALID_ARGUMENT)
    assert details.startswith(field + ":"), details
    for word in words:
        assert word in details, details


def test_uint8_rows_only_pool_when_quantised(client):
    # emb_q8 is int8 row-wise, so it pools; NONE returns the raw uint8 rows.
    assert client.lookup({"quant": [[1]]}, "none")["quant"].dtype == np.uint8
    assert client.lookup({"quant": [[1]]}, "sum")["quant"].shape == (1, 12)


def test_result_over_the_message_size_is_refused_up_front():
    with RunningServer(make_store(), max_message_mb=1) as running:
        client = LookupClient(running.target, timeout=30)
        ids = np.arange(20_000, dtype=np.int64) % 1000  # 20000 x 64-byte rows = 1.28 MB
        request = _raw(ids=ids, lengths=(20_000,), pooling=pb.POOLING_NONE)
        details = _fails(client, request, grpc.StatusCode.INVALID_ARGUMENT)
        assert details.startswith("features:") and "1280000 bytes" in details
        request.pooling = pb.POOLING_SUM  # the pooled result is one 64-byte row: fine
        assert client.lookup_request(request)["user"].shape == (1, 16)
        client.close()


def test_not_found(client):
    details = _fails(client, _raw(name="nope"), grpc.StatusCode.NOT_FOUND)
    assert "'nope'" in details
    with pytest.raises(LookupServiceError) as info:
        client.describe_table("no_table")
    assert info.value.code == grpc.StatusCode.NOT_FOUND and "'no_table'" in info.value.details


def test_server_survives_every_error(client):
    for request, _, _ in BAD_INPUTS:
        with pytest.raises(LookupServiceError):
            client.lookup_request(request)
    assert client.lookup({"user": [[1]]})["user"].shape == (1, 16)
    assert client.is_serving()


def test_overload_is_resource_exhausted():
    gate = GateObserver()
    with RunningServer(make_store(), observer=gate, max_inflight=2, workers=2) as running:
        client = LookupClient(running.target, timeout=30, retry=RetryPolicy(max_attempts=1))
        held = [threading.Thread(target=client.lookup, args=({"user": [[1]]},)) for _ in range(2)]
        for t in held:
            t.start()
        gate.wait_entered(2)  # both slots are taken, held by the engine
        with pytest.raises(LookupServiceError) as info:
            client.lookup({"user": [[1]]})
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A stream's request past capacity fails alone; the stream goes on.
        results = list(client.lookup_stream([build_request({"user": [[1]]})]))
        assert results[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        gate.open()
        for t in held:
            t.join()
        assert client.lookup({"user": [[1]]})["user"].shape == (1, 16)
        client.close()


def test_an_overload_refusal_is_marked_and_retried_until_a_slot_frees():
    gate = GateObserver()
    with RunningServer(make_store(), observer=gate, max_inflight=1, workers=2) as running:
        holder = LookupClient(running.target, timeout=30)
        held = threading.Thread(target=holder.lookup, args=({"user": [[1]]},))
        held.start()
        gate.wait_entered(1)  # the only slot is taken
        # The mark the client's retry policy reads, as the sync and the asyncio stubs see it.
        with grpc.insecure_channel(running.target) as channel, pytest.raises(grpc.RpcError) as info:
            lookup_pb2_grpc.EmbeddingLookupStub(channel).Lookup(_raw(), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (OVERLOADED_METADATA_KEY, "1") in info.value.trailing_metadata()
        assert RetryPolicy().retryable(info.value)

        async def lookup_async() -> None:
            async with grpc.aio.insecure_channel(running.target) as channel:
                await lookup_pb2_grpc.EmbeddingLookupStub(channel).Lookup(_raw(), timeout=30)

        with pytest.raises(grpc.aio.AioRpcError) as aio_info:
            asyncio.run(lookup_async())
        assert aio_info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert RetryPolicy().retryable(aio_info.value)
        assert not RetryPolicy(retry_overloaded=False).retryable(aio_info.value)
        patient = LookupClient(
            running.target,
            timeout=30,
            retry=RetryPolicy(max_attempts=1000, initial_backoff_s=0.01, budget_tokens=None),
        )
        result: list = []
        retrying = threading.Thread(target=lambda: result.append(patient.lookup({"user": [[2]]})))
        retrying.start()
        waited = time.monotonic() + 30
        while gate.rpcs.count(("Lookup", "RESOURCE_EXHAUSTED")) < 3 and time.monotonic() < waited:
            time.sleep(0.01)
        gate.open()
        held.join(timeout=30)
        retrying.join(timeout=30)
        assert result and result[0]["user"].shape == (1, 16)
        assert gate.rpcs.count(("Lookup", "RESOURCE_EXHAUSTED")) >= 3
        assert gate.rpcs[-1] == ("Lookup", "OK")
        holder.close()
        patient.close()


def test_an_oversize_message_is_not_retried():
    """gRPC's own RESOURCE_EXHAUSTED (a message over the limit) has no overload mark."""
    with RunningServer(make_store(), max_message_mb=1) as running:
        client = LookupClient(running.target, timeout=30)
        request = _raw(ids=np.ones(200_000, np.int64), lengths=(200_000,))  # 1.6 MB of ids
        with pytest.raises(LookupServiceError) as info:
            client.lookup_request(request)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.attempts == 1
        client.close()


def test_the_retry_budget_stops_retries_while_calls_keep_failing(server):
    """gRFC A6 throttling (gRPC's, from the policy's service config): each retryable failure
    takes a token of 10, each successful call gives back 0.1, and retries pause at 5 or fewer.
    The attempts are counted where they arrive, at the server's gate."""
    client = LookupClient(server.target, timeout=30, retry=RetryPolicy(initial_backoff_s=0.001))
    state = server.server.state

    def attempts_of_a_refused_call() -> int:
        refused = state.refused
        with pytest.raises(LookupServiceError) as info:
            client.lookup({"user": [[1]]})
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        return state.refused - refused

    state.accepting = False
    try:
        attempts = [attempts_of_a_refused_call() for _ in range(3)]
        assert attempts == [3, 2, 1]  # tokens 10 -> 7 -> 5 -> 4
    finally:
        server.server.state.accepting = True
    for _ in range(25):  # 4 + 25 * 0.1 = 6.5 tokens: one retry (6.5 -> 5.5 -> 4.5) again
        client.lookup({"user": [[1]]})
    server.server.state.accepting = False
    try:
        assert attempts_of_a_refused_call() == 2
    finally:
        server.server.state.accepting = True
    client.close()


def test_deadline_exceeded_and_slot_released():
    gate = GateObserver()
    with RunningServer(make_store(), observer=gate, max_inflight=1) as running:
        client = LookupClient(running.target, retry=RetryPolicy(max_attempts=1))
        with pytest.raises(LookupServiceError) as info:
            client.lookup({"user": [[1]]}, timeout=0.2)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server's deadline runs from the request's arrival, a little after the client's:
        # open the gate only once the server has ended the call itself (opened earlier, the
        # kernel could finish first and the server answer OK to a client no longer there).
        waited = time.monotonic() + 10
        while not gate.rpcs and time.monotonic() < waited:
            time.sleep(0.01)
        gate.open()
        # The abandoned kernel finishes and frees its slot; the next call runs normally.
        running.run(_wait_idle(running))
        assert client.lookup({"user": [[1]]}, timeout=30)["user"].shape == (1, 16)
        client.close()
    # Counted like every other outcome (requests_total): the call ended by its deadline.
    assert gate.rpcs == [("Lookup", "DEADLINE_EXCEEDED"), ("Lookup", "OK")]


def test_a_stream_runs_at_most_stream_window_requests_at_once():
    gate = GateObserver()
    with RunningServer(make_store(), observer=gate, stream_window=2, workers=8) as running:
        client = LookupClient(running.target, timeout=30)
        requests = [build_request({"user": [[i]]}, request_id=f"s-{i}") for i in range(6)]
        results: list = []
        reader = threading.Thread(target=lambda: results.extend(client.lookup_stream(requests)))
        reader.start()
        gate.wait_entered(2)
        time.sleep(0.3)  # time for a third request to start, were the window not respected
        assert gate.entered == 2
        gate.open()
        reader.join(timeout=30)
        assert [r.request_id for r in results] == [f"s-{i}" for i in range(6)]
        client.close()


def test_a_stream_cancelled_as_its_answer_arrives_releases_the_slot():
    """The writer cancelled (client gone) in the loop turn in which a request's answer becomes
    ready drops that answer at its await; its admission slot and its place of the stream backlog
    must still be released (a leak per
    such race would end with every request refused). The race is forced in process: the
    answer's task cancels the writer as it finishes, before the writer wakes up; the context
    stands in for grpc's, whose cancellation timing a real server cannot pin."""

    class Context:
        def time_remaining(self) -> None:
            return None

        def invocation_metadata(self) -> tuple:
            return ()

        def peer(self) -> str:
            return "ipv4:127.0.0.1:1"

    async def main() -> tuple[int, int]:
        # On a worker: the race needs an answer that becomes ready in a later loop turn.
        engine = LookupEngine(make_store(), max_workers=1, max_inflight=4, inline_max_ids=0)
        servicer = EmbeddingLookupServicer(engine)
        stream_one = servicer._stream_one
        writer: asyncio.Future | None = None

        async def answer_then_cancel_the_writer(*args):
            assert writer is not None
            asyncio.current_task().add_done_callback(lambda _task: writer.cancel())
            return await stream_one(*args)

        servicer._stream_one = answer_then_cancel_the_writer

        async def requests():
            yield build_request({"user": [[1]]}, "sum", "r1")
            await asyncio.sleep(3600)

        responses = servicer.LookupStream(requests(), Context())
        writer = asyncio.ensure_future(responses.__anext__())
        with pytest.raises(asyncio.CancelledError):
            await writer
        await responses.aclose()
        await asyncio.sleep(0)
        engine.close()
        return engine.inflight, servicer.backlog.held

    assert asyncio.run(main()) == (0, 0)  # neither the slot nor the backlog place leaked


def test_a_servicer_without_its_engine_answers_unavailable() -> None:
    """Outside the server, whose gate turns RPCs away while the tables load, a servicer with no
    engine yet refuses with UNAVAILABLE (a retryable code), not an AttributeError (INTERNAL)."""
    servicer = EmbeddingLookupServicer(None)
    with pytest.raises(ServiceError) as refused:
        asyncio.run(servicer.ListTables(pb.ListTablesRequest(), None))
    assert status_for(refused.value, "r")[0] == grpc.StatusCode.UNAVAILABLE


async def _wait_idle(running: RunningServer) -> None:
    while running.server.engine.inflight:
        await asyncio.sleep(0.01)


def test_unavailable_when_not_accepting(server, client):
    server.server.state.accepting = False
    refused = server.server.state.refused
    try:
        with pytest.raises(LookupServiceError) as info:
            client.lookup({"user": [[1]]})
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        # retried by gRPC (the service config), then gave up
        assert server.server.state.refused - refused == client.retry.max_attempts
    finally:
        server.server.state.accepting = True
    assert client.lookup({"user": [[1]]})["user"].shape == (1, 16)


def test_a_stream_id_from_metadata_is_logged_cut_to_the_request_id_limit(server, caplog):
    server.server.state.accepting = False  # fails the stream as a whole, under its own id
    try:
        with grpc.insecure_channel(server.target) as channel:
            call = channel.stream_stream(
                "/ibpembed.v1.EmbeddingLookup/LookupStream",
                request_serializer=pb.LookupRequest.SerializeToString,
                response_deserializer=pb.LookupResponse.FromString,
            )
            with (
                caplog.at_level(logging.DEBUG, logger="ibpembed.server.interceptors"),
                pytest.raises(grpc.RpcError) as info,
            ):
                list(call(iter([]), metadata=[("x-request-id", "x" * 5000)]))
    finally:
        server.server.state.accepting = True
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    logged = [r.getMessage() for r in caplog.records if "LookupStream request" in r.getMessage()]
    assert logged and all("x" * 256 in m and "x" * 257 not in m for m in logged)


def test_rpc_observer_sees_every_outcome():
    recorder = RecordingObserver()
    with RunningServer(make_store(), observer=recorder) as running:
        client = LookupClient(running.target, timeout=30)
        client.lookup({"user": [[1]]})
        for request in (_raw(name="nope"), _raw(ids=(1, 5000))):
            with pytest.raises(LookupServiceError):
                client.lookup_request(request)
        list(client.lookup_stream([build_request({"user": [[1]]})]))
        client.list_tables()
        client.close()
    assert recorder.rpcs == [
        ("Lookup", "OK"),
        ("Lookup", "NOT_FOUND"),
        ("Lookup", "INVALID_ARGUMENT"),
        ("LookupStream", "OK"),
        ("ListTables", "OK"),
    ]


def test_internal_logs_request_id_and_hides_details(caplog):
    with RunningServer(make_store(), observer=FailingObserver()) as running:
        client = LookupClient(running.target, timeout=30)
        with (
            caplog.at_level(logging.ERROR, logger="ibpembed.server.interceptors"),
            pytest.raises(LookupServiceError) as info,
        ):
            client.lookup({"user": [[1]]}, request_id="req-42")
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert "req-42" in info.value.details and "exploded" not in info.value.details
        assert len(status_for(RuntimeError(), "r" * 100_000)[1]) < 600  # messages stay capped
        assert any("req-42" in r.getMessage() for r in caplog.records)
        assert "observer exploded" in caplog.text
        # In a stream the failure is per request, with the same code.
        results = list(client.lookup_stream([build_request({"user": [[1]]}, request_id="s-1")]))
        assert results[0].error.code == grpc.StatusCode.INTERNAL
        assert client.list_tables()  # still serving
        client.close()
