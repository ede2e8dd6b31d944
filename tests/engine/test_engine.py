# SPDX-License-Identifier: Apache-2.0
"""LookupEngine in-process: the GIL is free while kernels run, admission, table grouping."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpembed.codec import compress
from ibpembed.engine import (
    DEDUPE_MIN_IDS,
    FeatureQuery,
    LookupEngine,
    LookupOptions,
    resolve_device,
)
from ibpembed.errors import DeadlineExceeded, InvalidArgument, Overloaded
from ibpembed.tables.store import TableStore
from tests.engine.helpers import FEATURES, GateObserver, RecordingObserver, make_store, make_tables


def test_kernels_release_the_gil():
    """Python keeps running in another thread while a lookup decodes (so worker threads scale).

    Counts main-thread loop iterations between the worker's marks before and after a large
    lookup: had the kernel held the GIL, the main thread could not have run in between.
    """
    table = compress(torch.randn(50_000, 64) * 0.05, sample_rows=1024)
    store = TableStore.from_tables({"t": table})
    ids = np.random.default_rng(0).integers(0, 50_000, 200_000).astype(np.int64)
    query = [FeatureQuery("t", ids, np.full(2000, 100, np.int32))]
    engine = LookupEngine(store, max_workers=1, dedupe_max_unique_fraction=0.0)
    counter, marks = 0, []

    def work() -> None:
        marks.append(counter)
        engine.run(query, "sum")
        marks.append(counter)

    worker = threading.Thread(target=work)
    worker.start()
    while worker.is_alive():
        counter += 1
    engine.close()
    assert marks[1] - marks[0] > 1000


def test_admission_bound_and_release():
    gate = GateObserver()
    engine = LookupEngine(make_store(), max_workers=1, max_inflight=2, observer=gate)
    query = [FeatureQuery("user", np.array([1], np.int64), np.array([1], np.int32))]
    first, second = engine.submit(query, "sum"), engine.submit(query, "sum")
    with pytest.raises(Overloaded):
        engine.submit(query, "sum")
    assert engine.inflight == 2
    gate.open()
    for future in (first, second):
        assert future.result(timeout=30).version == 1
    engine.close()
    assert engine.inflight == 0


def test_a_slot_the_caller_holds_outlives_the_kernels():
    """A slot taken with admit() and passed to submit() is freed only when both the work and
    the caller have let go, in either order."""
    engine = LookupEngine(make_store(), max_workers=1, max_inflight=1)
    query = [FeatureQuery("user", np.array([1], np.int64), np.array([1], np.int32))]
    slot = engine.admit()
    engine.submit(query, "sum", slot=slot).result(timeout=30)
    assert engine.inflight == 1  # the work is done; the caller still holds it
    with pytest.raises(Overloaded):
        engine.admit()
    slot.release()
    waited = time.monotonic() + 30  # the worker's own release may still be on its way
    while engine.inflight and time.monotonic() < waited:
        time.sleep(0.001)
    assert engine.inflight == 0
    with pytest.raises(RuntimeError, match="released"):
        slot.release()

    gate = GateObserver()
    engine = LookupEngine(make_store(), max_workers=1, max_inflight=1, observer=gate)
    slot = engine.admit()
    future = engine.submit(query, "sum", slot=slot)
    slot.release()  # the caller lets go first (a stream that ended): the kernel still counts
    assert engine.inflight == 1
    gate.open()
    future.result(timeout=30)
    engine.close()
    assert engine.inflight == 0


def test_expired_deadline_is_not_started():
    engine = LookupEngine(make_store(), max_workers=1)
    query = [FeatureQuery("user", np.array([1], np.int64), np.array([1], np.int32))]
    with pytest.raises(DeadlineExceeded):
        engine.run(query, LookupOptions("sum", deadline=time.monotonic() - 1.0))
    assert engine.run(query, LookupOptions("sum", deadline=time.monotonic() + 3600)).version == 1
    engine.close()


def test_features_of_one_table_share_one_kernel_call():
    recorder = RecordingObserver()
    engine = LookupEngine(make_store(), max_workers=1, observer=recorder)
    ids = np.array([5, 5, 6], np.int64)
    query = [
        FeatureQuery("user", ids, np.array([3], np.int32)),
        FeatureQuery("user_hist", ids, np.array([1, 2], np.int32)),
        FeatureQuery("item", ids, np.array([3], np.int32)),
    ]
    result = asyncio.run(engine.lookup(query, "none"))
    engine.close()
    assert sorted(recorder.kernels) == [("emb_bf16", "none", 3, 2), ("emb_f32", "none", 6, 2)]
    assert [f.values.shape[0] for f in result.features] == [3, 3, 3]
    assert torch.equal(result.features[0].values, result.features[1].values)


def test_only_tables_with_many_ids_sort_them_by_default():
    """Below DEDUPE_MIN_IDS a table's ids go to the fused kernel (which decodes repeats once as
    far as its own cache reaches); from there on repeats are sorted out first."""
    table = compress(torch.randn(1000, 16) * 0.05)
    recorder = RecordingObserver()
    engine = LookupEngine(TableStore.from_tables({"t": table}), max_workers=1, observer=recorder)
    rng = np.random.default_rng(3)
    try:
        for nnz in (DEDUPE_MIN_IDS - 100, DEDUPE_MIN_IDS):
            ids = rng.integers(0, 50, nnz).astype(np.int64)  # 50 distinct rows
            lengths = np.full(nnz // 4, 4, np.int32)  # both counts are multiples of 4
            got = engine.run([FeatureQuery("t", ids, lengths)], "sum").features[0].values
            want = table.lookup(torch.from_numpy(ids), lengths=torch.from_numpy(lengths))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        engine.close()
    assert [(nnz, decoded) for _, _, nnz, decoded in recorder.kernels] == [
        (DEDUPE_MIN_IDS - 100, DEDUPE_MIN_IDS - 100),
        (DEDUPE_MIN_IDS, 50),
    ]
    with pytest.raises(ValueError, match="dedupe_min_ids"):
        LookupEngine(TableStore.from_tables({"t": table}), dedupe_min_ids=0)


def test_resolve_device_here_and_on_gpus_the_kernels_cannot_run_on(monkeypatch) -> None:
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="compute capability"):
            resolve_device("cuda")
    # What a GPU machine reports (no GPU here): a CUDA build on a GPU older than sm_80 stays
    # on the CPU with auto and refuses cuda; sm_90 and newer take the kernels.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda op, key: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"compute capability >= 8\.0"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    assert resolve_device("auto") == torch.device("cuda")


_FAULTS = ("negative length", "lengths sum", "id below", "id past")
_ROWS = {name: table.num_rows for name, table in make_tables().items()}


@st.composite
def _requests(draw: st.DrawFn) -> tuple[list[FeatureQuery], str, dict[int, str]]:
    """Features of the helper store in any order and subset (two read one table), batches of
    0-6 samples of 0-4 ids, weights on some features, and value faults on some."""
    pooling = draw(st.sampled_from(["sum", "mean", "none"]))
    names = draw(st.permutations(sorted(FEATURES)))[: draw(st.integers(1, len(FEATURES)))]
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    queries, faults = [], {}
    for i, name in enumerate(names):
        rows = _ROWS[FEATURES[name]]
        lengths = rng.integers(0, 5, draw(st.integers(0, 6))).astype(np.int32)
        ids = rng.integers(0, rows, int(lengths.sum())).astype(np.int64)
        weights = None
        if pooling != "none" and draw(st.booleans()):
            weights = rng.uniform(-1, 1, ids.size).astype(np.float32)
        fault = draw(st.sampled_from((None, None, *_FAULTS)))
        if fault == "negative length" and lengths.size >= 2:
            lengths[1] += lengths[0] + 1  # still sums to the ids
            lengths[0] = -1
        elif fault == "lengths sum" and lengths.size:
            lengths[-1] += 1
        elif fault in ("id below", "id past") and ids.size:
            ids[rng.integers(0, ids.size)] = -3 if fault == "id below" else rows + 7
        else:
            fault = None
        if fault is not None:
            faults[i] = fault
        queries.append(FeatureQuery(name, ids, lengths, weights))
    return queries, pooling, faults


@settings(max_examples=60, deadline=None)
@given(_requests())
def test_a_request_equals_its_features_looked_up_alone(request_) -> None:
    """The engine concatenates a request's features table by table and checks their values in
    one pass: results equal each feature's own codec lookup bit for bit, and a bad value is
    reported for the first bad feature in request order, as a feature-by-feature check would."""
    queries, pooling, faults = request_
    store = make_store()
    engine = LookupEngine(store, max_workers=1)
    try:
        if faults:
            first = min(faults)
            field = "lengths" if faults[first] in _FAULTS[:2] else "ids"
            with pytest.raises(InvalidArgument) as info:
                engine.run(queries, pooling)
            assert info.value.field == f"features[{first}].{field}"
            if field == "ids":
                query = queries[first]
                bad = -3 if faults[first] == "id below" else _ROWS[FEATURES[query.name]] + 7
                assert f"id {bad} out of range" in str(info.value)
            return
        result = engine.run(queries, pooling)
    finally:
        engine.close()
    with store.acquire() as snap:
        for query, got in zip(queries, result.features, strict=True):
            table = snap.tables[FEATURES[query.name]]
            ids = torch.from_numpy(query.ids)
            if pooling == "none":
                want = table.gather(ids)
            else:
                weights = None if query.weights is None else torch.from_numpy(query.weights)
                want = table.lookup(
                    ids, weights=weights, pooling=pooling, lengths=torch.from_numpy(query.lengths)
                )
            assert got.name == query.name
            assert torch.equal(got.values.view(torch.uint8), want.view(torch.uint8))
