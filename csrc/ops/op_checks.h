// SPDX-License-Identifier: Apache-2.0
//
// Argument checks of lookup_pooled that do not depend on the backend, shared by the CPU impl
// (torch_bindings.cpp) and the CUDA impl (torch_bindings_cuda.cpp) so both reject the same input
// with the same message. Device and contiguity checks stay with each backend.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "ibpembed/format.h"
#include "ibpembed/numeric.h"

namespace ibpembed {

// The dtype and pooling codes, and the number of fp32 outputs per bag.
inline int64_t check_pooling_args(int64_t dtype, int64_t pooling, int64_t row_bytes) {
  TORCH_CHECK_VALUE(dtype >= 0 && dtype <= static_cast<int64_t>(DType::kInt8Rowwise),
                    "unknown dtype code ", dtype);
  TORCH_CHECK_VALUE(pooling == 0 || pooling == 1, "pooling must be 0 (sum) or 1 (mean), got ",
                    pooling);
  const int64_t dim = pooled_dim(static_cast<DType>(dtype), row_bytes);
  TORCH_CHECK_VALUE(dim > 0, "tables of dtype code ", dtype, " with ", row_bytes,
                    "-byte rows cannot be pooled (plain int8/uint8 rows carry no scale)");
  return dim;
}

inline void check_weights_shape(const at::Tensor& weights, int64_t nnz) {
  TORCH_CHECK_VALUE(weights.dim() == 1 && weights.numel() == nnz,
                    "per_sample_weights must be 1-D with one weight per index (", nnz,
                    "), got shape ", weights.sizes());
}

}  // namespace ibpembed
