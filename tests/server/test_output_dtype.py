# SPDX-License-Identifier: Apache-2.0
"""Reduced-precision pooled outputs: the fp32 result rounded once, to nearest even, within the
bound docs/serving.md states; NONE stays bit-exact and refuses an output dtype."""

from __future__ import annotations

import uuid

import grpc
import ml_dtypes
import numpy as np
import pytest

from ibpembed_client import (
    FeatureBatch,
    LookupClient,
    LookupServiceError,
    RetryPolicy,
    SharedMemoryRegion,
    bf16_to_float32,
    build_request,
)
from ibpembed_client.v1 import lookup_pb2 as pb
from tests.engine.helpers import FEATURES, make_store

from .helpers import RunningServer

POOLED_FEATURES = ["user", "user_hist", "item", "ctx", "quant"]
# The documented bounds: half an ulp of the format's significand, relative to each value
# (fp16: 11 significant bits, bf16: 8), plus fp16's subnormal spacing near zero.
FP16_RELATIVE, FP16_ABSOLUTE = 2.0**-11, 2.0**-25
BF16_RELATIVE = 2.0**-8


@pytest.fixture(scope="module")
def store():
    return make_store()


@pytest.fixture(scope="module")
def client(store):
    with (
        RunningServer(store) as running,
        LookupClient(running.target, timeout=30, retry=RetryPolicy(max_attempts=1)) as c,
    ):
        yield c


def _features(store, seed: int, batch: int) -> dict[str, FeatureBatch]:
    rng = np.random.default_rng(seed)
    out = {}
    with store.acquire() as snap:
        for name in POOLED_FEATURES:
            rows = snap.tables[FEATURES[name]].num_rows
            lengths = rng.integers(0, 40, batch).astype(np.int32)
            ids = rng.integers(0, rows, int(lengths.sum())).astype(np.int64)
            weights = rng.uniform(-3, 3, ids.size).astype(np.float32)
            out[name] = FeatureBatch(ids, lengths, weights)
    return out


def _bf16_rne(values: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, round to nearest even (an oracle apart from torch's conversion)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("batch", [1, 50])
def test_fp16_and_bf16_are_the_fp32_result_rounded_once(client, store, pooling, batch):
    features = _features(store, batch, batch)
    fp32 = client.lookup(features, pooling)
    fp16 = client.lookup(features, pooling, output_dtype="float16")
    bf16 = client.lookup(features, pooling, output_dtype="bfloat16")
    for name in features:
        want = fp32[name]
        assert fp16[name].dtype == np.float16 and fp16.dtypes[name] == "float16"
        # numpy's fp32 -> fp16 cast rounds to nearest even: the one rounding of the result.
        assert np.array_equal(fp16[name], want.astype(np.float16))
        err16 = np.abs(fp16[name].astype(np.float32) - want)
        assert np.all(err16 <= FP16_RELATIVE * np.abs(want) + FP16_ABSOLUTE)

        assert bf16[name].dtype == ml_dtypes.bfloat16 and bf16.dtypes[name] == "bfloat16"
        assert np.array_equal(bf16[name].view(np.uint16), _bf16_rne(want))
        err_bf = np.abs(bf16[name].astype(np.float32) - want)
        assert np.all(err_bf <= BF16_RELATIVE * np.abs(want))


def test_bf16_without_ml_dtypes_is_uint16_bits(client, store, monkeypatch):
    monkeypatch.setattr("ibpembed_client._result.BFLOAT16", None)
    features = _features(store, 3, 4)
    got = client.lookup(features, "sum", output_dtype="bfloat16")
    want = client.lookup(features, "sum")
    for name in features:
        assert got[name].dtype == np.uint16
        err = np.abs(bf16_to_float32(got[name]) - want[name])
        assert np.all(err <= BF16_RELATIVE * np.abs(want[name]))


def test_none_stays_bit_exact_and_refuses_an_output_dtype(client, store):
    features = {"user": FeatureBatch(np.array([1, 2, 3]), np.array([3], np.int32))}
    rows = client.lookup(features, "none")
    assert rows["user"].dtype == np.float32  # the table's dtype, unconverted
    for dtype in ("float32", "float16", "bfloat16"):
        with pytest.raises(LookupServiceError) as err:
            client.lookup(features, "none", output_dtype=dtype)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details.startswith("output_dtype")


def test_an_output_dtype_that_is_not_a_float_format(client):
    request = build_request({"user": [[1]]}, "sum")
    request.output_dtype = pb.DTYPE_INT8
    with pytest.raises(LookupServiceError) as err:
        client.lookup_request(request)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details.startswith("output_dtype")
    with pytest.raises(ValueError, match="output_dtype"):
        build_request({"user": [[1]]}, "sum", output_dtype="float64")  # type: ignore[arg-type]


def test_reduced_outputs_through_a_stream_and_a_region(client, store):
    features = _features(store, 11, 20)
    want = client.lookup(features, "mean", output_dtype="bfloat16")
    requests = [build_request(features, "mean", output_dtype="bfloat16") for _ in range(3)]
    for result in client.lookup_stream(requests):
        for name in features:
            assert result[name].dtype == ml_dtypes.bfloat16
            assert np.array_equal(result[name].view(np.uint16), want[name].view(np.uint16))
    with SharedMemoryRegion.create(f"/ibpembed-test-{uuid.uuid4().hex[:12]}", 1 << 20) as shm:
        client.register_region("half", shm)
        try:
            got = client.lookup(features, "mean", output_dtype="bfloat16", output_region="half")
            for name in features:
                assert np.array_equal(got[name].view(np.uint16), want[name].view(np.uint16))
        finally:
            client.unregister_region("half")
