// SPDX-License-Identifier: Apache-2.0
//
// pext/pdep as the bit-op policy of row_codec.h. Included only by translation units compiled with
// -mbmi2 (row_kernels_bmi2.cpp, row_kernels_avx512.cpp). The anonymous namespace is deliberate:
// each of them keeps its own copy, which the linker can never hand to a path without BMI2.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace ibpembed {
namespace {

struct Bmi2BitOps {
  static constexpr bool kHardwareDeposit = true;
  static inline uint64_t deposit(uint64_t src, uint64_t mask) { return _pdep_u64(src, mask); }
  static inline uint64_t extract(uint64_t x, uint64_t mask) { return _pext_u64(x, mask); }
};

}  // namespace
}  // namespace ibpembed
