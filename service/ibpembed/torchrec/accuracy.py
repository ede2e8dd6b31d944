# SPDX-License-Identifier: Apache-2.0
"""How far a compressed collection's pooled outputs may be from torchrec's: a derived bound."""

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# fp32's unit roundoff, and half its smallest subnormal (the absolute error of a rounding that
# underflows).
_U, _ETA = 2.0**-24, 2.0**-150
# The same pair for the format torchrec rounds a table's pooled sum to: its weight's dtype.
_OUTPUT_ROUNDING: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (0.0, 0.0),
    torch.float16: (2.0**-11, 2.0**-25),
    torch.bfloat16: (2.0**-8, 2.0**-134),
}


def pooled_error_bound(ebc: EmbeddingBagCollection, features: KeyedJaggedTensor) -> Tensor:
    """Elementwise bound on |compressed - torchrec| pooled outputs, [B, sum of dims] float64.

    Both modules pool the same bit-exact rows with fp32 arithmetic, possibly in different
    orders; torchrec then rounds each pooled sum to its table's weight dtype (a torchrec table
    whose config is not FP32 holds fp16 weights; ``.half()`` or ``.to(torch.bfloat16)`` casts
    them), and its MEAN divides that rounded sum and rounds again. The compressed module
    returns the fp32 sum, or that sum times the rounded fp32 reciprocal of the bag length.

    Derivation, per output element. A bag of L rows x_i with weights w_i (1 unweighted) has the
    exact sum S and A = sum_i |w_i x_i|; u = 2^-24, gamma_k = k u / (1 - k u). Each fp32
    rounding is fl(a op b) = (a op b)(1 + d) + e with |d| <= u and |e| <= eta = 2^-150 (e is
    nonzero only on underflow, never for a sum).

    - An fp32 sum s of the L products in any order: |s - S| <= E = gamma_L A + 2 L eta (Higham,
      *Accuracy and Stability of Numerical Algorithms*, sec. 3.1; the inner-product bound also
      covers rounding the products, whose underflow errors later additions grow by at most
      1 + gamma_L < 2).
    - Compressed: SUM is s. MEAN is fl(s fl(1/L)) = (s / L)(1 + d1)(1 + d2) + e, so
      |c - S/L| <= E / L + gamma_2 (|S| + E) / L + eta.
    - torchrec rounds s to a format of unit roundoff v and half-smallest-subnormal eta_v (fp32:
      v = eta_v = 0, no rounding; fp16: 2^-11, 2^-25; bf16: 2^-8, 2^-134; bf16's ties go away
      from zero, which a half-ulp bound does not mind): t = s (1 + d') + e', so
      |t - S| <= E_t = E + v (|S| + E) + eta_v, its SUM's bound. Its MEAN is
      q = rnd_v(y), y = fl(t / L): with |q - y| <= v |y| + eta_v, |y - t/L| <= u |t| / L + eta
      and |t| <= |S| + E_t, |q - S/L| <= E_t / L + (v (1 + u) + u)(|S| + E_t) / L + eta_v
      + (1 + v) eta. For fp32 tables that is torchrec's one rounded division.

    The two modules differ by at most the sum of their bounds. S and A are computed in float64,
    whose own error (about L 2^-53 A) is far below these terms. No bound holds where torchrec's
    rounded sum overflows (fp16 beyond 65504 is inf).

    Parameters
    ----------
    ebc : the float torchrec collection the compressed module was built from.
    features : the batch both modules pooled.
    """
    per_feature = features.to_dict()
    bounds = []
    for config in ebc.embedding_bag_configs():
        weight = ebc.embedding_bags[config.name].weight.detach()
        if weight.dtype not in _OUTPUT_ROUNDING:
            raise ValueError(
                f"table {config.name!r}: weights are {weight.dtype}; the bound covers "
                f"{sorted(str(d) for d in _OUTPUT_ROUNDING)}"
            )
        v, eta_v = _OUTPUT_ROUNDING[weight.dtype]
        rows = weight.double()
        for feature in config.feature_names:
            jt = per_feature[feature]
            w = jt.weights_or_none() if ebc.is_weighted() else None
            w = None if w is None else w.double()
            length = jt.lengths().double()[:, None]
            bag = torch.nn.functional.embedding_bag
            exact = bag(jt.values(), rows, jt.offsets(), mode="sum", per_sample_weights=w,
                        include_last_offset=True)  # fmt: skip
            abs_sum = bag(jt.values(), rows.abs(), jt.offsets(), mode="sum",
                          per_sample_weights=None if w is None else w.abs(),
                          include_last_offset=True)  # fmt: skip
            size = exact.abs()
            e = length * _U / (1 - length * _U) * abs_sum + 2 * length * _ETA
            e_t = e + v * (size + e) + eta_v
            if config.pooling == PoolingType.MEAN:
                n = length.clamp(min=1)
                gamma_2 = 2 * _U / (1 - 2 * _U)
                ours = e / n + gamma_2 * (size + e) / n + _ETA
                theirs = e_t / n + (v * (1 + _U) + _U) * (size + e_t) / n + eta_v + (1 + v) * _ETA
            else:
                ours, theirs = e, e_t
            bounds.append(ours + theirs)
    return torch.cat(bounds, dim=1)
