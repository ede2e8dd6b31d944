# SPDX-License-Identifier: Apache-2.0
"""Security checks of reliability.security not covered by tests/server/test_security.py."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from ibpembed_client.v1 import lookup_pb2_grpc
from reliability.security import (
    TOKEN,
    WRONG_AUTHORIZATION,
    _code,
    _methods,
    check_region_quotas,
)
from tests.engine.helpers import make_store
from tests.server.helpers import RunningServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    with RunningServer(make_store(), auth_token_file=str(token_file), log_level="debug") as s:
        yield s


@pytest.mark.parametrize("label", sorted(WRONG_AUTHORIZATION))
def test_every_method_refuses_a_wrong_authorization(server, label, caplog):
    value = WRONG_AUTHORIZATION[label]
    metadata = () if value is None else (("authorization", value),)
    with caplog.at_level(logging.DEBUG), grpc.insecure_channel(server.target) as channel:
        stub = lookup_pb2_grpc.EmbeddingLookupStub(channel)
        codes = {name: _code(call, metadata) for name, call in _methods(stub).items()}
    assert set(codes.values()) == {"UNAUTHENTICATED"}, codes
    assert TOKEN not in caplog.text


def test_health_is_open_and_reflection_needs_the_token(server):
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(channel).get_services()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_region_quotas_probe_against_serve_processes(tmp_path):
    """The campaign's quota probe as it runs: made-up headers are one identity on a server
    without tokens; identities of a tokens file share --max-regions."""
    results, failures = check_region_quotas(tmp_path)
    assert failures == [], results
