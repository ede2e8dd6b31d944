# SPDX-License-Identifier: Apache-2.0
"""Every RPC over real gRPC on loopback: results against the codec and the in-process engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from ibpembed import reference
from ibpembed.engine import FeatureQuery, LookupEngine
from ibpembed.tables.store import TableStore
from ibpembed_client import (
    FeatureBatch,
    LookupClient,
    LookupServiceError,
    bf16_to_float32,
    build_request,
)
from tests.engine.helpers import FEATURES, RecordingObserver, make_store, source_tables
from tests.server.helpers import RunningServer

POOLED = ("sum", "mean")
NUMPY_OF = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


@pytest.fixture(scope="module")
def store():
    return make_store()


@pytest.fixture(scope="module")
def server(store):
    with RunningServer(store) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with LookupClient(server.target, timeout=30) as c:
        yield c


def _batch(rng: np.random.Generator, rows: int, batch: int, weighted: bool) -> FeatureBatch:
    """Jagged ids with empty samples, repeats and both ends of the id range."""
    lengths = rng.integers(0, 6, batch).astype(np.int32)
    ids = rng.integers(0, rows, int(lengths.sum())).astype(np.int64)
    if ids.size >= 2:
        ids[0], ids[-1] = 0, rows - 1
    weights = rng.uniform(-1, 2, ids.size).astype(np.float32) if weighted else None
    return FeatureBatch(ids, lengths, weights)


def _request(store, rng, batch: int, weighted: bool = False) -> dict[str, FeatureBatch]:
    with store.acquire() as snap:
        return {
            f: _batch(rng, snap.tables[t].num_rows, batch, weighted) for f, t in FEATURES.items()
        }


@pytest.mark.parametrize("batch", [0, 1, 7, 64])
def test_none_is_bit_exact_gather(client, store, batch):
    features = _request(store, np.random.default_rng(batch), batch)
    result = client.lookup(features, pooling="none")
    with store.acquire() as snap:
        for name, fb in features.items():
            table = snap.tables[FEATURES[name]]
            want = table.gather(torch.from_numpy(fb.ids))
            got = result[name]
            assert got.shape == (fb.ids.size, table.dim)
            expect = want.view(torch.int16) if want.dtype == torch.bfloat16 else want
            assert np.array_equal(got.view(np.uint8), expect.numpy().view(np.uint8))


def test_bf16_rows_decode_to_the_table_values(client, store):
    result = client.lookup({"item": [[4, 5]]}, pooling="none")
    assert result.dtypes["item"] == "bfloat16"
    with store.acquire() as snap:
        want = snap.tables["emb_bf16"].gather(torch.tensor([4, 5])).float().numpy()
    assert np.array_equal(bf16_to_float32(result["item"]), want)


@pytest.mark.parametrize("pooling", POOLED)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("batch", [0, 1, 33])
def test_pooled_matches_codec_and_engine(client, store, pooling, weighted, batch):
    features = _request(store, np.random.default_rng(100 + batch), batch, weighted)
    result = client.lookup(features, pooling=pooling)
    engine = LookupEngine(store, max_workers=1)
    try:
        queries = [FeatureQuery(n, fb.ids, fb.lengths, fb.weights) for n, fb in features.items()]
        in_process = engine.run(queries, pooling)
    finally:
        engine.close()
    with store.acquire() as snap:
        for out, (name, fb) in zip(in_process.features, features.items(), strict=True):
            table = snap.tables[FEATURES[name]]
            weights = None if fb.weights is None else torch.from_numpy(fb.weights)
            want = table.lookup(
                torch.from_numpy(fb.ids),
                weights=weights,
                pooling=pooling,
                lengths=torch.from_numpy(fb.lengths),
            )
            got = result[name]
            assert got.dtype == np.float32 and got.shape == tuple(want.shape)
            assert np.array_equal(got, out.values.numpy())  # gRPC changes nothing
            torch.testing.assert_close(torch.from_numpy(got.copy()), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_dedupe_and_fused_paths_agree(store, fraction):
    """Pooling over decoded distinct rows (fraction 1.0) and the fused kernel (fraction 0.0) give
    the exact sums within fp32 rounding, and each arm took the path it names: the kernel call's
    count of decoded rows is the distinct ids for decode-once, every id for the fused kernel."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 20, 400).astype(np.int64)  # heavy repeats
    lengths = np.full(40, 10, np.int32)
    weights = rng.uniform(0, 1, 400).astype(np.float32)
    query = [FeatureQuery("user", ids, lengths, weights)]
    observer = RecordingObserver()
    engine = LookupEngine(
        store,
        max_workers=1,
        dedupe_max_unique_fraction=fraction,
        dedupe_min_ids=1,
        observer=observer,
    )
    try:
        got = engine.run(query, "mean").features[0].values
    finally:
        engine.close()
    decoded = np.unique(ids).size if fraction else ids.size
    assert np.unique(ids).size < ids.size  # the arms' counts differ: they tell the paths apart
    assert observer.kernels == [("emb_f32", "mean", ids.size, decoded)]
    values = source_tables()["emb_f32"].double().numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    exact = reference.lookup_pooled(values, ids, offsets, weights, "mean")
    tol = reference.pooled_tolerance(values, ids, offsets, weights, "mean")
    assert got.dtype == torch.float32 and tuple(got.shape) == exact.shape
    excess = np.abs(got.double().numpy() - exact) - tol
    assert (excess <= 0).all(), f"{(excess > 0).sum()} elements off, worst by {excess.max():.3g}"


