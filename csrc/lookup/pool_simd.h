// SPDX-License-Identifier: Apache-2.0
//
// The SIMD pooling loop for fp32 and bf16 rows, written once over a vector policy V (lanes,
// load/add/mul/broadcast) and included by exactly one ISA translation unit per policy
// (accumulate_avx2.cpp, accumulate_avx512.cpp), inside its anonymous namespace: every
// instantiation keeps internal linkage, so the linker never hands one ISA's copy to a caller on a
// CPU without it, after accumulate.h and ibpembed/numeric.h. Each element is multiplied then
// added row by row in order (no FMA, no reassociation), so every policy gives the portable loop's
// bits.
#pragma once

// Columns [d0, d0 + V::kLanes * kVecs) of every row, the accumulators held in registers; the
// first block of a run issues its prefetches, one row's lines per row pooled. Unweighted runs
// skip the multiply (by 1.0f, exact: the same bits).
template <class V, DType kDType, int kVecs, bool kWeighted>
void pool_block(const uint8_t* const* rows, const float* weights, int64_t count, int64_t d0,
                float* acc, const PrefetchAhead& ahead) {
  typename V::Vec sum[kVecs];
  for (int v = 0; v < kVecs; ++v) sum[v] = V::load_acc(acc + d0 + V::kLanes * v);
  for (int64_t k = 0; k < count; ++k) {
    prefetch_ahead(ahead, k);
    const uint8_t* row = rows[k];
    if constexpr (kWeighted) {
      const typename V::Vec w = V::broadcast(weights[k]);
      for (int v = 0; v < kVecs; ++v) {
        sum[v] = V::add(sum[v], V::mul(w, V::template load<kDType>(row, d0 + V::kLanes * v)));
      }
    } else {
      for (int v = 0; v < kVecs; ++v) {
        sum[v] = V::add(sum[v], V::template load<kDType>(row, d0 + V::kLanes * v));
      }
    }
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
    case DType::kFloat32: return pool_simd<V, DType::kFloat32>(rows, weights, count, dim, acc, ahead);
    case DType::kBFloat16:
      return pool_simd<V, DType::kBFloat16>(rows, weights, count, dim, acc, ahead);
    default:
      for (int64_t k = 0; k < count; ++k) {
        prefetch_ahead(ahead, k);
        accumulate_row(dtype, rows[k], dim, weights != nullptr ? weights[k] : 1.0f, acc);
      }
  }
}
