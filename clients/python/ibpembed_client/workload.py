# SPDX-License-Identifier: Apache-2.0
"""Synthetic recommendation traffic: Zipf ids over permuted rows, the DLRM-DCNv2 profile (table
cardinalities and pooling factors).

Used by the load generator, the service benchmark and the server's demo tables (one copy of the
profile); and recorded traffic to replay (:func:`read_recorded`). numpy only.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from ibpembed_client._request import FeatureBatch, Pooling, build_request
from ibpembed_client.v1 import lookup_pb2 as pb

# MLPerf DLRM-DCNv2 table cardinalities (Criteo 1TB, in feature order).
DCNV2_CARDINALITIES: tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip
# Ids per sample of each of the 26 features in the MLPerf DLRM-DCNv2 multi-hot dataset.
DCNV2_POOLING_FACTORS: tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip


class ZipfIds:
    """Ids in [0, num_rows) whose popularity follows Zipf(alpha), hot ids spread over the table.

    Ranks come from the continuous (bounded Pareto) approximation of Zipf by inverse CDF, so
    memory is O(1) even for 40M-row tables; rank r maps to row ``(r * a + b) mod num_rows`` with
    ``a`` coprime to ``num_rows``: a fixed permutation, so the hot rows are not rows 0, 1, 2...
    (tables are often sorted by frequency, and a prefix would flatter any cache).

    Parameters
    ----------
    num_rows : table size (< 2**32, so the permutation's products fit int64).
    alpha : Zipf exponent (> 0); 1.0-1.2 is typical of recommendation ids.
    rng : randomness for the samples and the permutation.
    """

    def __init__(self, num_rows: int, alpha: float, rng: np.random.Generator) -> None:
        if not 1 <= num_rows < 2**32 or alpha <= 0:
            raise ValueError(f"need 1 <= num_rows < 2**32, alpha > 0; got {num_rows}, {alpha}")
        self.num_rows = num_rows
        self.alpha = alpha
        self.rng = rng
        a = int(rng.integers(1, min(max(num_rows, 2), 2**31)))
        while math.gcd(a, num_rows) != 1:
            a += 1
        self._a, self._b = a, int(rng.integers(0, num_rows))

    def ranks(self, n: int) -> np.ndarray:
        """n ranks in [0, num_rows), rank 0 the most popular."""
        u = self.rng.random(n)
        big_n = float(self.num_rows) + 1.0
        if abs(self.alpha - 1.0) < 1e-9:
            x = np.power(big_n, u)
        else:
            e = 1.0 - self.alpha
            x = np.power(1.0 + u * (big_n**e - 1.0), 1.0 / e)
        return np.minimum(x.astype(np.int64) - 1, self.num_rows - 1).clip(0)

    def sample(self, n: int) -> np.ndarray:
        """n row ids (int64)."""
        return (self.ranks(n) * self._a + self._b) % self.num_rows


def hotness_for(features: Sequence[str], hotness: str) -> dict[str, int]:
    """Ids per sample per feature: ``"dcnv2"`` (the profile, by position) or a fixed integer."""
    if hotness == "dcnv2":
        return {
            f: DCNV2_POOLING_FACTORS[i % len(DCNV2_POOLING_FACTORS)] for i, f in enumerate(features)
        }
    value = int(hotness)
    if value < 0:
        raise ValueError(f"hotness must be >= 0, got {value}")
    return dict.fromkeys(features, value)


def make_requests(
    feature_rows: Mapping[str, int],
    *,
    batch_size: int,
    hotness: Mapping[str, int],
    alpha: float,
    pooling: Pooling,
    count: int,
    seed: int = 0,
) -> list[pb.LookupRequest]:
    """``count`` distinct requests of ``batch_size`` samples over ``feature_rows``."""
    rng = np.random.default_rng(seed)
    samplers = {f: ZipfIds(rows, alpha, rng) for f, rows in feature_rows.items()}
    requests = []
    for i in range(count):
        features = {}
        for name, sampler in samplers.items():
            hot = hotness[name]
            features[name] = FeatureBatch(
                sampler.sample(batch_size * hot), np.full(batch_size, hot, np.int32)
            )
        requests.append(build_request(features, pooling, request_id=f"load-{seed}-{i}"))
    return requests


def read_recorded(path: str | os.PathLike[str], pooling: Pooling) -> list[pb.LookupRequest]:
    """Requests recorded one per line of a JSON-lines file, each line mapping feature names to
    per-sample id lists (the list form of ``LookupClient.lookup``):
    ``{"cat_0": [[1, 2], [3]], "cat_1": [[7]]}``. Blank lines are skipped.

    Raises
    ------
    ValueError
        naming the file and line of the first line that is not such a request (float ids
        included), or for a file with none.
    """
    requests = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                features = json.loads(line)
                if not isinstance(features, dict) or not features:
                    raise ValueError("expected an object mapping features to per-sample id lists")
                requests.append(build_request(features, pooling, request_id=f"replay-{number}"))
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}:{number}: {err}") from None
    if not requests:
        raise ValueError(f"{path}: no requests recorded")
    return requests
