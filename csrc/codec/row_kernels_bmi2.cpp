// SPDX-License-Identifier: Apache-2.0
//
// The BMI2 path: pext/pdep for the bit extract/deposit. Compiled with -mbmi2 (setup.py); entered
// only after cpu_has_bmi2() said yes. NOTE: everything here sits in an anonymous namespace so no
// BMI2-compiled inline function can be merged by the linker into code the reference path runs on
// a CPU without BMI2.
#include "bmi2_bit_ops.h"
#include "row_kernels_impl.h"

namespace ibpembed {

const RowKernels& bmi2_row_kernels() {
  static const RowKernels kernels = detail::make_row_kernels<Bmi2BitOps>();
  return kernels;
}

}  // namespace ibpembed
