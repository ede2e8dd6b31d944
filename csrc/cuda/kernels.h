// SPDX-License-Identifier: Apache-2.0
//
// The interface between the CUDA op bindings (csrc/ops/lookup_ops_cuda.cpp, compiled by g++)
// and the kernels (csrc/cuda/*.cu, compiled by nvcc): plain structs of device pointers and one
// launcher per kernel family. Torch-free, so the kernels build with lean headers only.
//
// Every kernel validates what it reads and reports problems through an error word (ErrorBits,
// OR-ed in with atomicOr) instead of trapping; a warp that meets a bad index, bag or slot skips it,
// so invalid input can never make a kernel read outside the tensors it was given. The host reads
// the word once after the launch and raises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ibpembed/format.h"

namespace ibpembed::gpu {

enum ErrorBits : int32_t {
  kErrIndex = 1,    // an index outside [0, num_rows)
  kErrOffsets = 2,  // offsets not 0 .. nnz, non-decreasing
  kErrTable = 4,    // index, masks or slot sizes inconsistent with the payload
};

// A table whose pointers the device can dereference. view.payload is either device memory or the
// device alias of pinned host memory (zero-copy); it must be 16-byte aligned.
struct DeviceTable {
  TableView view;
  int64_t payload_bytes;  // readable bytes at view.payload
};

// out[dst(i)] = row(ids[i]) for i < n, where ids is sorted ascending and dst(i) = perm[i]
// (perm == nullptr: dst(i) = i). ids == nullptr means ids[i] = i (whole-table decompress).
struct GatherArgs {
  DeviceTable table;
  const int64_t* ids;
  const int64_t* perm;
  int64_t n;
  uint8_t* out;  // [n, row_bytes]
  int32_t* error;
};

// The pooled lookup of lookup.h, bag by bag, ids in request order.
struct PooledArgs {
  DeviceTable table;
  DType dtype;
  int64_t dim;  // pooled_dim(dtype, row_bytes) > 0
  const int64_t* ids;
  const int64_t* offsets;  // [num_bags + 1]
  int64_t num_bags;
  int64_t nnz;
  const float* weights;  // nullptr: every weight is 1
  Pooling pooling;
  float* out;  // [num_bags, dim]
  int32_t* error;
};

// Launch on `stream`; throw c10::Error on a launch failure or a row too wide for shared memory.
void launch_gather(const GatherArgs& args, cudaStream_t stream);
void launch_pooled(const PooledArgs& args, cudaStream_t stream);

}  // namespace ibpembed::gpu
