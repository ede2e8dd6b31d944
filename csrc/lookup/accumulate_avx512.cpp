// SPDX-License-Identifier: Apache-2.0
//
// AVX-512 pooling for fp32 and bf16 rows (pool_simd.h with 16-lane vectors): half the
// instructions of the AVX2 loop per row, which is what rows already in cache cost. Built with
// -mavx512f and without FMA contraction (setup.py), and only entered after a CPU-feature check
// (select_pool_loops).
#include <immintrin.h>

#include "accumulate.h"
#include "ibpembed/numeric.h"

namespace ibpembed {
namespace {

#include "pool_simd.h"

struct Avx512 {
  using Vec = __m512;
  static constexpr int64_t kLanes = 16;
  static Vec load_acc(const float* p) { return _mm512_loadu_ps(p); }
  static void store_acc(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec broadcast(float w) { return _mm512_set1_ps(w); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  template <DType kDType>
  static Vec load(const uint8_t* row, int64_t d) {
    if constexpr (kDType == DType::kFloat32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + d);
    } else {  // bf16 -> fp32 is a 16-bit left shift of the bits
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * d));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
};

}  // namespace

void pool_rows_avx512(DType dtype, const uint8_t* const* rows, const float* weights, int64_t count,
                      int64_t dim, float* acc, const PrefetchAhead& ahead) {
  pool_rows_with<Avx512>(dtype, rows, weights, count, dim, acc, ahead);
}

void pool_bags_avx512(DType dtype, const uint8_t* const* rows, const float* weights,
                      const int64_t* offsets, int64_t num_bags, int64_t base, int64_t dim,
                      float* out, const PrefetchAhead& ahead) {
  pool_bags_with<Avx512>(dtype, rows, weights, offsets, num_bags, base, dim, out, ahead);
}

}  // namespace ibpembed
