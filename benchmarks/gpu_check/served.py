# SPDX-License-Identifier: Apache-2.0
"""Phase ``served``: the server's path, a packed table set through ``TableStore(device=...)``
and ``LookupEngine`` against the CPU store and engine on the same files, before and after row
updates; and the host memory placing the tables cost (the store maps the files read-only shared
for a GPU and registers the payloads in place: about no anonymous memory)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_check.common import Checks, anonymous_bytes, same_bits


def check_served(dev: torch.device) -> dict[str, Any]:
    """The server's path: a packed table set loaded by a TableStore placed for ``dev`` and a
    LookupEngine on ``dev``, against the CPU store and engine on the same files, before and
    after row updates. Also the host memory that placing the tables cost."""
    from benchmarks import data
    from ibpembed.engine import FeatureQuery, LookupEngine
    from ibpembed.tables.importers import TableSet, TableSource
    from ibpembed.tables.pack import pack_table_set
    from ibpembed.tables.store import TableStore

    checks = Checks()
    user = data.dlrm_table(20000, 64, seed=3)
    item = data.dlrm_table(5000, 32, seed=4).to(torch.bfloat16)
    rng = np.random.default_rng(2)
    with tempfile.TemporaryDirectory() as tmp:
        sources = (
            TableSource("user", user, feature_names=("user_id", "user_hist")),
            TableSource("item", item, feature_names=("item_id",)),
        )
        pack_table_set(Path(tmp), TableSet(sources), sample_rows=None)
        cpu_store = TableStore.load(tmp)
        before = anonymous_bytes()
        served = TableStore.load(tmp, device=dev)
        placed_bytes = anonymous_bytes() - before
        engines = (LookupEngine(served, device=dev.type), LookupEngine(cpu_store, device="cpu"))
        try:
            with served.acquire() as snap:
                payload = snap.kernel_table("user").payload
                in_place = payload.device.type == dev.type
            # Twice updated: the second update appends to the buffer the first made, whose
            # registration must outlive the first update's version.
            for step in ("loaded", "updated", "updated again"):
                for pooling in ("none", "sum", "mean"):
                    for batch in (1, 64, 512):
                        lengths = rng.integers(0, 20, batch).astype(np.int32)
                        features = [
                            FeatureQuery(
                                "user_hist", rng.integers(0, 20000, int(lengths.sum())), lengths
                            ),
                            FeatureQuery(
                                "item_id", rng.integers(0, 5000, batch), np.ones(batch, np.int32)
                            ),
                        ]
                        got, want = (e.run(features, pooling) for e in engines)
                        ok = all(
                            same_bits(a.values.cpu(), b.values)
                            for a, b in zip(got.features, want.features, strict=True)
                        )
                        checks.record(ok, f"served {step} {pooling} B={batch}", "served")
                if step != "updated again":
                    ids = torch.from_numpy(rng.choice(20000, 300, replace=False))
                    rows = torch.from_numpy(rng.standard_normal((300, 64)).astype(np.float32))
                    for store in (served, cpu_store):
                        store.update_rows("user", ids, rows)
        finally:
            for engine in engines:
                engine.close()
    return {
        "device": str(dev),
        "passed": checks.passed,
        "failures": checks.failures or [],
        "payload_read_in_place": in_place,
        "anonymous_bytes_to_place": placed_bytes,
        "payload_file_bytes": int(payload.numel()),
    }
