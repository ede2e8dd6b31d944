// SPDX-License-Identifier: Apache-2.0
//
// Lookup semantics (torchrec / fbgemm vocabulary), shared by the CPU and CUDA backends.
//
//   gather:  out[i, :] = row(indices[i])                 bit-exact, any order, duplicates ok
//   pooled:  for bag b in [0, B):                          offsets has B + 1 entries,
//              L   = offsets[b + 1] - offsets[b]            offsets[0] = 0, offsets[B] = nnz,
//              acc = 0 (fp32)                               non-decreasing
//              for i in [offsets[b], offsets[b + 1]):
//                acc += w_i * value(row(indices[i]))       w_i = per_sample_weights[i] or 1
//              out[b] = acc            (SUM)
//              out[b] = acc * (1 / L)  (MEAN: one rounded fp32 reciprocal, then
//                                       multiplies; an empty bag stays 0)
//
// value() widens the stored element to fp32 exactly (numeric.h); accumulation is fp32, in index
// order within a bag. Every index must lie in [0, num_rows): validated before any work starts,
// never clamped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ibpembed/codec.h"
#include "ibpembed/format.h"

namespace ibpembed {

// Decode rows indices[0..n) into out[n, row_bytes], split across threads.
void gather_rows_cpu(const RowKernels& k, const TableView& t, const int64_t* indices, int64_t n,
                     uint8_t* out);

// Pooled lookup into out[num_bags, pooled_dim(dtype, row_bytes)] (fp32, overwritten).
void lookup_pooled_cpu(const RowKernels& k, const TableView& t, DType dtype, const int64_t* indices,
                       const int64_t* offsets, int64_t num_bags, const float* per_sample_weights,
                       Pooling pooling, float* out);

// The pooling loops pooled lookups run: "avx512", "avx2" or "portable", the widest this CPU runs
// unless set_pool_loops chose another. Every set gives the same bits; switching lets one host
// check every loop the build ships (tests).
const char* pool_loops_name();
// The sets this CPU runs, widest first.
std::vector<std::string> available_pool_loops();
// Switches to the set called `name`; false (and no switch) when this CPU cannot run it.
bool set_pool_loops(const std::string& name);

}  // namespace ibpembed
