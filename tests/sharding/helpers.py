# SPDX-License-Identifier: Apache-2.0
"""Source tables for the sharding tests and ``ibpembed serve`` child processes."""

from __future__ import annotations

import numpy as np
import torch

from ibpembed import reference
from ibpembed.tables.importers import TableSet, TableSource
from tests.engine.helpers import FEATURES as ENGINE_FEATURES
from tests.engine.helpers import int8_rowwise

SHARDS = 3

# Awkward shapes, every dtype and a table with fewer rows than shards (left out of shard 0).
# Two features share emb_f32, so a shard request can carry two parts of one table.
FEATURES = {**ENGINE_FEATURES, "tiny": "emb_tiny"}


def make_table_set(seed: int = 0) -> TableSet:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    f32 = torch.randn(1000, 16, generator=gen) * 0.05
    f32[::97] = 0.0
    f32[5] = -0.0  # a sign bit only a bit-exact path keeps
    sources = (
        TableSource("emb_f32", f32, feature_names=("user", "user_hist")),
        TableSource(
            "emb_bf16",
            (torch.randn(500, 8, generator=gen) * 0.05).to(torch.bfloat16),
            feature_names=("item",),
        ),
        TableSource(
            "emb_f16",
            (torch.randn(301, 3, generator=gen) * 0.05).to(torch.float16),
            feature_names=("ctx",),
        ),
        TableSource(
            "emb_q8", int8_rowwise(300, 12, rng), quant="int8_rowwise", feature_names=("quant",)
        ),
        TableSource("emb_tiny", torch.randn(2, 4, generator=gen), feature_names=("tiny",)),
    )
    return TableSet(sources)


def values_of(source: TableSource) -> np.ndarray:
    """The table's rows as exact float64 values (dequantised for int8 row-wise)."""
    rows = source.weight.contiguous().view(torch.uint8).numpy().reshape(source.weight.shape[0], -1)
    kind = source.quant or str(source.weight.dtype).removeprefix("torch.")
    return reference.row_values(rows, kind)
