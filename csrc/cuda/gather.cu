// SPDX-License-Identifier: Apache-2.0
//
// Launches the zero-copy gather kernel (gather_kernel.cuh) for one table's chunk width.
#include "gather_kernel.cuh"
#include "launch_plan.cuh"

namespace ibpembed::gpu {
namespace {

template <int W, bool Decode>
void launch_gather_mode(const GatherArgs& a, cudaStream_t stream) {
  const TableView& t = a.table.view;
  const Staging st = staging_for(t);
  const int64_t per_warp = gather_smem_per_warp(st.buffer_bytes);
  const LaunchShape shape = plan_launch(gather_kernel<W, Decode>, per_warp, a.n);
  gather_kernel<W, Decode>
      <<<shape.blocks, shape.warps_per_block * kWarpSize, shape.smem_bytes, stream>>>(a, st);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int W>
void launch_gather_w(const GatherArgs& a, cudaStream_t stream) {
  if (decode_rows()) return launch_gather_mode<W, true>(a, stream);
  return launch_gather_mode<W, false>(a, stream);
}

}  // namespace

void launch_gather(const GatherArgs& args, cudaStream_t stream) {
  if (args.n == 0) return;
  switch (args.table.view.chunk_bits) {
    case 16: return launch_gather_w<16>(args, stream);
    case 32: return launch_gather_w<32>(args, stream);
    default: return launch_gather_w<64>(args, stream);
  }
}

}  // namespace ibpembed::gpu
