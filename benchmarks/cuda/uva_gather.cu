// SPDX-License-Identifier: Apache-2.0
//
// Baseline for benchmarks/gpu_check: the plain UVA gather the compressed kernels are measured
// against. out[i] = table[ids[i]] read straight from pinned host memory through its device alias,
// one warp per row, 16-byte loads, ids in request order, no staging, no decode. Benchmark-only
// (rows must be a multiple of 16 bytes; ids are trusted), never part of ibpembed._C.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace ibpembed_bench {
namespace {

constexpr int kWarpsPerBlock = 8;

// A budget of 4 blocks per SM (<= 64 registers): left to itself ptxas spills on sm_80.
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 4)
    uva_gather_kernel(const uint4* table, int64_t row_vecs, const int64_t* ids, int64_t n,
                      uint4* out) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; i < n;
       i += stride) {
    const uint4* src = table + ids[i] * row_vecs;
    uint4* dst = out + i * row_vecs;
    for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = src[v];
  }
}

}  // namespace

void launch_uva_gather(const uint8_t* table, int64_t row_bytes, const int64_t* ids, int64_t n,
                       uint8_t* out, cudaStream_t stream) {
  if (n == 0) return;
  int device = 0, sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, uva_gather_kernel,
                                                               kWarpsPerBlock * 32, 0));
  const int64_t blocks =
      std::min<int64_t>((n + kWarpsPerBlock - 1) / kWarpsPerBlock, int64_t{per_sm} * sms);
  uva_gather_kernel<<<static_cast<int>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      reinterpret_cast<const uint4*>(table), row_bytes / 16, ids, n, reinterpret_cast<uint4*>(out));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ibpembed_bench
