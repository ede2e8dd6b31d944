// SPDX-License-Identifier: Apache-2.0
//
// Launches the fused decode + pooling kernel (pooled_kernel.cuh) for one table's chunk width.
#include "launch_plan.cuh"
#include "pooled_kernel.cuh"

namespace ibpembed::gpu {
namespace {

template <int W>
void launch_pooled_w(const PooledArgs& a, cudaStream_t stream) {
  const TableView& t = a.table.view;
  const Staging st = staging_for(t);
  const int64_t per_warp = pooled_smem_per_warp(t, st.buffer_bytes, a.dim);
  const LaunchShape shape = plan_launch(pooled_kernel<W>, per_warp, a.num_bags);
  pooled_kernel<W><<<shape.blocks, shape.warps_per_block * kWarpSize, shape.smem_bytes, stream>>>(
      a, st);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_pooled(const PooledArgs& args, cudaStream_t stream) {
  if (args.num_bags == 0) return;
  switch (args.table.view.chunk_bits) {
    case 16: return launch_pooled_w<16>(args, stream);
    case 32: return launch_pooled_w<32>(args, stream);
    default: return launch_pooled_w<64>(args, stream);
  }
}

}  // namespace ibpembed::gpu
