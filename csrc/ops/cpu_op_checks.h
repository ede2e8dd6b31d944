// SPDX-License-Identifier: Apache-2.0
//
// Checks and helpers the CPU op implementations share (codec_ops.cpp, lookup_ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <cstdint>

#include "ibpembed/bits.h"
#include "ibpembed/codec.h"
#include "op_checks.h"

namespace ibpembed {

inline void check_cpu_contiguous(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

// Validates masks and codebooks: CPU tensors of the right shapes, every mask within the chunk
// width and every codebook entry within its position's mask; returns the code width C.
inline int check_masks(const at::Tensor& mask, const at::Tensor& bitval, int64_t num_chunks,
                       int64_t chunk_bits) {
  check_cpu_contiguous(mask, "mask", at::kLong);
  check_cpu_contiguous(bitval, "bitval", at::kLong);
  const int code_bits = check_mask_shapes(mask, bitval, num_chunks);
  const int k = codebook_size(code_bits);
  const auto* m = reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>());
  const auto* b = reinterpret_cast<const uint64_t*>(bitval.data_ptr<int64_t>());
  const uint64_t outside = ~low_bits(static_cast<int>(chunk_bits));
  for (int64_t j = 0; j < num_chunks; ++j) {
    TORCH_CHECK_VALUE((m[j] & outside) == 0, "mask[", j, "] has bits above chunk_bits");
    for (int64_t e = j * k; e < (j + 1) * k; ++e) {
      TORCH_CHECK_VALUE((b[e] & ~m[j]) == 0, "bitval[", e, "] has bits outside mask[", j, "]");
    }
  }
  return code_bits;
}

// Asks for transparent huge pages under a fresh, not yet touched buffer. NOTE(ops): lookups touch
// rows at random, so with 4 KiB pages almost every row costs a TLB miss and a page walk: a decoded
// tier of every row of a 2 GiB table read through 4 KiB pages ran uniform-id lookups at a
// fraction of the same rows in the (huge-page) payload. Best effort: where THP is off the advice
// is ignored.
inline void advise_huge_pages(const at::Tensor& fresh) {
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  const auto begin = reinterpret_cast<uintptr_t>(fresh.data_ptr());
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (begin + static_cast<uintptr_t>(fresh.nbytes())) & ~(kHugePage - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
}

inline const RowKernels& active_kernels() { return row_kernels(active_cpu_path()); }

}  // namespace ibpembed
