// SPDX-License-Identifier: Apache-2.0
//
// The pooled-lookup inner loop, acc[d] += weight_k * value(row_k, d) over a run of rows of one
// bag, chosen once at load time: an AVX2 version for the common dtypes where the CPU has it,
// numeric.h's portable loop otherwise. Both multiply then add each element separately, row by row
// in order (no FMA, no reassociation), so they give identical bits, the same bits as the CUDA
// kernels.
#pragma once

#include <cstdint>

#include "ibpembed/format.h"

namespace ibpembed {

// acc[0, dim) += sum over k < count, in k order, of weights[k] * value(rows[k]) (weights may be
// null: every weight is 1).
using PoolRowsFn = void (*)(DType dtype, const uint8_t* const* rows, const float* weights,
                            int64_t count, int64_t dim, float* acc);

// The AVX2 loop (accumulate_avx2.cpp, the only file built with -mavx2): the bag's accumulators
// stay in registers across its rows. Falls back to the portable loop for the other dtypes.
void pool_rows_avx2(DType dtype, const uint8_t* const* rows, const float* weights, int64_t count,
                    int64_t dim, float* acc);

// pool_rows_avx2 where the CPU reports AVX2, else the portable loop.
PoolRowsFn select_pool_rows();

}  // namespace ibpembed
