// SPDX-License-Identifier: Apache-2.0
//
// Argument checks that do not depend on the backend, shared by the CPU impls (codec_ops.cpp,
// lookup_ops.cpp) and the CUDA impls (lookup_ops_cuda.cpp) so both reject the same input with
// the same message. Device, dtype and contiguity checks stay with each backend, and run first.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "ibpembed/format.h"
#include "ibpembed/numeric.h"
#include "ibpembed/tier.h"

namespace ibpembed {

// A table argument that fails its check: the ValueError TORCH_CHECK_VALUE raises, with the same
// message, that also names the argument (`arg`: "block_base", "chunk_bits", ...), so that a
// caller tells which one failed without parsing the message (table_shape_problem, for the
// torchrec module's state-dict checks).
class TableArgError : public c10::ValueError {
 public:
  TableArgError(c10::SourceLocation where, const char* arg, std::string msg)
      : c10::ValueError(where, std::move(msg)), arg_(arg) {}
  const char* arg() const { return arg_; }

 private:
  const char* arg_;
};

// TORCH_CHECK_VALUE for table argument `arg`, raising TableArgError; the message is built only
// on failure.
#define IBP_CHECK_TABLE_ARG(cond, arg, ...)                                                       \
  do {                                                                                            \
    if (C10_UNLIKELY(!(cond))) {                                                                  \
      throw ::ibpembed::TableArgError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, arg, \
                                      ::c10::str(__VA_ARGS__));                                   \
    }                                                                                             \
  } while (false)

inline void check_chunk_bits(int64_t chunk_bits) {
  IBP_CHECK_TABLE_ARG(chunk_bits == 16 || chunk_bits == 32 || chunk_bits == 64, "chunk_bits",
                      "chunk_bits must be 16, 32 or 64, got ", chunk_bits);
}

// mask [V] and bitval [V * (2^C - 1)]; returns the code width C the codebook length implies.
inline int check_mask_shapes(const at::Tensor& mask, const at::Tensor& bitval, int64_t v) {
  IBP_CHECK_TABLE_ARG(mask.dim() == 1 && mask.numel() == v, "mask", "mask must have ", v,
                      " entries (one per chunk position), got shape ", mask.sizes());
  const int code_bits = bitval.dim() == 1 ? code_bits_for(bitval.numel(), static_cast<int>(v)) : 0;
  static_assert(kMaxCodeBits == 4, "the message below lists every valid codebook length");
  IBP_CHECK_TABLE_ARG(code_bits != 0, "bitval",
                      "bitval must have V * (2^C - 1) entries for V = ", v,
                      " chunk positions and a code width C in [1, 4] (", v * codebook_size(1), ", ",
                      v * codebook_size(2), ", ", v * codebook_size(3), " or ",
                      v * codebook_size(4), "), got shape ", bitval.sizes());
  return code_bits;
}

// What a table's ints imply about its tensors.
struct TableShape {
  int chunks;     // V: chunk positions per row
  int code_bits;  // C: the codebooks' code width
};

// The row geometry's ints (row width, slot unit, row count) and the index shapes they imply;
// returns the number of index blocks.
inline int64_t check_index_shapes(const at::Tensor& block_base, const at::Tensor& row_units,
                                  int64_t row_bytes, int64_t unit_bytes, int64_t num_rows) {
  IBP_CHECK_TABLE_ARG(row_bytes > 0 && row_bytes <= kMaxRowBytes, "row_bytes",
                      "row_bytes out of range: ", row_bytes);
  IBP_CHECK_TABLE_ARG(num_rows >= 0, "num_rows", "num_rows must be >= 0");
  IBP_CHECK_TABLE_ARG(unit_bytes > 0 && unit_bytes == slot_unit_bytes(row_bytes, unit_bytes),
                      "unit_bytes", "unit_bytes ", unit_bytes, " is not a valid slot unit for ",
                      row_bytes, "-byte rows");
  const int64_t blocks = num_blocks(num_rows);
  IBP_CHECK_TABLE_ARG(block_base.numel() == blocks + 1, "block_base", "block_base must have ",
                      blocks + 1, " entries, got ", block_base.numel());
  IBP_CHECK_TABLE_ARG(row_units.numel() == blocks * kRowsPerBlock, "row_units",
                      "row_units must have ", blocks * kRowsPerBlock, " entries, got ",
                      row_units.numel());
  return blocks;
}

