// SPDX-License-Identifier: Apache-2.0
//
// AVX2 pooling for fp32 and bf16 rows (pool_simd.h with 8-lane vectors). Built with -mavx2 and
// without -mfma (setup.py), and only entered after a CPU-feature check (select_pool_loops).
#include <immintrin.h>

#include "accumulate.h"
#include "ibpembed/numeric.h"

namespace ibpembed {
namespace {

#include "pool_simd.h"

struct Avx2 {
  using Vec = __m256;
  static constexpr int64_t kLanes = 8;
  static Vec load_acc(const float* p) { return _mm256_loadu_ps(p); }
  static void store_acc(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec broadcast(float w) { return _mm256_set1_ps(w); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  // kLanes fp32 values of a row from element d, widened from the stored dtype.
  template <DType kDType>
  static Vec load(const uint8_t* row, int64_t d) {
    if constexpr (kDType == DType::kFloat32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d);
    } else {  // bf16 -> fp32 is a 16-bit left shift of the bits
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
};

}  // namespace

void pool_rows_avx2(DType dtype, const uint8_t* const* rows, const float* weights, int64_t count,
                    int64_t dim, float* acc, const PrefetchAhead& ahead) {
  pool_rows_with<Avx2>(dtype, rows, weights, count, dim, acc, ahead);
}

void pool_bags_avx2(DType dtype, const uint8_t* const* rows, const float* weights,
                    const int64_t* offsets, int64_t num_bags, int64_t base, int64_t dim, float* out,
                    const PrefetchAhead& ahead) {
  pool_bags_with<Avx2>(dtype, rows, weights, offsets, num_bags, base, dim, out, ahead);
}

}  // namespace ibpembed
