# SPDX-License-Identifier: Apache-2.0
"""The typed mirror (proto/typed/ibpembed/v1/lookup_typed.proto) against a real server: its
packed repeated scalars have the wire bytes of lookup.proto's little-endian ``bytes`` fields, so
a client generated from it (grpcurl here; Go, Java or C++ in production) sends ``ids: [1, 2]``
and reads float ``values`` from the unchanged server."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_tools import protoc

from ibpembed_client import FeatureBatch, LookupClient, build_request
from ibpembed_client.v1 import lookup_pb2 as pb
from tests.engine.helpers import make_store
from tests.server.helpers import RunningServer

REPO = Path(__file__).resolve().parents[2]
TYPED_ROOT = REPO / "proto" / "typed"
TYPED = "ibpembed/v1/lookup_typed.proto"
METHOD = "ibpembed.v1.EmbeddingLookup/Lookup"
# Weighted MEAN over fp32 rows, and the same ids unpooled (NONE on a float32 table: floats too).
REQUESTS: list[dict[str, Any]] = [
    {
        "requestId": "typed-1",
        "pooling": "POOLING_MEAN",
        "features": [
            {
                "name": "user",
                "ids": ["1", "2", "999"],
                "lengths": [2, 0, 1],
                "weights": [0.5, 2.0, -1.25],
            },
            {"name": "user_hist", "ids": ["7"], "lengths": [1]},
        ],
    },
    {
        "pooling": "POOLING_NONE",
        "features": [{"name": "user", "ids": ["0", "5", "999"], "lengths": [3]}],
    },
]


@pytest.fixture(scope="module")
def typed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, type]:
    """The typed mirror's message classes, compiled from the shipped file (in a pool of their
    own: they share lookup.proto's names)."""
    out = tmp_path_factory.mktemp("typed") / "typed.pb"
    args = ["protoc", f"--proto_path={TYPED_ROOT}", f"--descriptor_set_out={out}", TYPED]
    assert protoc.main(args) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"ibpembed.v1.{name}"))
        for name in ("LookupRequest", "LookupResponse")
    }


def python_request(body: dict[str, Any]) -> bytes:
    """The same request from the Python client's ``build_request`` (little-endian bytes)."""
    pooling = body["pooling"].removeprefix("POOLING_").lower()
    features = {}
    for f in body["features"]:
        ids, lengths = iter(int(i) for i in f["ids"]), f["lengths"]
        samples = [[next(ids) for _ in range(n)] for n in lengths]
        if "weights" in f:
            w = iter(f["weights"])
            features[f["name"]] = (samples, [[next(w) for _ in range(n)] for n in lengths])
        else:
            features[f["name"]] = (samples, None)
    batches = {n: FeatureBatch.from_lists(s, w) for n, (s, w) in features.items()}
    return build_request(batches, pooling, body.get("requestId", "")).SerializeToString()


def expected(target: str, body: dict[str, Any]) -> dict[str, np.ndarray]:
    request = pb.LookupRequest.FromString(python_request(body))
    with LookupClient(target, timeout=30) as client:
        result = client.lookup_request(request)
    return {name: result[name] for name in result}


def test_typed_requests_are_the_python_clients_bytes(typed):
    for body in REQUESTS:
        message = json_format.ParseDict(body, typed["LookupRequest"]())
        assert message.SerializeToString(deterministic=True) == python_request(body)


def test_a_typed_client_reads_the_servers_floats(typed):
    """A client compiled from the mirror, on a real gRPC socket: floats equal to the Python
    client's arrays, bit for bit."""
    with RunningServer(make_store()) as running, grpc.insecure_channel(running.target) as ch:
        call = ch.unary_unary(
            f"/{METHOD}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=typed["LookupResponse"].FromString,
        )
        for body in REQUESTS:
            response = call(json_format.ParseDict(body, typed["LookupRequest"]()), timeout=30)
            want = expected(running.target, body)
            assert [f.name for f in response.features] == list(want)
            for feature in response.features:
                got = np.array(feature.values, dtype=np.float32).reshape(tuple(feature.shape))
                assert got.tobytes() == want[feature.name].tobytes()


GRPCURL = shutil.which("grpcurl")


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed: scripts/ci_install_grpcurl.sh")
def test_grpcurl_with_the_typed_proto(typed):
    def grpcurl(target: str, body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        argv = [GRPCURL, "-plaintext", "-import-path", str(TYPED_ROOT), "-proto", TYPED]
        argv += ["-d", json.dumps(body), target, METHOD]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    with RunningServer(make_store()) as running:
        for body in REQUESTS:
            answer = grpcurl(running.target, body)
            assert answer.returncode == 0, answer.stderr
            response = json.loads(answer.stdout)
            want = expected(running.target, body)
            for feature in response["features"]:
                got = np.array(feature["values"], dtype=np.float32)
                assert feature["dtype"] == "DTYPE_FLOAT32"
                assert got.tobytes() == want[feature["name"]].ravel().tobytes()
        bad = {"features": [{"name": "user", "ids": ["1000"], "lengths": [1]}]}
        refused = grpcurl(running.target, bad)
        assert refused.returncode != 0
        assert "InvalidArgument" in refused.stderr
        assert "id 1000 out of range for table" in refused.stderr
