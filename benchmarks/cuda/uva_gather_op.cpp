// SPDX-License-Identifier: Apache-2.0
//
// torch.ops.ibpembed_bench.uva_gather(table, ids): registers the baseline of uva_gather.cu.
// table is a pinned CPU uint8 [N, row_bytes] tensor (row_bytes a multiple of 16), ids a CUDA int64
// tensor; the result is a CUDA uint8 [len(ids), row_bytes] tensor. Built by benchmarks/gpu_check
// with torch.utils.cpp_extension.load on the GPU machine only.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstdint>

namespace ibpembed_bench {

void launch_uva_gather(const uint8_t* table, int64_t row_bytes, const int64_t* ids, int64_t n,
                       uint8_t* out, cudaStream_t stream);

namespace {

at::Tensor uva_gather(const at::Tensor& table, const at::Tensor& ids) {
  TORCH_CHECK(table.is_cpu() && table.is_pinned() && table.dim() == 2 &&
                  table.scalar_type() == at::kByte && table.is_contiguous(),
              "table must be a pinned contiguous uint8 [N, row_bytes] CPU tensor");
  TORCH_CHECK(table.size(1) % 16 == 0, "row_bytes must be a multiple of 16");
  TORCH_CHECK(
      ids.is_cuda() && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
      "ids must be a contiguous 1-D int64 CUDA tensor");
  const c10::cuda::CUDAGuard guard(ids.device());
  void* alias = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&alias, table.data_ptr(), 0));
  at::Tensor out = at::empty({ids.numel(), table.size(1)}, ids.options().dtype(at::kByte));
  launch_uva_gather(static_cast<const uint8_t*>(alias), table.size(1), ids.data_ptr<int64_t>(),
                    ids.numel(), out.data_ptr<uint8_t>(),
                    c10::cuda::getCurrentCUDAStream(ids.device().index()).stream());
  return out;
}

}  // namespace

TORCH_LIBRARY(ibpembed_bench, m) { m.def("uva_gather(Tensor table, Tensor ids) -> Tensor"); }

TORCH_LIBRARY_IMPL(ibpembed_bench, CUDA, m) { m.impl("uva_gather", &uva_gather); }

}  // namespace ibpembed_bench
