// SPDX-License-Identifier: Apache-2.0
//
// The portable scalar path: run-wise deposit/extract (bits.h), no ISA extensions. Always built,
// always selectable (IBPEMBED_CPU_PATH=ref), what CPUs without a fast pdep run, and the path the
// BMI2 and AVX-512 paths are compared with byte for byte.
#include "row_kernels_impl.h"

namespace ibpembed {

const RowKernels& ref_row_kernels() {
  static const RowKernels kernels = detail::make_row_kernels<PortableBitOps>();
  return kernels;
}

}  // namespace ibpembed
