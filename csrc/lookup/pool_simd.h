// SPDX-License-Identifier: Apache-2.0
//
// The SIMD pooling loop for fp32 and bf16 rows, written once over a vector policy V (lanes,
// zero/load/add/mul/broadcast) and included by exactly one ISA translation unit per policy
// (accumulate_avx2.cpp, accumulate_avx512.cpp), inside its anonymous namespace: every
// instantiation keeps internal linkage, so the linker never hands one ISA's copy to a caller on a
// CPU without it, after accumulate.h and ibpembed/numeric.h. Each element is multiplied then
// added row by row in order (no FMA, no reassociation), so every policy gives the portable loop's
// bits.
#pragma once

// sum[v] += weight * row's columns [d0 + V::kLanes * v, ...) for v < kVecs: one row into a block
// of accumulators held in registers. Unweighted rows skip the multiply (by 1.0f, exact: the
// same bits).
template <class V, DType kDType, int kVecs, bool kWeighted>
[[gnu::always_inline]] inline void add_row(typename V::Vec (&sum)[kVecs], const uint8_t* row,
                                           float weight, int64_t d0) {
  if constexpr (kWeighted) {
    const typename V::Vec w = V::broadcast(weight);
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      sum[v] = V::add(sum[v], V::mul(w, V::template load<kDType>(row, d0 + V::kLanes * v)));
    }
  } else {
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      sum[v] = V::add(sum[v], V::template load<kDType>(row, d0 + V::kLanes * v));
    }
  }
}

// Columns [d0, d0 + V::kLanes * kVecs) of every row, the accumulators held in registers; the
// first block of a run issues its prefetches, one row's lines per row pooled.
template <class V, DType kDType, int kVecs, bool kWeighted>
void pool_block(const uint8_t* const* rows, const float* weights, int64_t count, int64_t d0,
                float* acc, const PrefetchAhead& ahead) {
  typename V::Vec sum[kVecs];
  for (int v = 0; v < kVecs; ++v) sum[v] = V::load_acc(acc + d0 + V::kLanes * v);
  for (int64_t k = 0; k < count; ++k) {
    prefetch_ahead(ahead, k);
    add_row<V, kDType, kVecs, kWeighted>(sum, rows[k], kWeighted ? weights[k] : 1.0f, d0);
  }
  for (int v = 0; v < kVecs; ++v) V::store_acc(acc + d0 + V::kLanes * v, sum[v]);
}

template <class V, DType kDType, bool kWeighted>
void pool_dtype(const uint8_t* const* rows, const float* weights, int64_t count, int64_t dim,
                float* acc, const PrefetchAhead& ahead) {
  constexpr int64_t kWide = V::kLanes * 8;
  const PrefetchAhead none{};
  int64_t d = 0;
  for (; d + kWide <= dim; d += kWide) {
    pool_block<V, kDType, 8, kWeighted>(rows, weights, count, d, acc, d == 0 ? ahead : none);
  }
  for (; d + V::kLanes <= dim; d += V::kLanes) {
    pool_block<V, kDType, 1, kWeighted>(rows, weights, count, d, acc, d == 0 ? ahead : none);
  }
  if (d == dim) return;
  if (d == 0) {
    for (int64_t k = 0; k < count; ++k) prefetch_ahead(ahead, k);
  }
  constexpr int64_t kElemBytes = kDType == DType::kFloat32 ? 4 : 2;
  for (int64_t k = 0; k < count; ++k) {
    accumulate_row(kDType, rows[k] + kElemBytes * d, dim - d,
                   weights != nullptr ? weights[k] : 1.0f, acc + d);
  }
}

template <class V, DType kDType>
void pool_simd(const uint8_t* const* rows, const float* weights, int64_t count, int64_t dim,
               float* acc, const PrefetchAhead& ahead) {
  if (weights != nullptr) return pool_dtype<V, kDType, true>(rows, weights, count, dim, acc, ahead);
  pool_dtype<V, kDType, false>(rows, weights, count, dim, acc, ahead);
}

