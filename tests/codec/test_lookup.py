# SPDX-License-Identifier: Apache-2.0
"""Pooled lookups against the float64 reference (derived bound) and against torchrec's EBC."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpembed import _C, compress, cpu_path
from ibpembed import reference as ref
from ibpembed.codec import available_cpu_paths
from tests.codec.tables import (
    DTYPES,
    FLOAT_DTYPES,
    KINDS,
    POOLED_CASES,
    make_table,
    same_bits,
    staged_reads,
)

NUMPY_KIND = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _batch(rng: np.random.Generator, num_rows: int, bags: int, max_len: int):
    lengths = rng.integers(0, max_len + 1, bags)
    lengths[rng.random(bags) < 0.2] = 0  # empty bags
    ids = rng.integers(0, num_rows, int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return ids, offsets, lengths


def _check(c, values, ids, offsets, weights, pooling) -> None:
    got = c.lookup(
        torch.from_numpy(ids),
        torch.from_numpy(offsets),
        None if weights is None else torch.from_numpy(weights),
        pooling,
    ).numpy()
    exact = ref.lookup_pooled(values, ids, offsets, weights, pooling)
    tol = ref.pooled_tolerance(values, ids, offsets, weights, pooling)
    assert got.dtype == np.float32 and got.shape == exact.shape
    assert np.all(np.abs(got - exact) <= tol), np.max(np.abs(got - exact) - tol)


@given(**POOLED_CASES)
def test_pooled_matches_reference(dtype, dim, pooling, weighted, seed) -> None:
    rng = np.random.default_rng(seed)
    table = make_table(dtype, 300, dim, "trained_like", seed)
    c = compress(table)
    values = ref.row_values(table.view(torch.uint8).reshape(300, -1).numpy(), NUMPY_KIND[dtype])
    ids, offsets, _ = _batch(rng, 300, 40, 100)
    weights = rng.normal(size=len(ids)).astype(np.float32) if weighted else None
    _check(c, values, ids, offsets, weights, pooling)


def test_int8_rowwise_pooling_dequantises() -> None:
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 256, (500, 20), dtype=np.uint8)
    header = np.stack([rng.uniform(0.001, 0.02, 500), rng.uniform(-1, 0, 500)], axis=1).astype(
        np.float16
    )
    rows[:, :4] = header.view(np.uint8)
    c = compress(torch.from_numpy(rows), quant="int8_rowwise")
    values = ref.row_values(rows, "int8_rowwise")
    ids, offsets, _ = _batch(rng, 500, 64, 30)
    for pooling in ("sum", "mean"):
        _check(c, values, ids, offsets, rng.random(len(ids)).astype(np.float32), pooling)


def test_lengths_equal_offsets_and_empty_batches() -> None:
    table = make_table(torch.float32, 100, 8, "trained_like", 2)
    c = compress(table)
    ids = torch.tensor([1, 2, 3, 4, 99])
    by_offsets = c.lookup(ids, torch.tensor([0, 2, 2, 5]))
    by_lengths = c.lookup(ids, lengths=torch.tensor([2, 0, 3]))
    assert torch.equal(by_offsets, by_lengths)
    assert torch.equal(by_offsets[1], torch.zeros(8))
    no_bags = c.lookup(torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert no_bags.shape == (0, 8)


def test_mean_of_one_row_is_the_row_exactly() -> None:
    table = make_table(torch.float32, 64, 33, "edge_values", 3)
    c = compress(table)
    ids = torch.arange(64)
    pooled = c.lookup(ids, torch.arange(65), pooling="mean")
    # NaN payloads are not preserved through arithmetic, but every other value is exact.
    assert torch.equal(pooled.nan_to_num(0.0), table.nan_to_num(0.0))


# torchrec's CPU EBC (nn.functional.embedding_bag) takes per-sample weights only with SUM.
@pytest.mark.parametrize(("pooling", "weighted"), [("sum", False), ("sum", True), ("mean", False)])
def test_pooled_matches_torchrec_embedding_bag_collection(pooling: str, weighted: bool) -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(0)
    dims = {"t_small": 16, "t_wide": 64}
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=name,
                embedding_dim=dim,
                num_embeddings=1000,
                feature_names=[f"f_{name}"],
                pooling=PoolingType.SUM if pooling == "sum" else PoolingType.MEAN,
            )
            for name, dim in dims.items()
        ],
        is_weighted=weighted,
    )
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 20, 2 * 32)
    ids = rng.integers(0, 1000, int(lengths.sum()))
    weights = rng.random(len(ids)).astype(np.float32) if weighted else None
    kjt = KeyedJaggedTensor(
        keys=[f"f_{name}" for name in dims],
        values=torch.from_numpy(ids),
        lengths=torch.from_numpy(lengths).int(),
        weights=None if weights is None else torch.from_numpy(weights),
    )
    with torch.no_grad():
        expected = ebc(kjt).to_dict()
    state = ebc.state_dict()
    offset = 0
    for t, name in enumerate(dims):
        weight = state[f"embedding_bags.{name}.weight"]
        c = compress(weight.contiguous())
        table_lengths = torch.from_numpy(lengths[32 * t : 32 * (t + 1)])
        n = int(table_lengths.sum())
        table_ids = torch.from_numpy(ids[offset : offset + n])
        table_weights = None if weights is None else torch.from_numpy(weights[offset : offset + n])
        got = c.lookup(table_ids, lengths=table_lengths, weights=table_weights, pooling=pooling)
        values = weight.double().numpy()
        off = np.concatenate([[0], np.cumsum(table_lengths.numpy())])
        tol = ref.pooled_tolerance(
            values,
            table_ids.numpy(),
            off,
            None if table_weights is None else table_weights.numpy(),
            pooling,
        )
        diff = (got - expected[f"f_{name}"]).abs().numpy()
        assert np.all(diff <= tol), float((diff - tol).max())
        offset += n


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_raw_and_compressed_rows_pool_to_the_same_bits(dtype: torch.dtype) -> None:
    # Raw rows are summed in place from the payload, compressed ones after decoding: the same
    # values in the same order must give the same bits.
    rng = np.random.default_rng(11)
    table = make_table(dtype, 2000, 129, "trained_like", 11)
    ids, offsets, _ = _batch(rng, 2000, 300, 40)
    weights = torch.from_numpy(rng.normal(size=len(ids)).astype(np.float32))
    args = (torch.from_numpy(ids), torch.from_numpy(offsets), weights)
    compressed, raw = compress(table), compress(table, method="raw")
    assert compressed.compressed_rows > 0 and raw.compressed_rows == 0
    assert torch.equal(compressed.lookup(*args), raw.lookup(*args))


@settings(max_examples=200)  # small tables: 200 cases of this many axes take about 3 s
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    # 8-128: rows of 1, 2, 4 or 8 vectors of AVX2 or AVX-512, whole bags pooled at a time; the
    # rest column block by column block.
    dim=st.sampled_from((1, 8, 16, 32, 64, 72, 128, 129, 200)),
    pooling=st.sampled_from(("sum", "mean")),
    weighted=st.booleans(),
    # bags longer than a decode round, or of 0-4 ids, many to a round
    max_len=st.sampled_from((4, 150)),
    # raw rows and tier rows take the lean path; a tier of some rows mixes it with decodes
    storage=st.sampled_from(("compressed", "raw", "tier of every row", "tier of some rows")),
    # every pooling loop this CPU runs, not only the widest it picks
    loops=st.sampled_from(_C.available_pool_loops()),
    seed=st.integers(0, 2**32 - 1),
)
def test_pooled_is_sequential_fp32_bit_for_bit(
    dtype, dim, pooling, weighted, max_len, storage, loops, seed
) -> None:
    # lookup.h's contract: acc += w * value(row), one fp32 multiply then one fp32 add per element,
    # rows in bag order. numpy float32 array ops are exactly those IEEE operations, so the
    # vectorised kernels (accumulators in registers across a bag, bags cut by decode rounds,
    # column blocks of 64 and 8 plus a scalar tail) must match bit for bit.
    rng = np.random.default_rng(seed)
    table = make_table(dtype, 500, dim, "trained_like", seed)
    values = ref.row_values(table.view(torch.uint8).reshape(500, -1).numpy(), NUMPY_KIND[dtype])
    ids, offsets, lengths = _batch(rng, 500, 30 if max_len > 4 else 300, max_len)
    weights = rng.normal(size=len(ids)).astype(np.float32) if weighted else None
    c = compress(table, method="raw") if storage == "raw" else compress(table)
    if storage == "tier of every row":
        c = c.with_hot_rows(torch.arange(500))
    elif storage == "tier of some rows":
        c = c.with_hot_rows(torch.from_numpy(rng.choice(500, 250, replace=False)))
    widest = _C.pool_loops()
    try:
        _C.set_pool_loops(loops)
        got = c.lookup(
            torch.from_numpy(ids),
            torch.from_numpy(offsets),
            None if weights is None else torch.from_numpy(weights),
            pooling,
        )
    finally:
        _C.set_pool_loops(widest)
    expected = np.zeros((len(lengths), dim), dtype=np.float32)
    for b in range(len(lengths)):
        for i in range(offsets[b], offsets[b + 1]):
            w = np.float32(1.0) if weights is None else weights[i]
            expected[b] = expected[b] + w * values[ids[i]].astype(np.float32)
        if pooling == "mean" and lengths[b] > 0:
            expected[b] = expected[b] * (np.float32(1.0) / np.float32(lengths[b]))
    assert np.array_equal(got.numpy().view(np.int32), expected.view(np.int32))


@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    # 8 KB fp32 rows leave the repeat cache (codec.h) 64 slots, so 40-400 distinct ids fight
    # over them; narrow rows get thousands of slots and mostly hit.
    dim=st.sampled_from((1, 33, 128, 2048)),
    distinct=st.sampled_from((1, 3, 40, 400)),
    num_ids=st.integers(2, 3000),
    hot=st.booleans(),
    weighted=st.booleans(),
    pooling=st.sampled_from(("sum", "mean")),
    path=st.sampled_from(available_cpu_paths()),
    staged=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_repeated_ids_pool_to_the_bits_of_raw_rows(
    dtype, dim, distinct, num_ids, hot, weighted, pooling, path, staged, seed
) -> None:
    # A pooled call decodes a repeated id once and reads its copy afterwards, from a
    # direct-mapped cache whose slots are contended: every row must still be the row its id
    # names, in every round, with or without a decoded tier in the mix.
    rng = np.random.default_rng(seed)
    rows = 500
    table = make_table(dtype, rows, dim, "trained_like", seed)
    pool = rng.choice(rows, size=distinct, replace=False)
    ids = pool[np.minimum(rng.zipf(1.3, num_ids) - 1, distinct - 1)]  # skewed, like Zipf traffic
    cuts = np.sort(rng.integers(0, num_ids + 1, max(1, num_ids // 40)))
    offsets = np.concatenate([[0], cuts, [num_ids]])
    args = (
        torch.from_numpy(ids),
        torch.from_numpy(offsets),
        torch.from_numpy(rng.normal(size=num_ids).astype(np.float32)) if weighted else None,
        pooling,
    )
    compressed = compress(table)
    if hot:
        compressed = compressed.with_hot_rows(torch.from_numpy(pool[: max(1, distinct // 4)]))
    raw = compress(table, method="raw")
    before = cpu_path()
    try:
        _C.set_cpu_path(path)  # every path runs the same pipeline, each with its own decoder
        with staged_reads(staged):
            assert torch.equal(compressed.lookup(*args), raw.lookup(*args))
    finally:
        _C.set_cpu_path(before)


def test_a_call_whose_repeat_cache_does_not_pay_drops_it_mid_call() -> None:
    # 288 distinct ids take 288 slots and re-read none, so the call stops using its cache (after
    # 256 takes, codec.h) while the next round's rows already point at slots; the repeats after
    # that decode again. Every row must still be its own.
    table = make_table(torch.float32, 1000, 128, "trained_like", 5)
    rng = np.random.default_rng(5)
    ids = np.concatenate([np.arange(288), np.arange(64), rng.integers(0, 288, 2000)])
    offsets = np.arange(0, ids.size + 1, 8)
    args = (torch.from_numpy(ids), torch.from_numpy(offsets))
    assert torch.equal(compress(table).lookup(*args), compress(table, method="raw").lookup(*args))


@pytest.mark.parametrize("path", available_cpu_paths())
def test_rows_staged_near_the_payload_end_pool_in_any_round(path: str) -> None:
    # On a table read in place, the payload's last rows are decoded from a stage (their decoder
    # may read past the payload), and a pooled call walks a round only when it holds such a row:
    # rounds of 32 ids with the last row in some rounds (either parity, first or last position)
    # and not others must all pool the rows their ids name.
    rows = 300
    table = make_table(torch.float32, rows, 64, "trained_like", 3)
    compressed, raw = compress(table), compress(table, method="raw")
    assert compressed.compressed_rows > rows // 2
    rng = np.random.default_rng(3)
    ids = rng.integers(0, rows - 8, 32 * 6)
    for where in (32, 2 * 32 + 31, 3 * 32 + 5, 5 * 32 + 31):  # rounds 1, 2, 3, 5
        ids[where] = rows - 1
    offsets = np.arange(0, len(ids) + 1, 7)
    offsets[-1] = len(ids)
    args = (torch.from_numpy(ids), torch.from_numpy(offsets))
    before = cpu_path()
    try:
        _C.set_cpu_path(path)
        with staged_reads(False):
            assert torch.equal(compressed.lookup(*args), raw.lookup(*args))
            assert torch.equal(compressed.gather(args[0]), raw.gather(args[0]))
    finally:
        _C.set_cpu_path(before)


@given(
    dtype=st.sampled_from(DTYPES),
    dim=st.sampled_from((1, 3, 33, 128, 129)),
    kind=st.sampled_from(KINDS),
    rows=st.integers(1, 400),
    runs=st.sampled_from((0.0, 0.5, 1.0)),
    staged=st.booleans(),
    path=st.sampled_from(available_cpu_paths()),
    seed=st.integers(0, 2**32 - 1),
)
def test_staged_and_prefetched_reads_give_every_row_bit_for_bit(
    dtype, dim, kind, rows, runs, staged, path, seed
) -> None:
    # Rows reach the decoder two ways (row_kernels_impl.h): copied into a stage (tables larger
    # than the last-level cache, ids out of order) or read where they lie (smaller tables, runs
    # of consecutive ids, the payload's end excepted). Ids that mix runs, jumps, repeats and the
    # last rows must gather and pool to the raw rows' bits either way.
    rng = np.random.default_rng(seed)
    table = make_table(dtype, rows, dim, kind, seed)
    num_ids = int(rng.integers(1, 300))
    ids = rng.integers(0, rows, num_ids)
    in_run = rng.random(num_ids) < runs
    for i in range(1, num_ids):
        if in_run[i]:
            ids[i] = min(ids[i - 1] + 1, rows - 1)
    offsets = np.concatenate([[0], np.sort(rng.integers(0, num_ids + 1, 5)), [num_ids]])
    compressed, raw = compress(table), compress(table, method="raw")
    ids_t, offsets_t = torch.from_numpy(ids), torch.from_numpy(offsets)
    before = cpu_path()
    try:
        _C.set_cpu_path(path)
        with staged_reads(staged):
            assert same_bits(compressed.gather(ids_t), table[ids_t])
            if dtype in FLOAT_DTYPES:  # NaN rows pool to NaN payloads: compare bits
                pooled = compressed.lookup(ids_t, offsets_t)
                assert same_bits(pooled, raw.lookup(ids_t, offsets_t))
    finally:
        _C.set_cpu_path(before)