def test_empty_request_and_request_id_echo(client):
    result = client.lookup({}, request_id="abc-1")
    assert result.request_id == "abc-1" and dict(result) == {}
    assert client.lookup({"user": [[1]]}).request_id  # the server made one up


def test_stream_keeps_order_and_survives_bad_requests(client, store):
    rng = np.random.default_rng(3)
    good = [_request(store, rng, 5) for _ in range(12)]
    requests = [build_request(f, "sum", request_id=f"r{i}") for i, f in enumerate(good)]
    requests.insert(4, build_request({"no_such_feature": [[1]]}, request_id="bad"))
    results = list(client.lookup_stream(requests))
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    bad = results.pop(4)
    assert bad.error is not None and bad.error.code.name == "NOT_FOUND"
    with pytest.raises(LookupServiceError):
        bad["user"]
    for features, result in zip(good, results, strict=True):
        unary = client.lookup(features, "sum")
        for name in features:
            assert np.array_equal(result[name], unary[name])


def test_list_and_describe_tables(client, store):
    tables = {t.name: t for t in client.list_tables()}
    assert set(tables) == set(FEATURES.values())
    f32 = client.describe_table("emb_f32")
    assert f32 == tables["emb_f32"]
    assert f32.features == ("user", "user_hist")
    assert (f32.num_rows, f32.dim, f32.dtype, f32.row_start, f32.row_end) == (
        1000,
        16,
        "float32",
        0,
        1000,
    )
    with store.acquire() as snap:
        table = snap.tables["emb_f32"]
        assert (f32.raw_bytes, f32.stored_bytes) == (table.raw_bytes, table.stored_bytes)
        assert f32.chunk_bits == table.chunk_bits and f32.version == snap.version
    assert client.describe_table("emb_q8").quant == "int8_rowwise"
    assert client.describe_table("emb_bf16").dtype == "bfloat16"


def test_eight_threads_two_hundred_calls_each(client, store):
    errors: list[BaseException] = []
    checks = {"user": [[1, 2, 3], [4]], "item": [[5]]}
    want = client.lookup(checks, "sum")

    def worker() -> None:
        try:
            for _ in range(200):
                got = client.lookup(checks, "sum")
                assert np.array_equal(got["user"], want["user"])
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_large_pooled_response_fits_default_message_size(store):
    """A [2048 x 26 x 128] fp32 response is ~27 MB: over gRPC's 4 MB default, under ours."""
    from ibpembed.server import demo
    from ibpembed_client.workload import DCNV2_POOLING_FACTORS

    tables = demo.build(max_rows=64)
    big = TableStore.from_tables(tables)
    rng = np.random.default_rng(0)
    features = {}
    for name, hot in zip(demo.feature_names(), DCNV2_POOLING_FACTORS, strict=True):
        rows = tables[name].num_rows
        features[name] = FeatureBatch(
            rng.integers(0, rows, 2048 * hot).astype(np.int64), np.full(2048, hot, np.int32)
        )
    with RunningServer(big) as running, LookupClient(running.target, timeout=120) as c:
        result = c.lookup(features, "sum")
    assert sum(v.nbytes for v in result.values()) == 2048 * 26 * 128 * 4
