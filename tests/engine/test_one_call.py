# SPDX-License-Identifier: Apache-2.0
"""The per-request native path: a PackedRequest (one array per field, as the servicer decodes
it) pooled in one kernel call gives the general path's results bit for bit, and any request it
cannot serve falls back to the general path, which raises the same error naming the field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ibpembed.engine import FeatureQuery, LookupEngine, LookupOptions, PackedRequest
from ibpembed.errors import InvalidArgument, NotFound
from tests.engine.helpers import FEATURES, RecordingObserver, make_store

POOLED = ["user", "user_hist", "item", "ctx", "quant"]


@pytest.fixture(scope="module")
def store():
    return make_store()


@pytest.fixture()
def engine(store):
    observer = RecordingObserver()
    engine = LookupEngine(store, max_workers=1, observer=observer)
    yield engine
    engine.close()


def _queries(store, seed: int, batch: int, names=POOLED) -> list[FeatureQuery]:
    rng = np.random.default_rng(seed)
    out = []
    with store.acquire() as snap:
        for name in names:
            rows = snap.tables[FEATURES[name]].num_rows
            lengths = rng.integers(0, 7, batch).astype(np.int32)
            ids = rng.integers(0, rows, int(lengths.sum())).astype(np.int64)
            out.append(FeatureQuery(name, ids, lengths))
    return out


def _packed(queries: list[FeatureQuery]) -> PackedRequest:
    return PackedRequest(
        names=[q.name for q in queries],
        ids=np.concatenate([q.ids for q in queries] or [np.empty(0, np.int64)]),
        lengths=np.concatenate([q.lengths for q in queries] or [np.empty(0, np.int32)]),
        id_counts=np.array([q.ids.size for q in queries], dtype=np.int64),
        sample_counts=np.array([q.lengths.size for q in queries], dtype=np.int64),
    )


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("batch", [0, 1, 19])
def test_one_call_matches_the_general_path(engine, store, pooling, batch):
    queries = _queries(store, batch, batch)
    general = engine.run(queries, pooling)
    engine.observer.kernels.clear()
    packed = engine.run(_packed(queries), pooling)
    assert [f.name for f in packed.features] == [f.name for f in general.features]
    for got, want in zip(packed.features, general.features, strict=True):
        assert got.values.dtype == want.values.dtype and got.values.shape == want.values.shape
        assert torch.equal(got.values.view(torch.int32), want.values.view(torch.int32))
    # One kernel entry per feature, reported once for the request.
    assert [k[0] for k in engine.observer.kernels] == [FEATURES[n] for n in POOLED]


def test_bf16_outputs_from_one_call(engine, store):
    queries = _queries(store, 3, 8)
    want = engine.run(queries, LookupOptions("sum", output_dtype=torch.bfloat16))
    got = engine.run(_packed(queries), LookupOptions("sum", output_dtype=torch.bfloat16))
    for g, w in zip(got.features, want.features, strict=True):
        assert g.values.dtype == torch.bfloat16 and torch.equal(g.values, w.values)


def _error(engine, request, pooling="sum") -> tuple[type, str]:
    with pytest.raises((InvalidArgument, NotFound)) as err:
        engine.run(request, pooling)
    return type(err.value), str(err.value)


def test_bad_requests_get_the_general_paths_errors(engine, store):
    base = _queries(store, 5, 4, names=["user", "item", "ctx"])
    cases = []
    out_of_range = list(base)
    ids = base[1].ids.copy()
    ids[-1] = 10**6
    out_of_range[1] = FeatureQuery("item", ids, base[1].lengths)
    cases.append(out_of_range)
    negative = list(base)
    lengths = base[2].lengths.copy()
    lengths[:2] = [-1, lengths[0] + lengths[1] + 1]
    negative[2] = FeatureQuery("ctx", base[2].ids, lengths)
    cases.append(negative)
    spill = list(base)  # the right total, split wrongly between two features
    spill[0] = FeatureQuery("user", base[0].ids, base[0].lengths + np.int32(1))
    cases.append(spill)
    cases.append([*base, FeatureQuery("nope", np.zeros(1, np.int64), np.ones(1, np.int32))])
    cases.append([*base, base[0]])  # repeated feature
    for queries in cases:
        want = _error(engine, queries)
        got = _error(engine, _packed(queries))
        assert got == want


def test_hot_rows_see_only_checked_ids():
    """A request refused for an out-of-range id leaves nothing in the hot tier's buffers (what
    it asked for was never looked up: counted, its ids would skew the admission)."""
    store = make_store()  # its own: the refresh publishes copies into it
    engine = LookupEngine(store, max_workers=1, hot_tier="50%", hot_tier_refresh_s=3600)
    try:
        assert engine.tier is not None
        ids = np.array([10**9, 1, 2], dtype=np.int64)
        with pytest.raises(InvalidArgument):
            engine.run(_packed([FeatureQuery("user", ids, np.array([3], np.int32))]), "sum")
        hot = np.repeat(np.arange(8, dtype=np.int64), 4)
        engine.run(_packed([FeatureQuery("user", hot, np.array([hot.size], np.int32))]), "sum")
        engine.tier.refresh()
        with store.acquire() as snap:
            copies = snap.tables["emb_f32"].hot
        # Only the served rows 0..7 were recorded (row 0, a zero row stored raw, may stay out
        # of the tier): the refused request's 10**9 is nowhere.
        assert copies is not None and set(range(1, 8)) <= set(copies.ids.tolist()) <= set(range(8))
        assert copies.coverage == 1.0
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_results_of_one_width_round_together_as_one_by_one(engine, store, dtype):
    """Same-width results take the one-conversion path; each is still its fp32 result rounded."""
    queries = _queries(store, 23, 6, names=["user", "user_hist"])
    fp32 = engine.run(_packed(queries), "mean")
    rounded = engine.run(_packed(queries), LookupOptions("mean", output_dtype=dtype))
    for got, want in zip(rounded.features, fp32.features, strict=True):
        assert got.values.dtype == dtype and got.values.is_contiguous()
        assert torch.equal(got.values, want.values.to(dtype))


def test_counts_that_do_not_split_the_arrays_are_refused(engine, store):
    good = _packed(_queries(store, 5, 4, names=["user", "item"]))
    ids, lengths = good.ids, good.lengths
    cases = {
        "id_counts": [
            dataclasses.replace(good, id_counts=good.id_counts + 1),  # past the ids
            dataclasses.replace(good, id_counts=good.id_counts[:1]),  # fewer than the names
        ],
        "sample_counts": [
            dataclasses.replace(good, sample_counts=good.sample_counts * 3),  # past the lengths
            dataclasses.replace(good, sample_counts=np.array([-1, lengths.size + 1])),
        ],
    }
    for field, requests in cases.items():
        for request in requests:
            with pytest.raises(InvalidArgument) as error:
                engine.run(request, "sum")
            assert error.value.field == field
    assert engine.run(dataclasses.replace(good, ids=ids.copy()), "sum").features


def test_arrays_that_are_not_numpy_are_refused(engine, store):
    query = _queries(store, 1, 2, names=["user"])[0]
    for field in ("ids", "lengths", "weights"):
        bad = dataclasses.replace(query, **{field: [1]})
        with pytest.raises(InvalidArgument, match="must be a numpy array") as error:
            engine.run([bad], "sum")
        assert error.value.field == f"features[0].{field}"
