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

// Rows to prefetch while a run is pooled: as row k is read, the first line of rows[k] (k <
// count; null entries skipped) is prefetched into L1. The lean path's fixed-distance prefetch,
// as fbgemm's loop issues it; count 0 = none.
struct PrefetchAhead {
  const uint8_t* const* rows = nullptr;
  int64_t count = 0;
};

// acc[0, dim) += sum over k < count, in k order, of weights[k] * value(rows[k]) (weights may be
// null: every weight is 1).
using PoolRowsFn = void (*)(DType dtype, const uint8_t* const* rows, const float* weights,
                            int64_t count, int64_t dim, float* acc, const PrefetchAhead& ahead);

// The AVX2 loop (accumulate_avx2.cpp, the only file built with -mavx2): the bag's accumulators
// stay in registers across its rows. Falls back to the portable loop for the other dtypes.
void pool_rows_avx2(DType dtype, const uint8_t* const* rows, const float* weights, int64_t count,
                    int64_t dim, float* acc, const PrefetchAhead& ahead);

// Prefetches the first line of ahead.rows[k] into L1; always inlined (codec's NOTE on prefetch
// helpers: an out-of-line body of prefetches alone may be deleted as `const`).
// NOTE(lookup): one line, not the row's eight: a software prefetch holds an L1 fill buffer until
// its line arrives, so eight a row, 16 rows ahead, kept the buffers full and the loop waited on
// its own prefetches, while the core's adjacent-line and streaming prefetchers bring a row's
// other lines once its first is asked for. On 2 GiB of 512-byte fp32 rows (Intel Xeon VM, one
// thread, alternating builds) raw-row lookups ran 16-18 % faster with one line than with all
// (uniform 10.2-10.3 -> 11.8-12.2 M/s, Zipf 1.05 24.3-24.5 -> 27.8-28.9); two lines, the first
// and the middle one, the last one, or the first into L2 measured the same as one, and every
// line into L2 or L3 in between.
[[gnu::always_inline]] static inline void prefetch_ahead(const PrefetchAhead& ahead, int64_t k) {
  if (k >= ahead.count || ahead.rows[k] == nullptr) return;
  __builtin_prefetch(ahead.rows[k], 0, 3);
}

// The AVX-512 loop (accumulate_avx512.cpp): the same, 16 lanes wide.
void pool_rows_avx512(DType dtype, const uint8_t* const* rows, const float* weights,
                      int64_t count, int64_t dim, float* acc, const PrefetchAhead& ahead);

// The widest of those the CPU runs, else the portable loop.
PoolRowsFn select_pool_rows();

}  // namespace ibpembed
