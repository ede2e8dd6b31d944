# SPDX-License-Identifier: Apache-2.0
"""A small run of the RPC fuzz (reliability.fuzz_rpc) and the defects it found, pinned."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from ibpembed.codec import compress
from ibpembed.tables.store import TableStore
from ibpembed_client.v1 import lookup_pb2 as pb
from reliability import fuzz_rpc
from reliability.common import fuzz_tables
from tests.server.helpers import RunningServer

LOOKUP = fuzz_rpc.SERVICE + "Lookup"
STREAM = fuzz_rpc.SERVICE + "LookupStream"
GARBAGE = b"\xff\xff\xff"  # a truncated varint: no LookupRequest parses from it


def fuzz_store() -> TableStore:
    tables = fuzz_tables()  # the tables the fuzz's requests are checked against
    compressed = {t.name: compress(t.weight, quant=t.quant) for t in tables}
    return TableStore.from_tables(compressed, {f: t.name for t in tables for f in t.features})


@pytest.fixture(scope="module")
def server():
    settings = {"max_message_mb": fuzz_rpc.MAX_MESSAGE_MB, "max_inflight": fuzz_rpc.MAX_INFLIGHT}
    with RunningServer(fuzz_store(), **settings) as running:
        yield running


def _raw(channel: grpc.Channel, method: str, kind: str = "unary"):
    make = channel.unary_unary if kind == "unary" else channel.stream_stream
    return make(method, request_serializer=None, response_deserializer=None)


def test_small_fuzz_run_stays_within_the_contract(server) -> None:
    findings = asyncio.run(
        fuzz_rpc.fuzz(server.target, 400, seed=1, concurrency=8, check_every=200)
    )
    assert findings.unexpected == []
    assert findings.cases == 400


def test_undecodable_request_is_invalid_argument_without_a_logged_traceback(server, caplog):
    # A fuzz case: left to grpc, an undecodable message is answered UNKNOWN (unary) / INTERNAL
    # (stream) with an ERROR and a traceback logged per message, so that garbage from any client
    # floods the log.
    with caplog.at_level(logging.WARNING), grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _raw(channel, LOOKUP)(GARBAGE, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in info.value.details()
        good = pb.LookupRequest(features=[pb.FeatureInput(name="user")]).SerializeToString()
        replies = list(_raw(channel, STREAM, "stream")(iter([GARBAGE, good]), timeout=30))
    first, second = (pb.LookupResponse.FromString(r) for r in replies)
    assert first.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not second.HasField("error")  # the stream goes on after the bad message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_undecodable_request_without_token_is_unauthenticated(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken")
    with (
        RunningServer(fuzz_store(), auth_token_file=str(token)) as running,
        grpc.insecure_channel(running.target) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        _raw(channel, LOOKUP)(GARBAGE, timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_status_message_echoing_a_huge_name_is_truncated(server) -> None:
    # A fuzz case: a NOT_FOUND carrying a 10000-character feature name back whole in its status
    # message passes the client's 8 KiB trailer limit and arrives as RESOURCE_EXHAUSTED.
    request = pb.LookupRequest(features=[pb.FeatureInput(name="é" * 10_000)])
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _raw(channel, LOOKUP)(request.SerializeToString(), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details().endswith("(truncated)")
        stream = _raw(channel, STREAM, "stream")(iter([request.SerializeToString()]), timeout=30)
        (reply,) = (pb.LookupResponse.FromString(r) for r in stream)
    assert reply.error.code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize(
    ("method", "kind"),
    [
        ("/grpc.health.v1.Health/Check", "unary"),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "stream"),
    ],
)
def test_undecodable_probe_request_is_invalid_argument(server, caplog, method, kind) -> None:
    # Health needs no token even when the service does: an ERROR traceback per garbage message
    # there was an anonymous way to flood the log.
    with caplog.at_level(logging.WARNING), grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            call = _raw(channel, method, kind)
            list(call(iter([GARBAGE]), timeout=30)) if kind == "stream" else call(GARBAGE)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Well-formed probes still work, streaming health included.
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        assert (
            "ibpembed.v1.EmbeddingLookup"
            in ProtoReflectionDescriptorDatabase(channel).get_services()
        )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
