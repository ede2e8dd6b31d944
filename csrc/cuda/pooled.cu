// SPDX-License-Identifier: Apache-2.0
//
// Launches the fused decode + pooling kernel (pooled_kernel.cuh) for one chunk width: every part
// of the launch in one grid.
#include "launch_plan.cuh"
#include "pooled_kernel.cuh"

namespace ibpembed::gpu {
namespace {

template <int W>
void launch_pooled_w(const PooledArgs& a, const PooledShape& shape, cudaStream_t stream) {
  const Staging st = staging_with(shape.stage_bytes);
  const LaunchShape launch =
      plan_launch(pooled_kernel<W>, pooled_smem_per_warp(shape), a.bag_start[a.num_parts]);
  const int threads = launch.warps_per_block * kWarpSize;
  pooled_kernel<W><<<launch.blocks, threads, launch.smem_bytes, stream>>>(a, st, shape);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_pooled(const PooledArgs& args, int chunk_bits, const PooledShape& shape,
                   cudaStream_t stream) {
  if (args.num_parts == 0 || args.bag_start[args.num_parts] == 0) return;
  switch (chunk_bits) {
    case 16: return launch_pooled_w<16>(args, shape, stream);
    case 32: return launch_pooled_w<32>(args, shape, stream);
    default: return launch_pooled_w<64>(args, shape, stream);
  }
}

}  // namespace ibpembed::gpu
