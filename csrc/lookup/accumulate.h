// SPDX-License-Identifier: Apache-2.0
//
// The pooled-lookup inner loop, acc[d] += weight_k * value(row_k, d) over a run of rows of one
// bag, chosen once at load time: an AVX2 version for the common dtypes where the CPU has it,
// numeric.h's portable loop otherwise. Both multiply then add each element separately, row by row
// in order (no FMA, no reassociation), so they give identical bits, the same bits as the CUDA
// kernels.
#pragma once

#include <cstdint>

#include "ibpembed/format.h"

namespace ibpembed {

// Rows to prefetch while a run is pooled: as row k is read, the first `bytes` bytes of rows[k]
// (k < count; null entries skipped) are prefetched into L1. The lean path's fixed-distance
// prefetch, as fbgemm's loop issues it; count 0 = none.
struct PrefetchAhead {
  const uint8_t* const* rows = nullptr;
  int64_t count = 0;
  int64_t bytes = 0;
};

// acc[0, dim) += sum over k < count, in k order, of weights[k] * value(rows[k]) (weights may be
// null: every weight is 1).
using PoolRowsFn = void (*)(DType dtype, const uint8_t* const* rows, const float* weights,
                            int64_t count, int64_t dim, float* acc, const PrefetchAhead& ahead);

// The AVX2 loop (accumulate_avx2.cpp, the only file built with -mavx2): the bag's accumulators
// stay in registers across its rows. Falls back to the portable loop for the other dtypes.
void pool_rows_avx2(DType dtype, const uint8_t* const* rows, const float* weights, int64_t count,
                    int64_t dim, float* acc, const PrefetchAhead& ahead);

// Prefetches the first ahead.bytes bytes of ahead.rows[k] into L1; always inlined (codec's NOTE
// on prefetch helpers: an out-of-line body of prefetches alone may be deleted as `const`).
[[gnu::always_inline]] static inline void prefetch_ahead(const PrefetchAhead& ahead, int64_t k) {
  if (k >= ahead.count || ahead.rows[k] == nullptr) return;
  const uint8_t* row = ahead.rows[k];
  for (int64_t b = 0; b < ahead.bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

// The AVX-512 loop (accumulate_avx512.cpp): the same, 16 lanes wide.
void pool_rows_avx512(DType dtype, const uint8_t* const* rows, const float* weights,
                      int64_t count, int64_t dim, float* acc, const PrefetchAhead& ahead);

// The widest of those the CPU runs, else the portable loop.
PoolRowsFn select_pool_rows();

}  // namespace ibpembed
