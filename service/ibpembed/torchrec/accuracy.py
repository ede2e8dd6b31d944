# SPDX-License-Identifier: Apache-2.0
"""How far a compressed collection's pooled outputs may be from torchrec's: an fp32 bound."""

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def pooled_error_bound(ebc: EmbeddingBagCollection, features: KeyedJaggedTensor) -> Tensor:
    """Elementwise bound on |compressed - torchrec| pooled outputs, [B, sum of dims] float64.

    Both modules pool the same bit-exact rows in fp32, possibly in different orders. Recursive
    fp32 summation of a bag of L (weighted) rows obeys |fl(S) - S| <= gamma_L * sum_i |w_i x_i| with
    gamma_L = L u / (1 - L u), u = 2^-24 (Higham, *Accuracy and Stability of Numerical Algorithms*,
    sec. 3.1; the bound for inner products also covers rounding the products). Each side is within
    that of the exact sum, so they differ by at most twice it. MEAN adds one rounded division per
    side (2 u |mean|). torchrec returns FP16 tables' sums rounded to fp16 while this module returns
    the fp32 sum, so FP16 tables add u16 |S| with u16 = 2^-11.

    Parameters
    ----------
    ebc : the float torchrec collection the compressed module was built from.
    features : the batch both modules pooled.
    """
    u32, u16 = 2.0**-24, 2.0**-11
    per_feature = features.to_dict()
    bounds = []
    for config in ebc.embedding_bag_configs():
        weight = ebc.embedding_bags[config.name].weight.detach().double()
        for feature in config.feature_names:
            jt = per_feature[feature]
            w = jt.weights_or_none() if ebc.is_weighted() else None
            w = None if w is None else w.double()
            lengths = jt.lengths().double()[:, None]
            bag = torch.nn.functional.embedding_bag
            exact = bag(jt.values(), weight, jt.offsets(), mode="sum", per_sample_weights=w,
                        include_last_offset=True)  # fmt: skip
            abs_sum = bag(jt.values(), weight.abs(), jt.offsets(), mode="sum",
                          per_sample_weights=None if w is None else w.abs(),
                          include_last_offset=True)  # fmt: skip
            bound = 2 * lengths * u32 / (1 - lengths * u32) * abs_sum
            if config.pooling == PoolingType.MEAN:
                count = lengths.clamp(min=1)
                exact, bound = exact / count, bound / count
                bound = bound + 2 * u32 * exact.abs()
            if config.data_type == DataType.FP16:
                bound = bound + u16 * exact.abs()
            bounds.append(bound)
    return torch.cat(bounds, dim=1)
