// SPDX-License-Identifier: Apache-2.0
//
// Sorts a gather's ids on the GPU by their row bits only (kernels.h sort_ids): a radix sort over
// bit_width(num_rows - 1) bits instead of all 64 (about half the passes for tables of up to 2^32
// rows), as the paper authors' reference gather does. Ids outside [0, num_rows) sort by their low
// bits among the others; the kernel needs no order for correctness (runs form only on adjacent
// equal ids) and reports them.
#include <c10/cuda/CUDAException.h>
#include <cub/device/device_radix_sort.cuh>

#include "kernels.h"

namespace ibpembed::gpu {

size_t sort_ids_temp_bytes(int64_t n, int bits) {
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
      static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr), static_cast<int>(n), 0,
      bits));
  return bytes;
}

void sort_ids(const int64_t* ids, int64_t* sorted, const int64_t* positions, int64_t* perm,
              int64_t n, int bits, void* temp, size_t temp_bytes, cudaStream_t stream) {
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, sorted, positions, perm,
                                                 static_cast<int>(n), 0, bits, stream));
}

}  // namespace ibpembed::gpu