// The pooling entry point of a vector policy: fp32 and bf16 rows vectorised, the other dtypes
// through the portable loop.
template <class V>
void pool_rows_with(DType dtype, const uint8_t* const* rows, const float* weights, int64_t count,
                    int64_t dim, float* acc, const PrefetchAhead& ahead) {
  switch (dtype) {
    case DType::kFloat32:
      return pool_simd<V, DType::kFloat32>(rows, weights, count, dim, acc, ahead);
    case DType::kBFloat16:
      return pool_simd<V, DType::kBFloat16>(rows, weights, count, dim, acc, ahead);
    default:
      for (int64_t k = 0; k < count; ++k) {
        prefetch_ahead(ahead, k);
        accumulate_row(dtype, rows[k], dim, weights != nullptr ? weights[k] : 1.0f, acc);
      }
  }
}

// Whole bags of rows exactly kVecs vectors wide (dim == V::kLanes * kVecs, so a row is one
// register block): a bag's accumulators start at +0.0 in registers and are stored once.
// Prefetches as pool_block does, `ahead` indexed like rows.
template <class V, DType kDType, int kVecs, bool kWeighted>
void pool_bags_exact(const uint8_t* const* rows, const float* weights, const int64_t* offsets,
                     int64_t num_bags, int64_t base, float* out, const PrefetchAhead& ahead) {
  constexpr int64_t kDim = V::kLanes * kVecs;
  const PrefetchAhead prefetch = ahead;  // a copy the stores to `out` cannot alias
  int64_t k = offsets[0] - base;
  for (int64_t j = 0; j < num_bags; ++j) {
    typename V::Vec sum[kVecs];
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) sum[v] = V::zero();
    for (const int64_t end = offsets[j + 1] - base; k < end; ++k) {
      prefetch_ahead(prefetch, k);
      add_row<V, kDType, kVecs, kWeighted>(sum, rows[k], kWeighted ? weights[k] : 1.0f, 0);
    }
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) V::store_acc(out + j * kDim + V::kLanes * v, sum[v]);
  }
}

// Whether dim is 1, 2, 4 or 8 vectors, which pool_bags_exact then pooled.
template <class V, DType kDType, bool kWeighted>
bool pool_bags_exact_width(const uint8_t* const* rows, const float* weights, const int64_t* offsets,
                           int64_t num_bags, int64_t base, int64_t dim, float* out,
                           const PrefetchAhead& ahead) {
  switch (dim % V::kLanes == 0 ? dim / V::kLanes : 0) {
    case 8:
      pool_bags_exact<V, kDType, 8, kWeighted>(rows, weights, offsets, num_bags, base, out, ahead);
      return true;
    case 4:
      pool_bags_exact<V, kDType, 4, kWeighted>(rows, weights, offsets, num_bags, base, out, ahead);
      return true;
    case 2:
      pool_bags_exact<V, kDType, 2, kWeighted>(rows, weights, offsets, num_bags, base, out, ahead);
      return true;
    case 1:
      pool_bags_exact<V, kDType, 1, kWeighted>(rows, weights, offsets, num_bags, base, out, ahead);
      return true;
    default: return false;
  }
}

template <class V, DType kDType>
bool pool_bags_simd(const uint8_t* const* rows, const float* weights, const int64_t* offsets,
                    int64_t num_bags, int64_t base, int64_t dim, float* out,
                    const PrefetchAhead& ahead) {
  if (weights != nullptr) {
    return pool_bags_exact_width<V, kDType, true>(rows, weights, offsets, num_bags, base, dim, out,
                                                  ahead);
  }
  return pool_bags_exact_width<V, kDType, false>(rows, weights, offsets, num_bags, base, dim, out,
                                                 ahead);
}

// The whole-bag entry point of a vector policy: fp32 and bf16 rows of 1, 2, 4 or 8 vectors in
// the loop above, every other width and dtype a bag at a time through pool_rows_with.
template <class V>
void pool_bags_with(DType dtype, const uint8_t* const* rows, const float* weights,
                    const int64_t* offsets, int64_t num_bags, int64_t base, int64_t dim, float* out,
                    const PrefetchAhead& ahead) {
  const bool done =
      (dtype == DType::kFloat32 && pool_bags_simd<V, DType::kFloat32>(
                                       rows, weights, offsets, num_bags, base, dim, out, ahead)) ||
      (dtype == DType::kBFloat16 && pool_bags_simd<V, DType::kBFloat16>(
                                        rows, weights, offsets, num_bags, base, dim, out, ahead));
  if (!done) {
    pool_bags_by_runs(&pool_rows_with<V>, dtype, rows, weights, offsets, num_bags, base, dim, out,
                      ahead);
  }
}
