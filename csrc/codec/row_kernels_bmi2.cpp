// SPDX-License-Identifier: Apache-2.0
//
// The BMI2 path: pext/pdep for the bit extract/deposit. The only translation unit compiled with
// -mbmi2 (setup.py); it is entered only after cpu_has_bmi2() said yes. NOTE: everything here
// sits in an anonymous namespace so no BMI2-compiled inline function can be merged by the linker
// into code the reference path runs on a CPU without BMI2.
#include <immintrin.h>

#include "row_kernels_impl.h"

namespace ibpembed {
namespace {

struct Bmi2BitOps {
  static inline uint64_t deposit(uint64_t src, uint64_t mask) { return _pdep_u64(src, mask); }
  static inline uint64_t extract(uint64_t x, uint64_t mask) { return _pext_u64(x, mask); }
};

}  // namespace

const RowKernels& bmi2_row_kernels() {
  static const RowKernels kernels = detail::make_row_kernels<Bmi2BitOps>();
  return kernels;
}

}  // namespace ibpembed
