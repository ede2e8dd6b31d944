// SPDX-License-Identifier: Apache-2.0
//
// AVX2 accumulation for fp32 and bf16 rows. Built with -mavx2 and without -mfma (setup.py), and
// only entered after a CPU-feature check (select_accumulate). Every helper it inlines has
// internal linkage (IBP_HD is `static inline` on the host), so none of this code can be chosen
// by the linker for a caller on a CPU without AVX2.
#include <immintrin.h>

#include "accumulate.h"
#include "ibpembed/numeric.h"

namespace ibpembed {
namespace {

void accumulate_f32(const uint8_t* row, int64_t dim, float weight, float* acc) {
  const __m256 w = _mm256_set1_ps(weight);
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m256 v = _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d);
    const __m256 a = _mm256_loadu_ps(acc + d);
    _mm256_storeu_ps(acc + d, _mm256_add_ps(a, _mm256_mul_ps(w, v)));
  }
  if (d < dim) accumulate_row(DType::kFloat32, row + 4 * d, dim - d, weight, acc + d);
}

void accumulate_bf16(const uint8_t* row, int64_t dim, float weight, float* acc) {
  const __m256 w = _mm256_set1_ps(weight);
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    // bf16 -> fp32 is a 16-bit left shift of the bits.
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d));
    const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    const __m256 a = _mm256_loadu_ps(acc + d);
    _mm256_storeu_ps(acc + d, _mm256_add_ps(a, _mm256_mul_ps(w, v)));
  }
  if (d < dim) accumulate_row(DType::kBFloat16, row + 2 * d, dim - d, weight, acc + d);
}

}  // namespace

void accumulate_row_avx2(DType dtype, const uint8_t* row, int64_t dim, float weight, float* acc) {
  switch (dtype) {
    case DType::kFloat32: return accumulate_f32(row, dim, weight, acc);
    case DType::kBFloat16: return accumulate_bf16(row, dim, weight, acc);
    default: return accumulate_row(dtype, row, dim, weight, acc);
  }
}

}  // namespace ibpembed
