// SPDX-License-Identifier: Apache-2.0
//
// The pooled-lookup inner loop, acc[d] += weight_k * value(row_k, d) over a run of rows of one
// bag, chosen once at load time: an AVX2 version for the common dtypes where the CPU has it,
// numeric.h's portable loop otherwise. Both multiply then add each element separately, row by row
// in order (no FMA, no reassociation), so they give identical bits, the same bits as the CUDA
// kernels.
#pragma once

#include <algorithm>
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

// Whole bags: for j < num_bags, out[j * dim, (j + 1) * dim) = the sum over k in
// [offsets[j] - base, offsets[j + 1] - base), in k order, of weights[k] * value(rows[k]) (weights
// indexed like rows, or null), out written without being read (an empty bag gets zeros). The
// sums start from +0.0, as pooling into a zero-filled bag does, so either way gives the same
// bits. `ahead` is indexed like rows. NOTE(lookup): one call for a batch's whole bags keeps a
// bag's overhead to zeroing and storing its accumulators in registers; run by run, each bag paid
// a call, its accumulators loaded from memory and spilled to the stack, and its prefetch setup.
// Raw rows, 1 GiB fp32 D = 128, Zipf 1.2, B = 512, one thread, against `F.embedding_bag` in the
// same process (development measurement): bags of 1-4 ids 0.51-0.65x run by run, 0.75-0.79x
// whole; bags of 1-39 ids 0.78-0.81x and 0.96-1.03x.
using PoolBagsFn = void (*)(DType dtype, const uint8_t* const* rows, const float* weights,
                            const int64_t* offsets, int64_t num_bags, int64_t base, int64_t dim,
                            float* out, const PrefetchAhead& ahead);

// The part of `ahead` that a run of `count` rows starting at row `begin` reads.
static inline PrefetchAhead prefetch_from(const PrefetchAhead& ahead, int64_t begin,
                                          int64_t count) {
  const int64_t left = std::max<int64_t>(0, std::min(count, ahead.count - begin));
  return PrefetchAhead{left > 0 ? ahead.rows + begin : nullptr, left, ahead.bytes};
}

// A PoolBagsFn through a PoolRowsFn, a bag at a time: the loop for widths and dtypes without a
// whole-bag loop of their own. Static, like every helper here: each ISA's translation unit keeps
// its own copy, so the linker never hands an AVX-512 build of it to a caller on a CPU without.
static inline void pool_bags_by_runs(PoolRowsFn pool_rows, DType dtype, const uint8_t* const* rows,
                                     const float* weights, const int64_t* offsets, int64_t num_bags,
                                     int64_t base, int64_t dim, float* out,
                                     const PrefetchAhead& ahead) {
  for (int64_t j = 0; j < num_bags; ++j) {
    const int64_t begin = offsets[j] - base;
    const int64_t count = offsets[j + 1] - base - begin;
    float* acc = out + j * dim;
    std::fill(acc, acc + dim, 0.0f);
    pool_rows(dtype, rows + begin, weights != nullptr ? weights + begin : nullptr, count, dim, acc,
              prefetch_from(ahead, begin, count));
  }
}

// The AVX2 loop (accumulate_avx2.cpp, the only file built with -mavx2): the bag's accumulators
// stay in registers across its rows. Falls back to the portable loop for the other dtypes.
void pool_rows_avx2(DType dtype, const uint8_t* const* rows, const float* weights, int64_t count,
                    int64_t dim, float* acc, const PrefetchAhead& ahead);
void pool_bags_avx2(DType dtype, const uint8_t* const* rows, const float* weights,
                    const int64_t* offsets, int64_t num_bags, int64_t base, int64_t dim, float* out,
                    const PrefetchAhead& ahead);

// Prefetches the first ahead.bytes bytes of ahead.rows[k] into L1; always inlined (codec's NOTE
// on prefetch helpers: an out-of-line body of prefetches alone may be deleted as `const`).
[[gnu::always_inline]] static inline void prefetch_ahead(const PrefetchAhead& ahead, int64_t k) {
  if (k >= ahead.count || ahead.rows[k] == nullptr) return;
  const uint8_t* row = ahead.rows[k];
  for (int64_t b = 0; b < ahead.bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

// The AVX-512 loop (accumulate_avx512.cpp): the same, 16 lanes wide.
void pool_rows_avx512(DType dtype, const uint8_t* const* rows, const float* weights, int64_t count,
                      int64_t dim, float* acc, const PrefetchAhead& ahead);
void pool_bags_avx512(DType dtype, const uint8_t* const* rows, const float* weights,
                      const int64_t* offsets, int64_t num_bags, int64_t base, int64_t dim,
                      float* out, const PrefetchAhead& ahead);

// The loops pooled lookups run (lookup.h pool_loops_name: the widest the CPU runs by default).
struct PoolLoops {
  PoolRowsFn rows;
  PoolBagsFn bags;
};
PoolLoops select_pool_loops();

}  // namespace ibpembed
