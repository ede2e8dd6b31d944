// SPDX-License-Identifier: Apache-2.0
//
// The scalar reference path: portable bit loops, no ISA extensions. Always built, always
// selectable (IBPEMBED_CPU_PATH=ref), and the oracle the BMI2 path is tested against.
#include "row_kernels_impl.h"

namespace ibpembed {

const RowKernels& ref_row_kernels() {
  static const RowKernels kernels = detail::make_row_kernels<PortableBitOps>();
  return kernels;
}

}  // namespace ibpembed
