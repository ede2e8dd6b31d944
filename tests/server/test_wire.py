# SPDX-License-Identifier: Apache-2.0
"""The lookup responses' wire bytes against protobuf's own serialization, byte for byte."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpembed.engine import FeatureResult, LookupResult
from ibpembed.server.wire import DTYPES as PROTO_DTYPES
from ibpembed.server.wire import encode_response, serialize_response
from ibpembed_client.v1 import lookup_pb2 as pb

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]


def protobuf_bytes(request_id: str, result: LookupResult) -> bytes:
    """What the server sent before: the message built and serialized by protobuf."""
    response = pb.LookupResponse(request_id=request_id, table_version=result.version)
    for feature in result.features:
        values = feature.values.contiguous()
        response.features.add(
            name=feature.name,
            dtype=PROTO_DTYPES[values.dtype],
            shape=list(values.shape),
            values=values.view(torch.uint8).numpy().tobytes(),
        )
    return response.SerializeToString()


@st.composite
def results(draw) -> tuple[str, LookupResult]:
    features = []
    for _ in range(draw(st.integers(0, 5))):
        dtype = draw(st.sampled_from(DTYPES))
        rows = draw(st.sampled_from([0, 1, 2, 7, 200]))
        dim = draw(st.sampled_from([1, 3, 16, 129]))
        values = torch.randint(0, 256, (rows, dim * dtype.itemsize), dtype=torch.uint8)
        values = values.view(dtype)
        if draw(st.booleans()) and rows > 1:
            values = values[::2]  # not contiguous
        name = draw(st.text(min_size=0, max_size=300))
        features.append(FeatureResult(name, values))
    version = draw(st.sampled_from([0, 1, 127, 128, 2**32, 2**64 - 1]))
    request_id = draw(st.text(max_size=300))
    return request_id, LookupResult(version=version, features=features)


@settings(max_examples=300, deadline=None)
@given(results())
def test_response_bytes_are_protobufs_bytes(case: tuple[str, LookupResult]) -> None:
    request_id, result = case
    wire = encode_response(request_id, result)
    assert wire == protobuf_bytes(request_id, result)
    parsed = pb.LookupResponse.FromString(wire)
    assert parsed.request_id == request_id and parsed.table_version == result.version
    assert [f.name for f in parsed.features] == [f.name for f in result.features]


def test_a_large_pooled_response_round_trips() -> None:
    features = [FeatureResult(f"cat_{i}", torch.randn(2048, 128)) for i in range(26)]
    result = LookupResult(version=3, features=features)
    wire = encode_response("r", result)
    assert len(wire) > 27_000_000 and wire == protobuf_bytes("r", result)
    parsed = pb.LookupResponse.FromString(wire)
    got = torch.frombuffer(bytearray(parsed.features[25].values), dtype=torch.float32)
    assert torch.equal(got.view(2048, 128), features[25].values)


def test_messages_still_serialize_through_protobuf() -> None:
    error = pb.LookupResponse(request_id="x", error=pb.Error(code=3, message="bad"))
    assert serialize_response(error) == error.SerializeToString()
    assert serialize_response(b"\x0a\x01x") == b"\x0a\x01x"