// The table arguments' ints, and the shapes of the index, bitmask, masks and codebooks they
// imply. Values (the payload's length against the index, masks within the chunk width) are the
// backend's: the CPU checks them here, the CUDA kernels as they read.
inline TableShape check_table_shapes(const at::Tensor& block_base, const at::Tensor& row_units,
                                     const at::Tensor& bitmask, const at::Tensor& mask,
                                     const at::Tensor& bitval, int64_t chunk_bits,
                                     int64_t row_bytes, int64_t unit_bytes, int64_t num_rows) {
  check_chunk_bits(chunk_bits);
  check_index_shapes(block_base, row_units, row_bytes, unit_bytes, num_rows);
  IBP_CHECK_TABLE_ARG(bitmask.numel() == (num_rows + 31) / 32, "bitmask", "bitmask must have ",
                      (num_rows + 31) / 32, " words, got ", bitmask.numel());
  const int v = chunks_per_row(row_bytes, static_cast<int>(chunk_bits));
  return TableShape{v, check_mask_shapes(mask, bitval, v)};
}

// A pooling code (format.h Pooling), as every pooled op takes it.
inline void check_pooling(int64_t pooling) {
  static_assert(static_cast<int>(Pooling::kSum) == 0 && static_cast<int>(Pooling::kMean) == 1,
                "the message below names the codes");
  TORCH_CHECK_VALUE(pooling == static_cast<int64_t>(Pooling::kSum) ||
                        pooling == static_cast<int64_t>(Pooling::kMean),
                    "pooling must be 0 (sum) or 1 (mean), got ", pooling);
}

// The dtype and pooling codes, and the number of fp32 outputs per bag.
inline int64_t check_pooling_args(int64_t dtype, int64_t pooling, int64_t row_bytes) {
  TORCH_CHECK_VALUE(dtype >= 0 && dtype <= static_cast<int64_t>(DType::kInt8Rowwise),
                    "unknown dtype code ", dtype);
  check_pooling(pooling);
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

// The decoded tier's pairing and shapes (format.h TableView::tier_dir): tier_dir int64
// [ceil(N / 64) * 2] (per 64 rows a bit word, then the tier rows before it) or empty (every row,
// row r at tier row r: then tier_rows has N rows), tier_rows uint8 [tier rows, stride >=
// row_bytes]. The CUDA impl reads no tier, but rejects what the CPU rejects.
inline void check_tier_shape(const std::optional<at::Tensor>& tier_dir,
                             const std::optional<at::Tensor>& tier_rows, int64_t num_rows,
                             int64_t row_bytes) {
  TORCH_CHECK_VALUE(tier_dir.has_value() == tier_rows.has_value(),
                    "tier_dir and tier_rows go together: pass both or neither");
  if (!tier_dir.has_value()) return;
  const int64_t words = tier_dir_words(num_rows);
  TORCH_CHECK_VALUE(
      tier_dir->dim() == 1 && (tier_dir->numel() == 2 * words || tier_dir->numel() == 0),
      "tier_dir must have ", 2 * words,
      " entries (two per 64 rows) or none, got "
      "shape ",
      tier_dir->sizes());
  TORCH_CHECK_VALUE(tier_rows->dim() == 2 && tier_rows->size(1) >= row_bytes,
                    "tier_rows must be [tier rows, >= ", row_bytes, "], got shape ",
                    tier_rows->sizes());
  TORCH_CHECK_VALUE(tier_dir->numel() != 0 || tier_rows->size(0) == num_rows,
                    "without tier_dir the tier holds every row: tier_rows must have ", num_rows,
                    " rows, got ", tier_rows->size(0));
}

}  // namespace ibpembed
