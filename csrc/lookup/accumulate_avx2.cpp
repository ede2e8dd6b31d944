// SPDX-License-Identifier: Apache-2.0
//
// AVX2 pooling for fp32 and bf16 rows. Built with -mavx2 and without -mfma (setup.py), and only
// entered after a CPU-feature check (select_pool_rows). Every helper it inlines has internal
// linkage (IBP_HD is `static inline` on the host), so none of this code can be chosen by the
// linker for a caller on a CPU without AVX2.
#include <immintrin.h>

#include "accumulate.h"
#include "ibpembed/numeric.h"

namespace ibpembed {
namespace {

// Eight fp32 values of a row, widened from the stored dtype.
template <DType kDType>
__m256 load8(const uint8_t* row, int64_t d) {
  if constexpr (kDType == DType::kFloat32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d);
  } else {
    // bf16 -> fp32 is a 16-bit left shift of the bits.
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Columns [d0, d0 + 8 * kVecs) of every row, the accumulators held in registers; the first
// block of a run issues its prefetches, one row's lines per row pooled.
template <DType kDType, int kVecs>
void pool_block(const uint8_t* const* rows, const float* weights, int64_t count, int64_t d0,
                float* acc, const PrefetchAhead& ahead) {
  __m256 sum[kVecs];
  for (int v = 0; v < kVecs; ++v) sum[v] = _mm256_loadu_ps(acc + d0 + 8 * v);
  for (int64_t k = 0; k < count; ++k) {
    prefetch_ahead(ahead, k);
    const __m256 w = _mm256_set1_ps(weights != nullptr ? weights[k] : 1.0f);
    for (int v = 0; v < kVecs; ++v) {
      sum[v] = _mm256_add_ps(sum[v], _mm256_mul_ps(w, load8<kDType>(rows[k], d0 + 8 * v)));
    }
  }
  for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(acc + d0 + 8 * v, sum[v]);
}

template <DType kDType>
void pool(const uint8_t* const* rows, const float* weights, int64_t count, int64_t dim,
          float* acc, const PrefetchAhead& ahead) {
  const PrefetchAhead none{};
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) {
    pool_block<kDType, 8>(rows, weights, count, d, acc, d == 0 ? ahead : none);
  }
  for (; d + 8 <= dim; d += 8) {
    pool_block<kDType, 1>(rows, weights, count, d, acc, d == 0 ? ahead : none);
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

}  // namespace

void pool_rows_avx2(DType dtype, const uint8_t* const* rows, const float* weights, int64_t count,
                    int64_t dim, float* acc, const PrefetchAhead& ahead) {
  switch (dtype) {
    case DType::kFloat32: return pool<DType::kFloat32>(rows, weights, count, dim, acc, ahead);
    case DType::kBFloat16: return pool<DType::kBFloat16>(rows, weights, count, dim, acc, ahead);
    default:
      for (int64_t k = 0; k < count; ++k) {
        prefetch_ahead(ahead, k);
        accumulate_row(dtype, rows[k], dim, weights != nullptr ? weights[k] : 1.0f, acc);
      }
  }
}

}  // namespace ibpembed
