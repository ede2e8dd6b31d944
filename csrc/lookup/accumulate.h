// SPDX-License-Identifier: Apache-2.0
//
// The pooled-lookup inner loop, acc[d] += weight * value(row, d), chosen once at load time: an
// AVX2 version for the common dtypes where the CPU has it, numeric.h's portable loop otherwise.
// Both multiply then add each element separately (no FMA), so they give identical bits, the
// same bits as the CUDA kernels.
#pragma once

#include <cstdint>

#include "ibpembed/format.h"

namespace ibpembed {

using AccumulateFn = void (*)(DType dtype, const uint8_t* row, int64_t dim, float weight,
                              float* acc);

// The AVX2 loop (accumulate_avx2.cpp, the only file built with -mavx2); falls back to the
// portable loop for dtypes it does not vectorise.
void accumulate_row_avx2(DType dtype, const uint8_t* row, int64_t dim, float weight, float* acc);

// accumulate_row_avx2 where the CPU reports AVX2, else the portable loop.
AccumulateFn select_accumulate();

}  // namespace ibpembed
