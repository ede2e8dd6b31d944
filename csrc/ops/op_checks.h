// SPDX-License-Identifier: Apache-2.0
//
// Argument checks of lookup_pooled that do not depend on the backend, shared by the CPU impl
// (torch_bindings.cpp) and the CUDA impl (torch_bindings_cuda.cpp) so both reject the same input
// with the same message. Device and contiguity checks stay with each backend.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

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

// The hot-row overlay's pairing and shapes (format.h). The CPU impl also checks the directory's
// count against hot_rows; the CUDA impl reads no overlay, but rejects what the CPU rejects.
inline void check_hot_rows_shape(const std::optional<at::Tensor>& hot_dir,
                                 const std::optional<at::Tensor>& hot_rows, int64_t num_rows,
                                 int64_t row_bytes) {
  TORCH_CHECK_VALUE(hot_dir.has_value() == hot_rows.has_value(),
                    "hot_dir and hot_rows go together: pass both or neither");
  if (!hot_dir.has_value()) return;
  const int64_t words = (num_rows + 63) / 64;
  TORCH_CHECK_VALUE(hot_dir->dim() == 1 && hot_dir->numel() == 2 * words, "hot_dir must have ",
                    2 * words, " entries (two per 64 rows), got shape ", hot_dir->sizes());
  TORCH_CHECK_VALUE(hot_rows->dim() == 2 && hot_rows->size(1) == row_bytes,
                    "hot_rows must be [cached rows, ", row_bytes, "], got shape ",
                    hot_rows->sizes());
}

}  // namespace ibpembed
