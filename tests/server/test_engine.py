# SPDX-License-Identifier: Apache-2.0
"""LookupEngine in-process: the GIL is free while kernels run, admission, table grouping."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from ibpembed.codec import compress
from ibpembed.engine import DEDUPE_MIN_IDS, FeatureQuery, LookupEngine, resolve_device
from ibpembed.server.errors import DeadlineExceeded, Overloaded
from ibpembed.tables.store import TableStore
from tests.server.helpers import GateObserver, RecordingObserver, make_store


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


def test_expired_deadline_is_not_started():
    engine = LookupEngine(make_store(), max_workers=1)
    query = [FeatureQuery("user", np.array([1], np.int64), np.array([1], np.int32))]
    with pytest.raises(DeadlineExceeded):
        engine.run(query, "sum", deadline=time.monotonic() - 1.0)
    assert engine.run(query, "sum", deadline=time.monotonic() + 3600).version == 1
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
