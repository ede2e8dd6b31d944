# SPDX-License-Identifier: Apache-2.0
"""The client's shard map and request split, without servers."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import torch

from ibpembed_client import (
    FeatureBatch,
    LookupResult,
    LookupServiceError,
    ShardedTable,
    ShardMap,
    ShardRange,
    TableInfo,
    bf16_to_float32,
    build_request,
)
from ibpembed_client.shards import merge_results, split_request
from ibpembed_client.v1 import lookup_pb2 as pb
from tests.sharding.helpers import SHARDS

ADDRESSES = [f"127.0.0.1:{5000 + k}" for k in range(SHARDS)]


def info(name: str, start: int, end: int, total: int = 10, features=("f",)) -> TableInfo:
    return TableInfo(name, total, 4, "float32", "", 0, 0, 32, 1, start, end, tuple(features))


def two_shard_map() -> ShardMap:
    return ShardMap.from_table_infos(ADDRESSES[:2], [[info("t", 0, 4)], [info("t", 4, 10)]])


def test_load_matches_the_packed_ranges(packed):
    shard_map = ShardMap.load(packed.sharded, ADDRESSES)
    f32 = shard_map.tables["emb_f32"]
    assert f32.ranges == (ShardRange(0, 0, 333), ShardRange(1, 333, 666), ShardRange(2, 666, 1000))
    assert shard_map.tables["emb_q8"].pooled_dim == 12
    assert shard_map.features["user_hist"] == "emb_f32"
    assert shard_map.addresses == tuple(ADDRESSES)


def test_load_needs_an_address_per_shard(packed, tmp_path):
    with pytest.raises(ValueError, match=r"shards \[0, 1, 2\] have no address"):
        ShardMap.load(packed.sharded)
    with pytest.raises(ValueError, match="2 addresses for 3 shards"):
        ShardMap.load(packed.sharded, ADDRESSES[:2])
    (tmp_path / "shard_map.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not an ibpembed shard map"):
        ShardMap.load(tmp_path, ADDRESSES)


@pytest.mark.parametrize(
    ("ranges", "problem"),
    [
        ([(0, 0, 4), (1, 5, 10)], r"rows \[4, 5\) are held by no shard"),
        ([(0, 0, 6), (1, 4, 10)], r"rows \[4, 6\) are held by more than one shard"),
        ([(0, 0, 4), (1, 4, 9)], r"rows \[9, 10\) are held by no shard"),
        ([(0, 2, 10)], r"rows \[0, 2\) are held by no shard"),
    ],
)
def test_ranges_must_tile_the_table(ranges, problem):
    with pytest.raises(ValueError, match=problem):
        ShardedTable("t", 10, 4, "float32", None, tuple(ShardRange(*r) for r in ranges))


def test_a_shard_holds_at_most_one_range_of_a_table():
    # Split, the shard would get the feature twice in one request and reject it as repeated.
    ranges = (ShardRange(0, 4, 10), ShardRange(0, 0, 4))
    with pytest.raises(ValueError, match=r"'t': shard 0 holds two ranges, rows \[0, 4\) and \[4"):
        ShardedTable("t", 10, 4, "float32", None, ranges)


def test_servers_must_agree():
    with pytest.raises(ValueError, match=r"shard 0 .* reports rows, dim"):
        ShardMap.from_table_infos(ADDRESSES[:2], [[info("t", 0, 4)], [info("t", 4, 10, 11)]])
    with pytest.raises(ValueError, match="feature 'g' reads table 'a' on one shard and 'b'"):
        ShardMap.from_table_infos(
            ADDRESSES[:2],
            [[info("a", 0, 10, features=("g",))], [info("b", 0, 10, features=("g",))]],
        )


def test_server_without_a_range_holds_the_whole_table():
    shard_map = ShardMap.from_table_infos(ADDRESSES[:1], [[info("t", 0, 0)]])
    assert shard_map.tables["t"].ranges == (ShardRange(0, 0, 10),)


def test_split_keeps_request_order_and_only_samples_with_ids():
    ids = np.array([9, 1, 4, 3, 8, 0], dtype=np.int64)
    weights = np.arange(6, dtype=np.float32)
    batch = FeatureBatch(ids, np.array([2, 0, 3, 1], dtype=np.int32), weights)
    plan = split_request(two_shard_map(), build_request({"f": batch}, "mean", "r1"))
    low, high = plan.requests[0].features[0], plan.requests[1].features[0]
    assert plan.requests[0].pooling == plan.requests[1].pooling == pb.POOLING_SUM
    assert np.frombuffer(low.ids, "<i8").tolist() == [1, 3, 0]
    assert np.frombuffer(low.lengths, "<i4").tolist() == [1, 1, 1]  # samples 0, 2 and 3
    assert np.frombuffer(low.weights, "<f4").tolist() == [1, 3, 5]
    assert np.frombuffer(high.ids, "<i8").tolist() == [9, 4, 8]
    assert np.frombuffer(high.lengths, "<i4").tolist() == [1, 2]  # samples 0 and 2
    assert {r.request_id for r in plan.requests.values()} == {"r1"}
    # Partial sums as the shards would return them, merged and divided by the full lengths.
    dim = 4
    partial = {
        0: LookupResult("r1", 3, {"f": np.array([[1.0] * dim, [2.0] * dim, [3.0] * dim], "f4")}),
        1: LookupResult("r1", 3, {"f": np.array([[10.0] * dim, [20.0] * dim], "f4")}),
    }
    merged = merge_results(plan, partial)
    assert merged.table_version == 3
    assert merged["f"][:, 0].tolist() == [np.float32(11 / 2), 0.0, np.float32(22 / 3), 3.0]
    # Parts served from two versions never make one result.
    mixed = {**partial, 1: LookupResult("r1", 5, dict(partial[1]))}
    with pytest.raises(LookupServiceError, match="different table-set versions") as err:
        merge_results(plan, mixed)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_split_rejects_what_a_server_would():
    shard_map = two_shard_map()
    with pytest.raises(LookupServiceError) as err:
        split_request(shard_map, build_request({"nope": [[1]]}))
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(LookupServiceError, match=r"features\[0\].ids: .*id 10 out of range") as err:
        split_request(shard_map, build_request({"f": [[1, 10]]}))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    bad = build_request({"f": [[1, 2]]})
    bad.features[0].lengths = np.array([3], np.int32).tobytes()
    with pytest.raises(LookupServiceError, match="sum to 3 but there are 2 ids"):
        split_request(shard_map, bad)
    weighted = build_request({"f": FeatureBatch.from_lists([[1]], [[2.0]])}, "none")
    with pytest.raises(LookupServiceError, match="weights need pooling SUM or MEAN"):
        split_request(shard_map, weighted)
    bad = build_request({"f": [[1]]})
    bad.pooling = 9
    with pytest.raises(LookupServiceError, match="pooling: unknown value 9"):
        split_request(shard_map, bad)
    # uint8 rows only pool as NONE, even for a feature with no ids (which reaches no shard).
    u8 = TableInfo("u", 10, 12, "uint8", "", 0, 0, 32, 1, 0, 10, ("b",))
    u8_map = ShardMap.from_table_infos(ADDRESSES[:1], [[u8]])
    for batch in ([[], []], [[1, 2]]):
        with pytest.raises(LookupServiceError, match="only pool as NONE") as err:
            split_request(u8_map, build_request({"b": batch}, "sum"))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert split_request(u8_map, build_request({"b": [[1, 2]]}, "none")).requests


def test_split_refuses_regions_and_output_dtypes_a_server_would():
    shard_map = two_shard_map()
    with pytest.raises(ValueError, match="output_region: the sharded clients do not use"):
        split_request(shard_map, build_request({"f": [[1]]}, output_region="out"))
    with_inputs = build_request({"f": [[1]]})
    with_inputs.input_region.name = "in"
    with pytest.raises(ValueError, match="input_region: the sharded clients do not use"):
        split_request(shard_map, with_inputs)
    rows = build_request({"f": [[1]]}, "none", output_dtype="float16")
    with pytest.raises(LookupServiceError, match="output_dtype: pooling NONE") as err:
        split_request(shard_map, rows)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    unknown = build_request({"f": [[1]]})
    unknown.output_dtype = pb.DTYPE_INT8
    with pytest.raises(LookupServiceError, match="must be FLOAT32, FLOAT16 or BFLOAT16"):
        split_request(shard_map, unknown)


@pytest.mark.parametrize("output_dtype", ["float16", "bfloat16"])
def test_merged_sums_are_rounded_once_as_torch_rounds(output_dtype):
    """The shards sum in fp32; the merged sums are rounded to nearest even as a server (torch)
    rounds its own: ties, overflow to infinity; a NaN stays a NaN."""
    plan = split_request(
        two_shard_map(), build_request({"f": [[1, 9]] * 6}, "sum", output_dtype=output_dtype)
    )
    assert all(r.output_dtype == pb.DTYPE_UNSPECIFIED for r in plan.requests.values())
    rng = np.random.default_rng(0)
    low = rng.standard_normal((6, 4)).astype(np.float32)
    high = rng.standard_normal((6, 4)).astype(np.float32)
    low[0], high[0] = [1.0, 3.0e38, np.nan, -np.inf], [0.0, 3.0e38, 0.0, 0.0]
    # Sums exactly halfway between two bfloat16 (1 + 2**-8) and two float16 (1 + 2**-11)
    # values: to the even one below, and (three halves) above.
    low[1], high[1] = 1.0, [2.0**-8, 3 * 2.0**-8, 2.0**-11, 3 * 2.0**-11]
    with np.errstate(over="ignore"):  # 3e38 + 3e38: infinite in fp32 already
        merged = merge_results(
            plan, {0: LookupResult("r", 1, {"f": low}), 1: LookupResult("r", 1, {"f": high})}
        )
        sums = torch.from_numpy(low + high)
    got = merged["f"]
    assert merged.dtypes["f"] == output_dtype and got.itemsize == 2
    if output_dtype == "float16":
        assert got.dtype == np.float16
        want = sums.to(torch.float16).view(torch.int16).numpy()
    else:
        want = sums.to(torch.bfloat16).view(torch.int16).numpy()
    bits = got.view(np.int16)
    nan = np.isnan(sums.numpy())
    values = got.astype(np.float32) if output_dtype == "float16" else bf16_to_float32(bits)
    assert nan.sum() == 1 and np.isnan(values[nan]).all()
    assert (bits[~nan] == want[~nan]).all()
